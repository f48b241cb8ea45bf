"""A key/value cache for decoding that keeps per head only what its attention mode reads.

The router decides each (layer, row, KV head)'s mode once, at prefill; decoding then reuses it.
A full head reads every earlier key, so it keeps all of them. A streaming (SSA) head reads only
its sink blocks and the last `local_blocks` blocks: it keeps the sink, and a ring of
`local_blocks * block` slots that each new token overwrites at `position % ring`. Decode memory
therefore shrinks with the MSR, where a dense cache keeps every position of every head.

Layout per layer (stacked over L in front of every array; shape letters as in model.py, plus
F full-head slots and S streaming-head slots per layer, M cache capacity in tokens):
  full_k, full_v [F, M, H]   full_b, full_h [F] (row and KV head of the slot)
  sink_k, sink_v [S, sink_len, H]   ring_k, ring_v [S, ring, H]   st_b, st_h [S]
A slot whose row index is B (out of range) is empty. F and S are the largest counts over the
layers, so a layer with fewer heads of a kind leaves slots empty. A query at position p in
block i of a streaming head sees the sink positions < min(sink_len, p + 1) and the ring's
positions q in [sink_len, p] with i - q // block < local_blocks: exactly `Streaming.allows`.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from elastic_jax.attention.reference import Streaming


@flax.struct.dataclass
class HeadCache:
  full_k: jax.Array
  full_v: jax.Array
  full_b: jax.Array
  full_h: jax.Array
  sink_k: jax.Array
  sink_v: jax.Array
  ring_k: jax.Array
  ring_v: jax.Array
  st_b: jax.Array
  st_h: jax.Array

  @property
  def nbytes(self) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self)))


def assign_slots(gates_lbk: np.ndarray) -> tuple[np.ndarray, ...]:
  """Host-side slot tables from concrete gates [L, B, K] (1 = full, 0 = streaming).

  Returns full_b, full_h [L, F] and st_b, st_h [L, S] (empty slots: row B, head 0); F or S
  is 0 when no layer has a head of that kind.
  """
  gates = np.asarray(gates_lbk) > 0.5
  n_layers, b, _ = gates.shape

  def table(mask):
    width = int(mask.reshape(n_layers, -1).sum(1).max())
    rows = np.full((n_layers, width), b, np.int32)
    heads = np.zeros((n_layers, width), np.int32)
    for layer in range(n_layers):
      rr, hh = np.nonzero(mask[layer])
      rows[layer, :rr.size], heads[layer, :rr.size] = rr, hh
    return rows, heads

  return (*table(gates), *table(~gates))


def dense_cache_bytes(n_layers, batch, kv_heads, capacity, head_dim, dtype) -> int:
  """Bytes of a cache that keeps every position of every head (keys and values)."""
  return 2 * n_layers * batch * kv_heads * capacity * head_dim * jnp.dtype(dtype).itemsize


def build(k_lbtkh, v_lbtkh, gates_lbk, lengths_b, capacity: int, streaming: Streaming
          ) -> HeadCache:
  """The cache after a prefill: keys/values of every layer [L, B, T, K, H] (rows may be
  right-padded; row b holds lengths_b[b] real tokens) and the decided gates [L, B, K]."""
  full_b, full_h, st_b, st_h = (jnp.asarray(x) for x in assign_slots(np.asarray(gates_lbk)))
  return _build(k_lbtkh, v_lbtkh, jnp.asarray(lengths_b, jnp.int32), full_b, full_h, st_b, st_h,
                capacity=capacity, streaming=streaming)


@functools.partial(jax.jit, static_argnames=("capacity", "streaming"))
def _build(k_lbtkh, v_lbtkh, lengths_b, full_b, full_h, st_b, st_h, *, capacity, streaming):
  n_layers, b, t = k_lbtkh.shape[:3]
  if capacity < t:
    raise ValueError(f"cache capacity {capacity} is below the prompt length {t}")
  sink_len = streaming.sink_blocks * streaming.block
  ring = streaming.local_blocks * streaming.block
  lengths_b = jnp.concatenate([lengths_b, jnp.zeros((1,), jnp.int32)])  # the empty row B
  layer = jnp.arange(n_layers)[:, None]

  def rows(x_lbtkh, rb, rh):          # -> [L, slots, T, H]; empty slots read row 0, zeroed
    got = x_lbtkh[layer, jnp.minimum(rb, b - 1), :, rh]
    return jnp.where((rb < b)[..., None, None], got, 0)

  def full(x):
    x = rows(x, full_b, full_h)
    pos = jnp.arange(t)[None, None]
    x = jnp.where((pos < lengths_b[full_b][..., None])[..., None], x, 0)
    return jnp.pad(x, ((0, 0), (0, 0), (0, capacity - t), (0, 0)))

  def sink(x):
    x = rows(x, st_b, st_h)[:, :, :min(sink_len, t)]
    pos = jnp.arange(x.shape[2])[None, None]
    x = jnp.where((pos < lengths_b[st_b][..., None])[..., None], x, 0)
    return jnp.pad(x, ((0, 0), (0, 0), (0, sink_len - x.shape[2]), (0, 0)))

  def ring_of(x):
    x = rows(x, st_b, st_h)
    last = lengths_b[st_b] - 1                                            # [L, S]
    slot = jnp.arange(ring)[None, None]
    pos = last[..., None] - jnp.mod(last[..., None] - slot, ring)          # [L, S, ring]
    ok = (pos >= sink_len) & (pos >= 0)
    got = jnp.take_along_axis(x, jnp.clip(pos, 0, t - 1)[..., None], axis=2)
    return jnp.where(ok[..., None], got, 0)

  return HeadCache(full(k_lbtkh), full(v_lbtkh), full_b, full_h, sink(k_lbtkh), sink(v_lbtkh),
                   ring_of(k_lbtkh), ring_of(v_lbtkh), st_b, st_h)


def attend(q_bnh, k_bkh, v_bkh, pos_b, cache: HeadCache, streaming: Streaming, scale: float
           ) -> tuple[jax.Array, HeadCache]:
  """One decode step of one layer: write the new token's key/value at position pos_b into the
  cache (one layer's slice, no leading L), then attend. Returns (out [B, N, H], new cache)."""
  b, n, h = q_bnh.shape
  kh = k_bkh.shape[1]
  q_bkgh = q_bnh.reshape(b, kh, n // kh, h)
  pos_b = jnp.concatenate([pos_b, jnp.zeros((1,), pos_b.dtype)])  # the empty row B
  sink_len, ring = cache.sink_k.shape[1], cache.ring_k.shape[1]

  def pick(x_bk, rb, rh):
    return x_bk[jnp.minimum(rb, b - 1), rh]

  def softmax_out(q_sgh, k_smh, v_smh, ok_sm):
    s = jnp.einsum("sgh,smh->sgm", q_sgh, k_smh, preferred_element_type=jnp.float32) * scale
    s = jnp.where(ok_sm[:, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("sgm,smh->sgh", p.astype(v_smh.dtype), v_smh)

  # Full heads: write at the token's position, attend to positions <= it.
  fb, fh = cache.full_b, cache.full_h
  fpos = pos_b[fb]
  slots = jnp.arange(fb.shape[0])
  full_k = cache.full_k.at[slots, fpos].set(pick(k_bkh, fb, fh), mode="drop")
  full_v = cache.full_v.at[slots, fpos].set(pick(v_bkh, fb, fh), mode="drop")
  ok = jnp.arange(full_k.shape[1])[None] <= fpos[:, None]
  out_full = softmax_out(pick(q_bkgh, fb, fh), full_k, full_v, ok)

  # Streaming heads: the sink holds positions < sink_len, the ring every later one.
  sb, sh = cache.st_b, cache.st_h
  spos = pos_b[sb]
  slots = jnp.arange(sb.shape[0])
  k_new, v_new = pick(k_bkh, sb, sh), pick(v_bkh, sb, sh)
  in_sink = spos < sink_len
  sink_at = jnp.where(in_sink, spos, sink_len)              # out of range: dropped
  ring_at = jnp.where(in_sink, ring, jnp.mod(spos, ring))
  sink_k = cache.sink_k.at[slots, sink_at].set(k_new, mode="drop")
  sink_v = cache.sink_v.at[slots, sink_at].set(v_new, mode="drop")
  ring_k = cache.ring_k.at[slots, ring_at].set(k_new, mode="drop")
  ring_v = cache.ring_v.at[slots, ring_at].set(v_new, mode="drop")
  ring_pos = spos[:, None] - jnp.mod(spos[:, None] - jnp.arange(ring)[None], ring)
  block = streaming.block
  ring_ok = ((ring_pos >= sink_len)
             & (spos[:, None] // block - ring_pos // block < streaming.local_blocks))
  sink_ok = jnp.arange(sink_len)[None] <= spos[:, None]
  out_st = softmax_out(pick(q_bkgh, sb, sh), jnp.concatenate([sink_k, ring_k], 1),
                       jnp.concatenate([sink_v, ring_v], 1),
                       jnp.concatenate([sink_ok, ring_ok], 1))

  out = jnp.zeros_like(q_bkgh)
  out = out.at[fb, fh].set(out_full.astype(out.dtype), mode="drop")
  out = out.at[sb, sh].set(out_st.astype(out.dtype), mode="drop")
  new = HeadCache(full_k, full_v, fb, fh, sink_k, sink_v, ring_k, ring_v, sb, sh)
  return out.reshape(b, n, h), new
