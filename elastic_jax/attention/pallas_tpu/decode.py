"""Decode attention over the per-head cache on a TPU (Pallas Mosaic TPU), after the
reference's writes: grid (slot, key block); blocks past the position repeat the last visible
block's index, which the pipeline does not fetch again (the layout:
`attention.decode_reference`). The online softmax is the hybrid kernels' VMEM state
(`hybrid.state_update`), in base 2 here (scores scaled by `common.LOG2E`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from elastic_jax.attention.common import LOG2E, largest_block, tile_keywords
from elastic_jax.attention.decode_reference import stream_visible, write
from elastic_jax.attention.pallas_tpu.hybrid import Tiles, state_init, state_output, state_update
from elastic_jax.attention.reference import Streaming


def _tpu_kernel(meta_ref, pos_ref, q_ref, fk_ref, fv_ref, sk_ref, sv_ref, o_ref, acc_ref,
                m_ref, l_ref, *, num_full, block, sink_len, ring, streaming, scale):
  i, j = pl.program_id(0), pl.program_id(1)
  pos = pos_ref[i]
  q = q_ref[...]
  state = (m_ref, l_ref, acc_ref)
  pl.when(j == 0)(lambda: state_init(state))

  def update(k, v, ok):
    s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * (scale * LOG2E)
    state_update(state, s, ok, v, exp=jnp.exp2)

  @pl.when((i < num_full) & (j * block <= pos))
  def _():
    ok = (j * block + jnp.arange(block))[None, :] <= pos
    update(fk_ref[...], fv_ref[...], ok)

  @pl.when((i >= num_full) & (j == 0))
  def _():
    idx = jnp.arange(sk_ref.shape[0])[None, :]
    update(sk_ref[...], sv_ref[...], stream_visible(idx, pos, sink_len, ring, streaming))

  @pl.when(j == pl.num_programs(1) - 1)
  def _():
    o_ref[...] = state_output(state)


@tile_keywords(Tiles(), block="block_k")
@functools.partial(jax.jit, static_argnames=("sink_len", "ring", "streaming", "scale",
                                             "tiles", "interpret"))
def decode_attention(q_rows, k_rows, v_rows, full_k, full_v, start, full_row, full_pos, st_k,
                     st_v, layer, st_row, st_pos, *, sink_len: int, ring: int,
                     streaming: Streaming, scale: float, tiles: Tiles = Tiles(),
                     interpret: bool = False):
  """`decode_reference.reference` on the Pallas TPU kernel (the writes are the reference's
  scatters): tiles.block_k keys a step (the largest power of two up to it dividing the
  capacity); a slot's G queries are the one row tile. The former keyword block (now
  tiles.block_k) still works (deprecated)."""
  from jax.experimental.pallas import tpu as pltpu

  caches = write(q_rows, k_rows, v_rows, full_k, full_v, start, full_row, full_pos, st_k,
                 st_v, layer, st_row, st_pos, sink_len=sink_len, ring=ring)
  full_k, full_v, st_k, st_v = caches
  f, s_n = full_row.shape[0], st_row.shape[0]
  g, d = q_rows.shape[1:]
  cap, width = full_k.shape[1], st_k.shape[2]
  block = largest_block(cap, tiles.block_k) if cap % 8 == 0 else cap
  gp = max(8, g)
  q = jnp.pad(q_rows[jnp.concatenate([full_row, st_row])], ((0, 0), (0, gp - g), (0, 0)))
  pos = jnp.where(jnp.concatenate([full_row, st_row]) >= 0,
                  jnp.concatenate([full_pos, st_pos]), -1).astype(jnp.int32)
  meta = jnp.stack([jnp.asarray(start, jnp.int32), jnp.asarray(layer, jnp.int32)])
  last_f, last_s = max(f - 1, 0), max(s_n - 1, 0)

  def full_map(i, j, meta_ref, pos_ref):   # blocks past the position: the last visible one
    r = jnp.minimum(i, last_f)
    top = jnp.maximum(pos_ref[r], 0) // block
    return meta_ref[0] + r, jnp.where(i < f, jnp.minimum(j, top), 0), 0

  def st_map(i, j, meta_ref, pos_ref):
    return meta_ref[1], jnp.clip(i - f, 0, last_s), 0, 0

  kernel = functools.partial(_tpu_kernel, num_full=f, block=block, sink_len=sink_len,
                             ring=ring, streaming=streaming, scale=scale)
  out = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=(f + s_n, cap // block),
          in_specs=[pl.BlockSpec((None, gp, d), lambda i, j, *_: (i, 0, 0)),
                    pl.BlockSpec((None, block, d), full_map),
                    pl.BlockSpec((None, block, d), full_map),
                    pl.BlockSpec((None, None, width, d), st_map),
                    pl.BlockSpec((None, None, width, d), st_map)],
          out_specs=pl.BlockSpec((None, gp, d), lambda i, j, *_: (i, 0, 0)),
          scratch_shapes=[pltpu.VMEM((gp, d), jnp.float32), pltpu.VMEM((gp, 1), jnp.float32),
                          pltpu.VMEM((gp, 1), jnp.float32)]),
      out_shape=jax.ShapeDtypeStruct((f + s_n, gp, d), jnp.float32),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      interpret=pltpu.InterpretParams() if interpret else False,
      name="elastic_decode_attention_tpu",
  )(meta, pos, q.astype(full_k.dtype), full_k, full_v, st_k, st_v)
  return (out[:f, :g], out[f:, :g]), caches
