"""Decode attention over the per-head cache (generation/kv_cache.py): one new token per row.

Each (row, KV head) of a layer is a *slot*, and a program of the kernels serves one slot with
the G query heads of its KV head (GQA: the slot's keys are read once for the group):
  full slot       keys 0 .. p of its entry in the pool [P, M, H] (p the row's position; the
                  layer's entries are start .. start + F - 1);
  streaming slot  its sink and ring, one row of [L, S, W, H]: index j < sink_len holds position
                  j, index sink_len + r holds the latest position q <= p with q % ring == r; a
                  key is visible when its position is in the row's sink or local window
                  (`stream_visible`, `Streaming.allows`).
Every call also writes the new token's key and value into its slots (at p, or at the
sink/ring index of p) and returns the updated arrays. A slot names its row of the step's
queries, keys and values [B·K, ...] (row b·K + h); row -1 marks an empty slot (padding of the
slot tables), which gets zeros and writes nothing.


`reference` here is the spec; the kernels live in each backend's `decode.py` and
`elastic_jax.generation.decode.attention` picks one.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from elastic_jax.attention.reference import Streaming


def stream_visible(j, pos, sink_len: int, ring: int, streaming: Streaming):
  """Whether index j of a streaming slot's row (sink then ring) holds a key that a query at
  position pos (>= -1) sees; broadcasting."""
  r = j - sink_len
  held = pos - jnp.mod(pos - r, ring)                    # the ring index's latest position
  in_sink = (j < sink_len) & (j <= pos)
  in_ring = (j >= sink_len) & (r < ring) & (held >= sink_len) & streaming.allows(pos, held)
  return in_sink | in_ring


def stream_index(pos, sink_len: int, ring: int):
  """Where a streaming slot keeps position pos: the sink below sink_len, else the ring."""
  return jnp.where(pos < sink_len, pos, sink_len + jnp.mod(pos, ring))


def write(q_rows, k_rows, v_rows, full_k, full_v, start, full_row, full_pos, st_k, st_v,
          layer, st_row, st_pos, *, sink_len: int, ring: int):
  """The new keys and values written into the layer's slots (scatters): (full_k, full_v,
  st_k, st_v)."""
  del q_rows
  fslot = jnp.where(full_row >= 0, start + jnp.arange(full_row.shape[0]), full_k.shape[0])
  full_k = full_k.at[fslot, full_pos].set(k_rows[full_row], mode="drop")
  full_v = full_v.at[fslot, full_pos].set(v_rows[full_row], mode="drop")
  at = jnp.where(st_row >= 0, stream_index(st_pos, sink_len, ring), st_k.shape[2])
  slots = jnp.arange(st_row.shape[0])
  st_k = st_k.at[layer, slots, at].set(k_rows[st_row], mode="drop")
  st_v = st_v.at[layer, slots, at].set(v_rows[st_row], mode="drop")
  return full_k, full_v, st_k, st_v


def masked_softmax(q_gh, k_mh, v_mh, ok_m, scale):
  """Attention of the G queries of each slot over its M keys where `ok` [..., M] holds, in
  float32 ([..., G, H]; a slot with no visible key gives zeros). Leading dims: the slots."""
  s = jnp.einsum("...gh,...mh->...gm", q_gh, k_mh, preferred_element_type=jnp.float32) * scale
  s = jnp.where(ok_m[..., None, :], s, -jnp.inf)
  m = jnp.max(s, -1, keepdims=True)
  p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
  l = p.sum(-1, keepdims=True)
  out = jnp.einsum("...gm,...mh->...gh", p.astype(v_mh.dtype), v_mh,
                   preferred_element_type=jnp.float32)
  return out / jnp.where(l == 0, 1.0, l)


def reference(q_rows, k_rows, v_rows, full_k, full_v, start, full_row, full_pos, st_k, st_v,
              layer, st_row, st_pos, *, sink_len: int, ring: int, streaming: Streaming,
              scale: float):
  """((out of the full slots [F, G, H], of the streaming slots [S, G, H]) in float32, the
  written full_k, full_v, st_k, st_v)."""
  full_k, full_v, st_k, st_v = write(
      q_rows, k_rows, v_rows, full_k, full_v, start, full_row, full_pos, st_k, st_v, layer,
      st_row, st_pos, sink_len=sink_len, ring=ring)
  width = full_row.shape[0]
  win_k = lax.dynamic_slice_in_dim(full_k, start, width, 0)
  win_v = lax.dynamic_slice_in_dim(full_v, start, width, 0)
  ok = (jnp.arange(full_k.shape[1])[None] <= full_pos[:, None]) & (full_row[:, None] >= 0)
  out_full = masked_softmax(q_rows[full_row], win_k, win_v, ok, scale)
  j = jnp.arange(st_k.shape[2])[None]
  ok = stream_visible(j, st_pos[:, None], sink_len, ring, streaming) & (st_row[:, None] >= 0)
  out_st = masked_softmax(q_rows[st_row], st_k[layer], st_v[layer], ok, scale)
  return (out_full, out_st), (full_k, full_v, st_k, st_v)


def paged_reference(q_bkgh, k_pool, v_pool, table, full, pos_b, *, sink_len: int, ring: int,
                    streaming: Streaming, scale: float):
  """Decode attention over a paged pool (generation/paged.py), after the new keys are
  written: each slot (row b, KV head k) reads its pages table [B, K, S] of the pool [P, page,
  H]; a full slot sees indices 0 .. pos, a streaming slot its sink and ring (`stream_visible`);
  a row at position -1 gets zeros. q [B, K, G, H] -> float32 [B, K, G, H].

  This is the spec: it gathers every slot's whole table (S pages), which the kernel
  (`pallas_gpu.paged.paged_attention`) does not."""
  b, kh, g, h = q_bkgh.shape
  num_pages, page, _ = k_pool.shape
  span = table.shape[-1] * page
  keys = jnp.take(k_pool, table, axis=0, mode="clip").reshape(b, kh, span, h)
  values = jnp.take(v_pool, table, axis=0, mode="clip").reshape(b, kh, span, h)
  j = jnp.arange(span)[None, None]
  p3 = pos_b.astype(jnp.int32)[:, None, None]                        # [B, 1, 1]
  ok = jnp.where(full[..., None], j <= p3, stream_visible(j, p3, sink_len, ring, streaming))
  ok = ok & (p3 >= 0)
  return masked_softmax(q_bkgh, keys, values, ok, scale)
