"""Decode attention over the per-head cache on a GPU, in Pallas's Triton backend: one launch
for every slot of a layer, full and streaming (the layout: `attention.decode_reference`).

The writes happen in the kernel (the arrays are aliased in place). Slots are split along their
keys (flash-decoding) so that a batch of one fills the GPU: a full slot's programs read only
keys below p, so a step reads what is live, not the capacity; a streaming slot's width is cut
in pieces of 256 keys. The program whose range holds the new token's index takes its key and
value from the inputs and stores them; no program reads that index from the cache, so the
store races with no read. Every program's online softmax is `common.online_update`'s (base 2,
as the hybrid kernels'); the splits' partial softmaxes combine in jnp.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from elastic_jax.attention.common import (LOG2E, largest_block, online_init, online_update,
                                          tile_keywords)
from elastic_jax.attention.decode_reference import stream_index, stream_visible
from elastic_jax.attention.pallas_gpu.hybrid import Tiles
from elastic_jax.attention.reference import Streaming

# The decode kernel reads block_k (keys of a full slot's step: the largest power of two up to
# it dividing the capacity), num_warps and num_stages; not block_q (a slot's G queries, padded
# to 16, are one row tile).
DECODE_TILES = Tiles(block_k=64, num_stages=2, num_warps=4)


def _one_key(carry, q, k, v, qk_scale):
  """One key [H] (the new token's) into the online softmax of the queries q [G, H]: its
  scores and weighted value by elementwise products (no matrix product of one key)."""
  s = jnp.sum(q.astype(jnp.float32) * k.astype(jnp.float32)[None, :], axis=1) * qk_scale
  return online_update(carry, s[:, None], None, v[None, :],
                       product=lambda p, v: p * v.astype(jnp.float32))


def _triton_kernel(meta_ref, row_ref, pos_ref, q_ref, k_ref, v_ref, fk_in, fv_in, sk_in,
                   sv_in, o_ref, m_ref, l_ref, so_ref, sm_ref, sl_ref, fk_ref, fv_ref, sk_ref,
                   sv_ref, *, num_full, splits, chunk, block, st_splits, st_chunk, st_block,
                   width, sink_len, ring, streaming, scale):
  del fk_in, fv_in, sk_in, sv_in          # aliased to fk_ref, fv_ref, sk_ref, sv_ref
  prog = pl.program_id(0)
  is_full = prog < num_full * splits
  rest = prog - num_full * splits
  i = jnp.where(is_full, prog // splits, num_full + rest // st_splits)
  row = row_ref[i]
  live = row >= 0
  row = jnp.maximum(row, 0)
  q = q_ref[row]
  gp, d = q.shape
  qk_scale = scale * LOG2E
  init = online_init(gp, d)
  pos = jnp.where(live, pos_ref[i], -1)

  def walk(c, lo, hi, blk, load, visible):
    """Key blocks from index lo (a block multiple) up to hi, entries where visible(idx); hi
    never passes the array's end (a load there would read other memory, which a masked
    entry still multiplies by zero: NaN where that memory holds one)."""
    def body(j, c):
      s = jnp.dot(q, load(j, 0).T, preferred_element_type=jnp.float32) * qk_scale
      idx = j * blk + jnp.arange(blk)
      return online_update(c, s, visible(idx)[None, :], load(j, 1))
    return lax.fori_loop(lo // blk, jnp.maximum(lo, hi + blk - 1) // blk, body, c)

  def new_key(c, owns, out_refs, out_at, cache_refs, cache_at):
    """The program that owns the new token's index adds its key to the softmax and stores
    it; every program stores its partial softmax."""
    k_new, v_new = k_ref[row], v_ref[row]
    acc, m, l = lax.cond(owns, lambda: _one_key(c, q, k_new, v_new, qk_scale), lambda: c)
    for ref, x in zip(out_refs, (acc, m, l)):
      ref[out_at] = x

    @pl.when(owns)
    def _():
      for ref, x in zip(cache_refs, (k_new, v_new)):
        ref[cache_at] = x[None].astype(ref.dtype)

  @pl.when(is_full)
  def _():
    split = prog % splits
    slot = meta_ref[0] + i
    lo = split * chunk
    hi = jnp.minimum(lo + chunk, jnp.maximum(pos, 0))          # keys below the position
    load = lambda j, kv: (fk_ref, fv_ref)[kv][slot, pl.ds(j * block, block), :]
    c = walk(init, lo, hi, block, load, lambda idx: idx < hi)
    new_key(c, live & (lo <= pos) & (pos < lo + chunk), (o_ref, m_ref, l_ref), (i, split),
            (fk_ref, fv_ref), (slot, pl.ds(pos, 1), slice(None)))

  @pl.when(jnp.logical_not(is_full))
  def _():
    st, split = i - num_full, rest % st_splits
    layer = meta_ref[1]
    at = stream_index(pos, sink_len, ring)
    load = lambda j, kv: (sk_ref, sv_ref)[kv][layer, st, pl.ds(j * st_block, st_block), :]
    lo = split * st_chunk
    c = walk(init, lo, jnp.minimum(lo + st_chunk, width), st_block, load,
             lambda idx: stream_visible(idx, pos, sink_len, ring, streaming) & (idx != at))
    new_key(c, live & (lo <= at) & (at < lo + st_chunk), (so_ref, sm_ref, sl_ref),
            (st, split), (sk_ref, sv_ref), (layer, st, pl.ds(at, 1), slice(None)))


def combine_splits(o, m, l):
  """Partial softmaxes (base 2) [R, splits, ...] of key ranges into one [R, G, H]."""
  m_all = m.max(axis=1, keepdims=True)
  w = jnp.exp2(m - m_all) * (l > 0)
  l_all = (w * l).sum(1)
  return (w[..., None] * o).sum(1) / jnp.where(l_all == 0, 1.0, l_all)[..., None]


@tile_keywords(DECODE_TILES, "num_warps", "num_stages", block="block_k")
@functools.partial(jax.jit, static_argnames=("sink_len", "ring", "streaming", "scale",
                                             "splits", "tiles", "interpret"))
def decode_attention(q_rows, k_rows, v_rows, full_k, full_v, start, full_row, full_pos, st_k,
                     st_v, layer, st_row, st_pos, *, sink_len: int, ring: int,
                     streaming: Streaming, scale: float, splits: int | None = None,
                     tiles: Tiles = DECODE_TILES, interpret: bool = False):
  """`decode_reference.reference` on the Pallas Triton kernel. Needs a head dim that is a
  power of two >= 16 (`decode_applies`), a capacity M and a streaming width W that are
  multiples of 16. The former keywords block (now tiles.block_k), num_warps and num_stages
  still set the tiles' fields (deprecated)."""
  f, s_n = full_row.shape[0], st_row.shape[0]
  g, d = q_rows.shape[1:]
  cap, width = full_k.shape[1], st_k.shape[2]
  block = largest_block(cap, tiles.block_k)
  st_block = largest_block(width, 64)
  st_chunk = st_block * max(1, 256 // st_block)        # streaming slots: 256 keys a program
  st_splits = -(-width // st_chunk)
  if splits is None:   # about 512 programs of full slots, each at least one block long
    splits = max(1, min(cap // block, -(-512 // max(f, 1))))
  chunk = -(-cap // (splits * block)) * block
  splits = -(-cap // chunk)
  gp = max(16, pl.next_power_of_2(g))
  q = jnp.pad(q_rows, ((0, 0), (0, gp - g), (0, 0))).astype(full_k.dtype)
  n = pl.next_power_of_2(f + s_n)
  row = jnp.pad(jnp.concatenate([full_row, st_row]).astype(jnp.int32), (0, n - f - s_n),
                constant_values=-1)
  pos = jnp.pad(jnp.concatenate([full_pos, st_pos]).astype(jnp.int32), (0, n - f - s_n))
  meta = jnp.stack([jnp.asarray(start, jnp.int32), jnp.asarray(layer, jnp.int32)])
  whole = lambda x: pl.BlockSpec(x.shape, lambda p: (0,) * x.ndim)
  fo, so_n = max(f, 1), max(s_n, 1)
  partials = [jax.ShapeDtypeStruct((fo, splits, gp, d), jnp.float32),
              jax.ShapeDtypeStruct((fo, splits, gp), jnp.float32),
              jax.ShapeDtypeStruct((fo, splits, gp), jnp.float32),
              jax.ShapeDtypeStruct((so_n, st_splits, gp, d), jnp.float32),
              jax.ShapeDtypeStruct((so_n, st_splits, gp), jnp.float32),
              jax.ShapeDtypeStruct((so_n, st_splits, gp), jnp.float32)]
  caches = (full_k, full_v, st_k, st_v)
  out_shape = partials + [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in caches]
  kernel = functools.partial(
      _triton_kernel, num_full=f, splits=splits, chunk=chunk, block=block,
      st_splits=st_splits, st_chunk=st_chunk, st_block=st_block, width=width,
      sink_len=sink_len,
      ring=ring, streaming=streaming, scale=scale)
  operands = (meta, row, pos, q, k_rows, v_rows) + caches
  o, m, l, so, sm, sl, *caches = pl.pallas_call(
      kernel, grid=(f * splits + s_n * st_splits,),
      in_specs=[whole(x) for x in operands],
      out_specs=[whole(s) for s in out_shape],
      out_shape=out_shape,
      input_output_aliases={6 + i: 6 + i for i in range(4)},
      compiler_params=tiles.params(d),
      interpret=interpret, name="elastic_decode_attention",
  )(*operands)
  return (combine_splits(o, m, l)[:f, :g], combine_splits(so, sm, sl)[:s_n, :g]), tuple(caches)


def decode_applies(head_dim: int, capacity: int, width: int) -> bool:
  return (head_dim >= 16 and head_dim & (head_dim - 1) == 0 and capacity % 16 == 0
          and width % 16 == 0)
