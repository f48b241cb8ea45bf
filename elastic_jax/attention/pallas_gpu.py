"""Fused hybrid FA/SSA attention for GPUs in Pallas (Triton backend): one launch for all heads.

Every (query tile, batch, query head) program reads its KV head's mode from a small run-time
array, so one compilation serves every routing:
  SPARSE (r = 0)  visit the sink tiles, then the local window up to the diagonal;
  FULL   (r = 1)  visit every causal tile;
  MIX    (0<r<1)  visit every causal tile, keep two online softmaxes (SSA is a subset of FA)
                  and write r * O_FA + (1 - r) * O_SSA.
A sparse head's far-away tiles are never loaded: that is where the speed-up comes from.

The backward pass is, for now, the reference's (`jax.vjp` of `reference.hybrid_attention`):
gradients are exact and memory-safe but not yet fused. Packed segments and custom positions
also go to the reference. Pallas's Triton backend is deprecated since jax 0.11 (Mosaic GPU is
the path to full Hopper speed); this kernel is the portable baseline and the interpret-mode
test subject.

Shape letters: B batch, T tokens, N query heads, K KV heads, G = N / K, D head dim.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from elastic_jax.attention.common import (MODE_FULL, MODE_MIX, MODE_SPARSE,
                                          kernel_or_reference, modes_from_gate, pad_to,
                                          tile_ranges, with_reference_backward)

assert (MODE_SPARSE, MODE_FULL, MODE_MIX) == (0, 1, 2)  # the order of lax.switch below
from elastic_jax.attention.reference import Streaming

_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
_LOG2E = math.log2(math.e)


def _kernel(modes_ref, gate_ref, q_ref, k_ref, v_ref, o_ref, *, scale, block_q, block_k,
            seq_len, num_kv_heads, groups, streaming: Streaming):
  qi, b, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  slot = b * num_kv_heads + n // groups
  mode = modes_ref[slot]
  r = gate_ref[slot]
  q = q_ref[...]
  d = q.shape[-1]
  q_start = qi * block_q
  q_idx = q_start + jnp.arange(block_q)
  q_blk = q_idx // streaming.block
  qk_scale = scale * _LOG2E

  def scores(j):
    k = k_ref[pl.ds(j * block_k, block_k), :]
    s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * qk_scale
    k_idx = j * block_k + jnp.arange(block_k)
    causal = (k_idx[None, :] <= q_idx[:, None]) & (k_idx[None, :] < seq_len)
    k_blk = k_idx // streaming.block
    window = (k_blk[None, :] < streaming.sink_blocks) | (
        q_blk[:, None] - k_blk[None, :] < streaming.local_blocks)
    return s, causal, causal & window

  def update(carry, s, ok, v):
    acc, m, l = carry
    if ok is not None:
      s = jnp.where(ok, s, _MASK_VALUE)
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.exp2(s - m_new[:, None])
    if ok is not None:
      p = jnp.where(ok, p, 0.0)
    corr = jnp.exp2(m - m_new)
    pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    acc = acc * corr[:, None] + pv
    return acc, m_new, l * corr + p.sum(axis=-1)

  def init():
    return (jnp.zeros((block_q, d), jnp.float32),
            jnp.full((block_q,), _MASK_VALUE, jnp.float32), jnp.zeros((block_q,), jnp.float32))

  def finish(carry):
    acc, _, l = carry
    return acc / jnp.where(l == 0.0, 1.0, l)[:, None]

  sink_end, win_start, causal_end = tile_ranges(q_start, block_q, block_k, streaming)
  # Tiles wholly before the diagonal need no causal mask. When tiles align with SSA blocks,
  # every row of this query tile lies in one SSA block, so the visited sink and window tiles
  # need no window mask either: masks then apply on the diagonal tiles alone.
  n_past = q_start // block_k
  aligned = streaming.block % block_q == 0 and streaming.block % block_k == 0

  def visit(lo, hi, carry, sparse):
    def masked(j, c):
      s, causal, window = scores(j)
      return update(c, s, window if sparse else causal,
                    v_ref[pl.ds(j * block_k, block_k), :])

    def unmasked(j, c):
      k = k_ref[pl.ds(j * block_k, block_k), :]
      s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * qk_scale
      return update(c, s, None, v_ref[pl.ds(j * block_k, block_k), :])

    if sparse and not aligned:
      return lax.fori_loop(lo, hi, masked, carry)
    mid = jnp.clip(n_past, lo, hi)
    return lax.fori_loop(mid, hi, masked, lax.fori_loop(lo, mid, unmasked, carry))

  def run_full():
    return finish(visit(0, causal_end, init(), sparse=False))

  def run_sparse():
    # Sink tiles, then the window (from where the sink ends if the two meet).
    c = visit(0, sink_end, init(), sparse=True)
    return finish(visit(jnp.maximum(win_start, sink_end), causal_end, c, sparse=True))

  def run_mix():
    def body(j, c):
      full_c, sparse_c = c
      s, causal, window = scores(j)
      v = v_ref[pl.ds(j * block_k, block_k), :]
      return update(full_c, s, causal, v), update(sparse_c, s, window, v)
    full_c, sparse_c = lax.fori_loop(0, causal_end, body, (init(), init()))
    return r * finish(full_c) + (1.0 - r) * finish(sparse_c)

  out = lax.switch(mode, [run_sparse, run_full, run_mix])
  o_ref[...] = out.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("streaming", "block_q", "block_k", "num_warps",
                                             "num_stages", "interpret"))
def hybrid_forward(q, k, v, gate_bk, streaming: Streaming, *, block_q: int = 128,
                   block_k: int = 64, num_warps: int | None = None, num_stages: int = 3,
                   interpret: bool = False):
  """The kernel: q [B, T, N, D], k/v [B, T, K, D], gate [B, K] -> [B, T, N, D] (q's dtype).

  Default tiles 128 x 64 with 3 pipeline stages: the fastest of the variants timed by
  benchmarks/bench_hybrid.py on an H200 (D = 128, bf16); 128 x 128 exceeds shared memory.
  """
  b, t, n, d = q.shape
  kh = k.shape[2]
  groups = n // kh
  # Tiles shrink for short inputs but stay >= 16 rows (the smallest Triton matrix product).
  block_q = min(block_q, max(16, pl.next_power_of_2(t)))
  block_k = min(block_k, max(16, pl.next_power_of_2(t)))
  tp = t + (-t % math.lcm(block_q, block_k))
  dp = max(16, pl.next_power_of_2(d))
  q, k, v = (pad_to(pad_to(x, 1, tp), 3, dp) for x in (q, k, v))
  gate = gate_bk.astype(jnp.float32).reshape(-1)
  modes = modes_from_gate(gate)
  slots = pl.next_power_of_2(b * kh)
  gate, modes = pad_to(gate, 0, slots), pad_to(modes, 0, slots)
  kernel = functools.partial(
      _kernel, scale=d ** -0.5, block_q=block_q, block_k=block_k, seq_len=t,
      num_kv_heads=kh, groups=groups, streaming=streaming)
  from jax.experimental.pallas import triton as plgpu
  out = pl.pallas_call(
      kernel,
      grid=(tp // block_q, b, n),
      in_specs=[
          pl.BlockSpec((slots,), lambda i, j, h: (0,)),
          pl.BlockSpec((slots,), lambda i, j, h: (0,)),
          pl.BlockSpec((None, block_q, None, dp), lambda i, j, h: (j, i, h, 0)),
          pl.BlockSpec((None, tp, None, dp), lambda i, j, h: (j, 0, h // groups, 0)),
          pl.BlockSpec((None, tp, None, dp), lambda i, j, h: (j, 0, h // groups, 0)),
      ],
      out_specs=pl.BlockSpec((None, block_q, None, dp), lambda i, j, h: (j, i, h, 0)),
      out_shape=jax.ShapeDtypeStruct((b, tp, n, dp), q.dtype),
      compiler_params=plgpu.CompilerParams(
          num_warps=num_warps or (4 if dp <= 64 else 8), num_stages=num_stages),
      interpret=interpret,
      name="elastic_hybrid_forward",
  )(modes, gate, q, k, v)
  return out[:, :t, :, :d]


_hybrid = with_reference_backward(
    lambda q, k, v, g, streaming, interpret: hybrid_forward(q, k, v, g, streaming,
                                                           interpret=interpret))
hybrid_attention = functools.partial(kernel_or_reference, _hybrid)
