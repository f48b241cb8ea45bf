"""Fused hybrid FA/SSA attention for TPUs in Pallas (Mosaic TPU), splash-attention style.

Grid (B, N, query tiles, KV steps). Each KV head's mode (sparse, full, mixed) is prefetched
into scalar memory and drives the K/V index maps: step j of a query tile fetches the j-th tile
that head needs (a streaming head: the sink tiles, then its local window); steps past the
head's last tile repeat that tile's index, so the pipeline issues no new DMA for them, and the
body skips their compute. The online-softmax state lives in VMEM scratch across the KV steps;
a mixed head keeps two (FA and SSA) and writes r * O_FA + (1 - r) * O_SSA.

No TPU is lent to this project: the kernel is tested in Pallas TPU interpret mode on CPU
(`interpret=True`), where it must match the reference. Its backward pass is the reference's.
Tiles mask every element for now; masking only the diagonal tiles (as the GPU kernel does)
is left for when a TPU can time it.

Shape letters: B batch, T tokens, N query heads, K KV heads, G = N / K, D head dim.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from elastic_jax.attention.common import (MODE_FULL, MODE_SPARSE, kernel_or_reference,
                                          modes_from_gate, pad_to, tile_ranges,
                                          with_reference_backward)
from elastic_jax.attention.reference import Streaming

_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def kv_schedule(mode, qi, j, block_q: int, block_k: int, streaming: Streaming):
  """(KV tile to fetch at step j, number of steps with work) for query tile qi.

  Full and mixed heads walk [0, causal_end); streaming heads walk the sink tiles then the
  window. Past the last needed step the last tile repeats (no new DMA).
  """
  sink_end, win_start, causal_end = tile_ranges(qi * block_q, block_q, block_k, streaming)
  lo2 = jnp.maximum(win_start, sink_end)
  sparse = mode == MODE_SPARSE
  n_visit = jnp.where(sparse, sink_end + causal_end - lo2, causal_end)

  def tile(step):
    return jnp.where(sparse & (step >= sink_end), lo2 + step - sink_end, step)

  return jnp.where(j < n_visit, tile(j), tile(n_visit - 1)), n_visit


def _kernel(modes_ref, gate_ref, q_ref, k_ref, v_ref, o_ref, m_fa, l_fa, acc_fa, m_sa, l_sa,
            acc_sa, *, scale, block_q, block_k, seq_len, num_kv_heads, groups, kv_steps,
            streaming: Streaming):
  b, h, qi, j = (pl.program_id(i) for i in range(4))
  slot = b * num_kv_heads + h // groups
  mode = modes_ref[slot]

  @pl.when(j == 0)
  def _init():
    for m, l, acc in ((m_fa, l_fa, acc_fa), (m_sa, l_sa, acc_sa)):
      m[...] = jnp.full(m.shape, _MASK_VALUE, jnp.float32)
      l[...] = jnp.zeros(l.shape, jnp.float32)
      acc[...] = jnp.zeros(acc.shape, jnp.float32)

  tile, n_visit = kv_schedule(mode, qi, j, block_q, block_k, streaming)

  @pl.when(j < n_visit)
  def _visit():
    q = q_ref[...]
    k = k_ref[...]
    v = v_ref[...]
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * scale
    q_idx = qi * block_q + jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
    k_idx = tile * block_k + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    causal = (k_idx <= q_idx) & (k_idx < seq_len)
    q_blk, k_blk = q_idx // streaming.block, k_idx // streaming.block
    window = causal & ((k_blk < streaming.sink_blocks) |
                       (q_blk - k_blk < streaming.local_blocks))

    def update(m_ref, l_ref, acc_ref, ok):
      sm = jnp.where(ok, s, _MASK_VALUE)
      m_prev = m_ref[...]                      # [block_q, 1]
      m_new = jnp.maximum(m_prev, sm.max(axis=-1, keepdims=True))
      p = jnp.where(ok, jnp.exp(sm - m_new), 0.0)
      corr = jnp.exp(m_prev - m_new)
      l_ref[...] = l_ref[...] * corr + p.sum(axis=-1, keepdims=True)
      acc_ref[...] = acc_ref[...] * corr + jax.lax.dot_general(
          p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
      m_ref[...] = m_new

    @pl.when(mode != MODE_SPARSE)
    def _full():
      update(m_fa, l_fa, acc_fa, causal)

    @pl.when(mode != MODE_FULL)
    def _sparse():
      update(m_sa, l_sa, acc_sa, window)

  @pl.when(j == kv_steps - 1)
  def _finish():
    def out(l, acc):
      return acc[...] / jnp.where(l[...] == 0.0, 1.0, l[...])
    r = jnp.where(mode == MODE_SPARSE, 0.0, jnp.where(mode == MODE_FULL, 1.0, gate_ref[slot]))
    fa = jnp.where(mode == MODE_SPARSE, 0.0, out(l_fa, acc_fa))
    sa = jnp.where(mode == MODE_FULL, 0.0, out(l_sa, acc_sa))
    o_ref[...] = (r * fa + (1.0 - r) * sa).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("streaming", "block_q", "block_k", "interpret"))
def hybrid_forward(q, k, v, gate_bk, streaming: Streaming, *, block_q: int = 128,
                   block_k: int = 128, interpret: bool = False):
  """The kernel: q [B, T, N, D], k/v [B, T, K, D], gate [B, K] -> [B, T, N, D] (q's dtype)."""
  b, t, n, d = q.shape
  kh = k.shape[2]
  groups = n // kh
  # Tiles shrink for short inputs but stay multiples of 8 rows (the TPU sublane count).
  block_q = min(block_q, max(8, -(-t // 8) * 8))
  block_k = min(block_k, max(8, -(-t // 8) * 8))
  tp = t + (-t % math.lcm(block_q, block_k))
  # [B, heads, T, D]: each tile is a (rows, D) matrix, the layout TPU tiles want.
  qt, kt, vt = (pad_to(x, 1, tp).transpose(0, 2, 1, 3) for x in (q, k, v))
  gate = gate_bk.astype(jnp.float32).reshape(-1)
  modes = modes_from_gate(gate)
  nq, kv_steps = tp // block_q, tp // block_k

  def kv_map(bi, hi, qi, j, modes_ref):
    tile, _ = kv_schedule(modes_ref[bi * kh + hi // groups], qi, j, block_q, block_k,
                          streaming)
    return bi, hi // groups, tile, 0

  kernel = functools.partial(
      _kernel, scale=d ** -0.5, block_q=block_q, block_k=block_k, seq_len=t,
      num_kv_heads=kh, groups=groups, kv_steps=kv_steps, streaming=streaming)
  scratch = [pltpu.VMEM((block_q, 1), jnp.float32), pltpu.VMEM((block_q, 1), jnp.float32),
             pltpu.VMEM((block_q, d), jnp.float32)] * 2
  out = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(b, n, nq, kv_steps),
          in_specs=[
              pl.BlockSpec(memory_space=pltpu.SMEM),
              pl.BlockSpec((None, None, block_q, d), lambda bi, hi, qi, j, m: (bi, hi, qi, 0)),
              pl.BlockSpec((None, None, block_k, d), kv_map),
              pl.BlockSpec((None, None, block_k, d), kv_map),
          ],
          out_specs=pl.BlockSpec((None, None, block_q, d),
                                 lambda bi, hi, qi, j, m: (bi, hi, qi, 0)),
          scratch_shapes=scratch),
      out_shape=jax.ShapeDtypeStruct((b, n, tp, d), q.dtype),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
      interpret=pltpu.InterpretParams() if interpret else False,
      name="elastic_hybrid_forward_tpu",
  )(modes, gate, qt, kt, vt)
  return out.transpose(0, 2, 1, 3)[:, :t]


_hybrid = with_reference_backward(
    lambda q, k, v, g, streaming, interpret: hybrid_forward(q, k, v, g, streaming,
                                                           interpret=interpret))
hybrid_attention = functools.partial(kernel_or_reference, _hybrid)
