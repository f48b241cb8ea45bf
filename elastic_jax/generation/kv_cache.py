"""A key/value cache for decoding that keeps per head only what its attention mode reads.

The router decides each (layer, row, KV head)'s mode once, at prefill; decoding then reuses it.
A full head reads every earlier key, so it keeps all of them. A streaming (SSA) head reads only
its sink blocks and the last `local_blocks` blocks: it keeps the sink, and a ring of
`local_blocks * block` slots that each new token overwrites at `position % ring`. Decode memory
therefore shrinks with the MSR, where a dense cache keeps every position of every head.

Layout (shape letters as in model.py, plus M the cache capacity in tokens):
  full_k, full_v [P, M, H]  one pool of full-head slots for all layers, layer by layer:
      layer l owns slots full_start[l] .. full_start[l] + n_l - 1 (n_l its full heads), so
      the pool holds as many slots as there are full heads (plus at most F - 1 spare at the
      end, F = max n_l, so that every layer can read a window of F slots);
  full_start [L]; full_b, full_h [L, F]  row and KV head of each slot of a layer's window
      (row B, out of range, for the window's slots that belong to the next layer);
  st_k, st_v [L, S, W, H]; st_b, st_h [L, S]  streaming slots, S the most any layer has (a
      few blocks each, so the padding is small): per slot the sink (indices < sink_len, one
      per position) then a ring of `ring` slots (index sink_len + q % ring holds position q),
      W = sink_len + ring rounded up to a multiple of 16 (the rest never written or read).
The layer-by-layer prefill (prefill.py) gives instead a list of one such cache per layer
(L = 1 each, its pool exactly that layer's full heads), as it decides a layer's modes only
once the earlier layers ran. Decoding writes one token per slot in place (`decode_step`
carries the cache through its loop over layers) and reads the layer's slots in one launch
(`attention.decode`). A query at
position p in block i of a streaming head sees the sink positions < min(sink_len, p + 1) and
the ring's positions q in [sink_len, p] with i - q // block < local_blocks: exactly
`Streaming.allows`.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from elastic_jax.generation import aot
from elastic_jax.generation import decode
from elastic_jax.attention.reference import Streaming


def stream_width(streaming: Streaming) -> int:
  """W: the sink and the ring of a streaming slot, rounded up to a multiple of 16."""
  n = streaming.block * (streaming.sink_blocks + streaming.local_blocks)
  return -(-n // 16) * 16


@flax.struct.dataclass
class HeadCache:
  full_k: jax.Array
  full_v: jax.Array
  full_start: jax.Array
  full_b: jax.Array
  full_h: jax.Array
  st_k: jax.Array
  st_v: jax.Array
  st_b: jax.Array
  st_h: jax.Array
  slot_of: jax.Array


@dataclasses.dataclass(frozen=True)
class Slots:
  """Host-side slot tables (numpy int32); see the module docstring for the layout."""
  full_start: np.ndarray        # [L]
  full_b: np.ndarray            # [L, F]
  full_h: np.ndarray            # [L, F]
  pool_l: np.ndarray            # [P] layer, row (B: spare) and head held by each pool slot
  pool_b: np.ndarray
  pool_h: np.ndarray
  st_b: np.ndarray              # [L, S]
  st_h: np.ndarray
  slot_of: np.ndarray           # [L, B * K] the slot of (row b, KV head h) at b * K + h:
                                # i < F its full slot i, F + i its streaming slot i


def assign_slots(gates_lbk: np.ndarray) -> Slots:
  """Slot tables from concrete gates [L, B, K] (1 = full, 0 = streaming)."""
  gates = np.asarray(gates_lbk) > 0.5
  n_layers, b, _ = gates.shape

  def per_layer(mask):
    rows_heads = [np.nonzero(mask[layer]) for layer in range(n_layers)]
    width = max(rr.size for rr, _ in rows_heads)
    rows = np.full((n_layers, width), b, np.int32)
    heads = np.zeros((n_layers, width), np.int32)
    for layer, (rr, hh) in enumerate(rows_heads):
      rows[layer, :rr.size], heads[layer, :rr.size] = rr, hh
    return rows, heads

  full_b, full_h = per_layer(gates)
  st_b, st_h = per_layer(~gates)
  counts = (full_b < b).sum(1)
  start = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int32)
  size = int((start + full_b.shape[1]).max()) if full_b.shape[1] else 0
  pool_l, pool_b, pool_h = (np.zeros(size, np.int32), np.full(size, b, np.int32),
                            np.zeros(size, np.int32))
  for layer in range(n_layers):
    n = counts[layer]
    at = slice(start[layer], start[layer] + n)
    pool_l[at], pool_b[at], pool_h[at] = layer, full_b[layer, :n], full_h[layer, :n]
  # A window's slots past the layer's own belong to the next layer (or are spare): row B.
  kh = gates.shape[2]
  slot_of = np.zeros((n_layers, b * kh), np.int32)
  for layer in range(n_layers):
    for i, (rb, rh) in enumerate(zip(full_b[layer], full_h[layer])):
      if rb < b:
        slot_of[layer, rb * kh + rh] = i
    for i, (rb, rh) in enumerate(zip(st_b[layer], st_h[layer])):
      if rb < b:
        slot_of[layer, rb * kh + rh] = full_b.shape[1] + i
  return Slots(start, full_b, full_h, pool_l, pool_b, pool_h, st_b, st_h, slot_of)


def dense_cache_bytes(n_layers, batch, kv_heads, capacity, head_dim, dtype) -> int:
  """Bytes of a cache that keeps every position of every head (keys and values)."""
  return 2 * n_layers * batch * kv_heads * capacity * head_dim * jnp.dtype(dtype).itemsize


def build(k_lrtkh, v_lrtkh, gates_lbk, lengths_b, capacity: int, streaming: Streaming,
          row_b=None, offset_b=None, before_compile=None
          ) -> tuple[HeadCache, int | None, float]:
  """The cache after a prefill: keys/values of every layer [L, R, T, K, H] and the decided
  gates [L, B, K] (one layer's, L = 1, for the prefill that goes layer by layer). Request b
  holds lengths_b[b] tokens from index offset_b[b] of row row_b[b] (default: row b from index
  0, right-padded rows; packed rows hold several requests). Returns (the cache, the device
  bytes the build holds at its peak: `aot.footprint`, the seconds spent compiling it now);
  before_compile: as `aot.compiled`'s `before`."""
  if int(np.max(lengths_b)) > capacity:
    raise ValueError(f"cache capacity {capacity} is below a prompt's length "
                     f"{int(np.max(lengths_b))}")
  s = assign_slots(np.asarray(gates_lbk))
  b = np.asarray(gates_lbk).shape[1]
  row_b = np.arange(b) if row_b is None else row_b
  offset_b = np.zeros(b, np.int32) if offset_b is None else offset_b
  tables = [jnp.asarray(x) for x in (s.full_start, s.full_b, s.full_h, s.pool_l, s.pool_b,
                                      s.pool_h, s.st_b, s.st_h, s.slot_of)]
  args = (k_lrtkh, v_lrtkh, *(jnp.asarray(x, jnp.int32) for x in (lengths_b, row_b, offset_b)),
          *tables)
  run, compile_s = aot.compiled(_build, args, dict(capacity=capacity, streaming=streaming),
                                before_compile)
  return run(*args), aot.footprint(run), compile_s


def allocate(gates_lbk, capacity: int, streaming: Streaming, head_dim: int, dtype,
             fill=None) -> HeadCache:
  """An empty cache for concrete gates [L, B, K] (zeros, or `fill(key_index, shape, dtype)`
  for each of the four key/value arrays): the tables and shapes `build` gives, without a
  prefill (benchmarks of decoding, caches filled chunk by chunk)."""
  s = assign_slots(np.asarray(gates_lbk))
  n_layers = s.full_start.shape[0]
  shapes = [(s.pool_b.shape[0], capacity, head_dim)] * 2 + [
      (n_layers, s.st_b.shape[1], stream_width(streaming), head_dim)] * 2
  fill = fill or (lambda i, shape, dt: jnp.zeros(shape, dt))
  fk, fv, sk, sv = (fill(i, shape, dtype) for i, shape in enumerate(shapes))
  tables = [jnp.asarray(x) for x in (s.full_start, s.full_b, s.full_h, s.st_b, s.st_h,
                                      s.slot_of)]
  return HeadCache(fk, fv, *tables[:3], sk, sv, *tables[3:])


@functools.partial(jax.jit, static_argnames=("capacity", "streaming"))
def _build(k_lrtkh, v_lrtkh, lengths_b, row_b, offset_b, full_start, full_b, full_h, pool_l,
           pool_b, pool_h, st_b, st_h, slot_of, *, capacity, streaming):
  n_layers, _, t = k_lrtkh.shape[:3]
  span = min(t, capacity)             # a request's positions fit both
  sink_len = streaming.sink_blocks * streaming.block
  ring = streaming.local_blocks * streaming.block
  # The empty row B (slots of no request): no tokens.
  lengths_b, row_b, offset_b = (jnp.concatenate([x.astype(jnp.int32), jnp.zeros((1,), jnp.int32)])
                                for x in (lengths_b, row_b, offset_b))
  layer = jnp.arange(n_layers)[:, None]

  def gather(x_lrtkh, rl, rb, rh, pos):
    """Request rb's keys or values at positions pos [..., n] of layer rl, KV head rh (slot
    tables [...]): [..., n, H], zero where the request has no token."""
    at = jnp.clip(offset_b[rb][..., None] + pos, 0, t - 1)
    got = x_lrtkh[rl[..., None], row_b[rb][..., None], at, rh[..., None]]
    ok = (pos >= 0) & (pos < lengths_b[rb][..., None])
    return jnp.where(ok[..., None], got, 0)

  def full(x):                        # the pool [P, M, H]
    x = gather(x, pool_l, pool_b, pool_h, jnp.arange(span)[None])
    return jnp.pad(x, ((0, 0), (0, capacity - span), (0, 0)))

  def stream(x):                      # [L, S, W, H]: the sink, then the ring
    rl = jnp.broadcast_to(layer, st_b.shape)
    sink = gather(x, rl, st_b, st_h, jnp.arange(min(sink_len, span))[None, None])
    sink = jnp.pad(sink, ((0, 0), (0, 0), (0, sink_len - sink.shape[2]), (0, 0)))
    last = lengths_b[st_b][..., None] - 1                                # [L, S, 1]
    pos = last - jnp.mod(last - jnp.arange(ring)[None, None], ring)      # [L, S, ring]
    ring_x = gather(x, rl, st_b, st_h, jnp.where(pos >= sink_len, pos, -1))
    x = jnp.concatenate([sink, ring_x], axis=2)
    return jnp.pad(x, ((0, 0), (0, 0), (0, stream_width(streaming) - x.shape[2]), (0, 0)))

  return HeadCache(full(k_lrtkh), full(v_lrtkh), full_start, full_b, full_h, stream(k_lrtkh),
                   stream(v_lrtkh), st_b, st_h, slot_of)


def attend(q_bnh, k_bkh, v_bkh, pos_b, cache: HeadCache, layer, streaming: Streaming,
           scale: float, impl: str = "reference") -> tuple[jax.Array, HeadCache]:
  """One decode step of layer `layer`: write the new token's key/value at position pos_b into
  the layer's slots, in place, and attend (`attention.decode.attention` on `impl`, which does
  both). Returns (out [B, N, H], the updated cache)."""
  b, n, h = q_bnh.shape
  kh = k_bkh.shape[1]
  pos = jnp.concatenate([pos_b, jnp.zeros((1,), pos_b.dtype)])     # the empty row B
  fb, fh, sb, sh = (cache.full_b[layer], cache.full_h[layer], cache.st_b[layer],
                    cache.st_h[layer])
  (out_full, out_st), (full_k, full_v, st_k, st_v) = decode.attention(
      impl, q_bnh.reshape(b * kh, n // kh, h), k_bkh.reshape(b * kh, h),
      v_bkh.reshape(b * kh, h), cache.full_k, cache.full_v, cache.full_start[layer],
      jnp.where(fb < b, fb * kh + fh, -1), pos[fb], cache.st_k, cache.st_v, layer,
      jnp.where(sb < b, sb * kh + sh, -1), pos[sb],
      sink_len=streaming.block * streaming.sink_blocks,
      ring=streaming.block * streaming.local_blocks, streaming=streaming, scale=scale)
  # Each (row, KV head) reads its slot's output: full slots first, then streaming ones.
  out = jnp.concatenate([out_full, out_st]).astype(q_bnh.dtype)[cache.slot_of[layer]]
  new = cache.replace(full_k=full_k, full_v=full_v, st_k=st_k, st_v=st_v)
  return out.reshape(b, n, h), new
