"""What the fused hybrid kernels share: run-time head modes, the tile schedules of a streaming
head (forward and transposed), the backward pass's row terms, and the wrapper that makes the
kernels one differentiable function with the reference's signature."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from elastic_jax.attention.reference import Streaming, hybrid_attention as reference_hybrid
from elastic_jax.attention.xattention import block_lists

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


def q_tile_range(kv_tile, block_q: int, block_k: int, num_q_tiles, streaming: Streaming):
  """Query tiles that visit KV tile `kv_tile`: (lo, hi_sparse).

  The transpose of `tile_ranges`, for the dK/dV pass. A full head's query tiles [lo,
  num_q_tiles) see the tile (causally); a streaming head's see it in [lo, hi_sparse): all of
  them when the tile holds sink keys, else those whose window still reaches it. Integer
  arithmetic on Python ints or traced scalars alike.
  """
  blk = streaming.block
  lo = kv_tile * block_k // block_q
  sink_end = (streaming.sink_blocks * blk + block_k - 1) // block_k
  # Query block qb reaches this tile iff qb <= last: the window's first block,
  # qb - local_blocks + 1, starts no later than the tile's last token.
  last = ((kv_tile + 1) * block_k + blk - 1) // blk + streaming.local_blocks - 2
  hi_window = ((last + 1) * blk + block_q - 1) // block_q
  hi = jnp.where(kv_tile < sink_end, num_q_tiles, jnp.minimum(hi_window, num_q_tiles))
  return lo, jnp.maximum(hi, lo)


def row_deltas(d_out, o_fa, o_sa, gate_bk):
  """Per-row terms of the backward pass and the gate's gradient.

  With O = r * O_FA + (1 - r) * O_SSA: D_FA = rowsum(dO * O_FA) and D_SSA = rowsum(dO * O_SSA),
  float32 [B, T, N]; dL/dr = sum over rows and the KV head's query heads of D_FA - D_SSA, [B, K].
  """
  b, t, n, _ = d_out.shape
  kh = gate_bk.shape[1]
  up = lambda x: x.astype(jnp.float32)
  d_fa = jnp.einsum("btnd,btnd->btn", up(d_out), up(o_fa))
  d_sa = jnp.einsum("btnd,btnd->btn", up(d_out), up(o_sa))
  d_gate = (d_fa - d_sa).reshape(b, t, kh, n // kh).sum(axis=(1, 3))
  return d_fa, d_sa, d_gate.astype(gate_bk.dtype)


def with_fused_backward(forward: Callable, forward_train: Callable,
                        backward: Callable) -> Callable:
  """A differentiable `fn(q, k, v, gate_bk, streaming, interpret)` made of kernels.

  `forward(q, k, v, gate_bk, streaming, interpret)` -> O serves undifferentiated calls (sparse
  heads skip their far tiles). Under differentiation `forward_train(...)` -> (O, residuals)
  computes O_FA and O_SSA of every head in one pass (the gate's gradient needs both), and
  `backward(streaming, interpret, residuals, dO)` -> (dq, dk, dv, d_gate).
  """

  @functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
  def fn(q, k, v, gate_bk, streaming, interpret):
    return forward(q, k, v, gate_bk, streaming, interpret)

  fn.defvjp(forward_train, backward)
  return fn


def xa_operands(xa_keep, num_blocks: int, slots: int):
  """The kept XAttention blocks [B, K, nb, nb] as the kernels read them: (index, count, keep)
  int32 [slots, nbp, nbp], [slots, nbp], [slots, nbp, nbp], flattened to (batch, KV head)
  slots (padded to `slots`) and to nbp = num_blocks blocks (>= nb; padding keeps nothing).
  index lists each query block's kept blocks first, ascending (`xattention.block_lists`)."""
  b, kh, nb, _ = xa_keep.shape
  extra = num_blocks - nb
  keep = jnp.pad(xa_keep, ((0, 0), (0, 0), (0, extra), (0, extra))).reshape(
      b * kh, 1, num_blocks, num_blocks)
  index, count = block_lists(keep)
  return tuple(pad_to(x[:, 0].astype(jnp.int32), 0, slots) for x in (index, count, keep))


def kernel_or_reference(kernel: Callable, q_btnh, k_btkh, v_btkh, gate_btk,
                        streaming: Streaming, segment_ids_bt=None, positions_bt=None, *,
                        interpret: bool = False, xa_kernel: Callable | None = None,
                        xa_kernel_applies: Callable[[int], bool] = lambda block: False,
                        **reference_kwargs):
  """`reference.hybrid_attention`'s signature, on `kernel` where it applies.

  The kernels take one gate per (batch, KV head) over unpacked rows; packed segments or custom
  positions go to the reference. The XAttention settings ("patterns" and "xa_keep" in the
  keyword arguments) run on `xa_kernel` where the backend has one and `xa_kernel_applies` to
  the block size, else on the reference.
  """
  if gate_btk is None:
    gate_btk = jnp.zeros(k_btkh.shape[:3], jnp.float32)
  patterns = reference_kwargs.get("patterns", "fa-ssa")
  xa_block = reference_kwargs.get("xa_block", 128)
  if (segment_ids_bt is not None or positions_bt is not None
      or (patterns != "fa-ssa" and (xa_kernel is None or not xa_kernel_applies(xa_block)))):
    return reference_hybrid(q_btnh, k_btkh, v_btkh, gate_btk, streaming, segment_ids_bt,
                            positions_bt, **reference_kwargs)
  if patterns != "fa-ssa":
    return xa_kernel(q_btnh, k_btkh, v_btkh, gate_btk[:, 0, :], reference_kwargs["xa_keep"],
                     streaming, patterns, xa_block, interpret)
  return kernel(q_btnh, k_btkh, v_btkh, gate_btk[:, 0, :], streaming, interpret)
