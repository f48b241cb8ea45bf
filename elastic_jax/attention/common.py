"""What the fused hybrid kernels share: run-time head modes, the tile schedule of a streaming
head, and the wrapper that gives a forward kernel the reference's signature and gradients."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from elastic_jax.attention.reference import Streaming, hybrid_attention as reference_hybrid

MODE_SPARSE, MODE_FULL, MODE_MIX = 0, 1, 2


def modes_from_gate(gate_bk: jax.Array) -> jax.Array:
  """Run-time mode per (batch, KV head): 0 sparse (r = 0), 1 full (r = 1), 2 mixed."""
  return jnp.where(gate_bk <= 0.0, MODE_SPARSE,
                   jnp.where(gate_bk >= 1.0, MODE_FULL, MODE_MIX)).astype(jnp.int32)


def tile_ranges(q_start, block_q: int, block_k: int, streaming: Streaming):
  """KV tile ranges a streaming query tile visits: [0, sink_end) then [win_start, causal_end).

  Integer arithmetic on Python ints or traced scalars alike. The two ranges may overlap or
  touch; a caller then starts the second at max(win_start, sink_end). A full head visits
  [0, causal_end).
  """
  blk = streaming.block
  causal_end = (q_start + block_q + block_k - 1) // block_k
  sink_end = (streaming.sink_blocks * blk + block_k - 1) // block_k
  first_block = q_start // blk
  win_start_tok = jnp.maximum(first_block - streaming.local_blocks + 1, 0) * blk
  return jnp.minimum(sink_end, causal_end), win_start_tok // block_k, causal_end


def pad_to(x: jax.Array, axis: int, multiple: int) -> jax.Array:
  """Zero-pads `axis` of `x` up to a multiple of `multiple`."""
  extra = -x.shape[axis] % multiple
  if not extra:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths)


def with_reference_backward(forward: Callable) -> Callable:
  """`forward(q, k, v, gate_bk, streaming, interpret)` as a differentiable function whose
  backward pass is the reference's VJP (exact and memory-safe, not fused)."""

  @functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
  def fn(q, k, v, gate_bk, streaming, interpret):
    return forward(q, k, v, gate_bk, streaming, interpret)

  def fwd(q, k, v, gate_bk, streaming, interpret):
    return fn(q, k, v, gate_bk, streaming, interpret), (q, k, v, gate_bk)

  def bwd(streaming, interpret, res, d_out):
    q, k, v, gate_bk = res
    b, t, kh = q.shape[0], q.shape[1], k.shape[2]
    _, vjp = jax.vjp(lambda q, k, v, g: reference_hybrid(
        q, k, v, jnp.broadcast_to(g[:, None, :], (b, t, kh)), streaming), q, k, v, gate_bk)
    return vjp(d_out)

  fn.defvjp(fwd, bwd)
  return fn


def kernel_or_reference(kernel: Callable, q_btnh, k_btkh, v_btkh, gate_btk,
                        streaming: Streaming, segment_ids_bt=None, positions_bt=None, *,
                        interpret: bool = False, **reference_kwargs):
  """`reference.hybrid_attention`'s signature, on `kernel` where it applies.

  The kernels take one gate per (batch, KV head) over unpacked rows; packed segments or
  custom positions go to the reference.
  """
  if gate_btk is None:
    gate_btk = jnp.zeros(k_btkh.shape[:3], jnp.float32)
  if segment_ids_bt is not None or positions_bt is not None:
    return reference_hybrid(q_btnh, k_btkh, v_btkh, gate_btk, streaming, segment_ids_bt,
                            positions_bt, **reference_kwargs)
  return kernel(q_btnh, k_btkh, v_btkh, gate_btk[:, 0, :], streaming, interpret)
