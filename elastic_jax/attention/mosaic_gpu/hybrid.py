"""The Mosaic GPU backend's entry points around its forward kernel (`forward.py`): inference
on hard gates (`hybrid_forward`, falling back to the Triton kernel at run time on fractional
gates), training (`forward_train` and the dQ / dK-dV kernels of `backward.py`, the Triton
kernels where those do not take the shapes), packed rows and the XAttention settings. The one
builder, `make_hybrid` (its `packed` and `xa` pick the kind of op), returns a `hybrid(q, k,
v, gate, ...)` with a fused backward; which kernels run where is described in `forward.py`'s
docstring.

Shape letters: B batch, T tokens, N query heads, K KV heads, G = N / K, H head dim.
"""

from __future__ import annotations

import functools
import math
import warnings

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from elastic_jax.attention.common import (MODE_FULL, MODE_SPARSE, kernel_or_reference,
                                          modes_from_gate, packed_plan, pad_packed, pad_to,
                                          row_deltas, segment_bounds, with_fused_backward,
                                          xa_operands)
from elastic_jax.attention.mosaic_gpu import backward as mosaic_gpu_backward
from elastic_jax.attention.mosaic_gpu.backward import XATerms
from elastic_jax.attention.mosaic_gpu.forward import (NO_WINDOW, PLAN_WIDTH, TRAINING, XAWalk,
                                                     applies, forward_call, packed_walk,
                                                     rows_per_program)
from elastic_jax.attention.mosaic_gpu.tiles import DEFAULT_TILES, Tiles, takes_backward_tiles
from elastic_jax.attention.pallas_gpu import hybrid as pallas_gpu
from elastic_jax.attention.reference import Streaming, split_patterns
from elastic_jax.attention.xattention import block_lists

try:  # the Mosaic GPU dialect ships with jaxlib; keep the package importable without it
  from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover
  plgpu = None


@functools.partial(jax.jit, static_argnames=("streaming", "tiles", "interpret"))
def hybrid_forward_hard(q, k, v, gate_bk, streaming: Streaming, *,
                        tiles: Tiles = DEFAULT_TILES, interpret: bool = False):
  """The kernel alone, for gates of 0 or 1 (a fractional gate counts as full): q [B, T, N, H],
  k/v [B, T, K, H], gate [B, K] -> [B, T, N, H]."""
  if not applies(q.shape, k.shape, q.dtype, streaming, tiles):
    raise ValueError(f"the Mosaic GPU kernel does not take q {q.shape} {q.dtype}, k {k.shape}, "
                     f"{streaming} with {tiles} (see mosaic_gpu.applies)")
  t = q.shape[1]
  q, k, v = (pad_to(x, 1, tiles.block_kv) for x in (q, k, v))
  modes = modes_from_gate(gate_bk.astype(jnp.float32)).reshape(-1)
  out = forward_call(q, k, v, modes, streaming=streaming, tiles=tiles, scale=q.shape[3] ** -0.5,
              interpret=interpret)
  return out[:, :t]


def hybrid_forward(q, k, v, gate_bk, streaming: Streaming, *,
                   tiles: Tiles = DEFAULT_TILES, interpret: bool = False):
  """Inference forward: this kernel where every gate is 0 or 1, the Triton kernel otherwise
  (decided at run time: one compilation serves both). Shapes as `hybrid_forward_hard`."""
  hard = hard_gates(gate_bk)
  return lax.cond(
      hard,
      lambda: hybrid_forward_hard(q, k, v, gate_bk, streaming, tiles=tiles,
                                  interpret=interpret),
      lambda: pallas_gpu.hybrid_forward(q, k, v, gate_bk, streaming, interpret=interpret))


def xa_applies(q_shape, k_shape, dtype, streaming: Streaming, xa_block: int,
               tiles: Tiles = DEFAULT_TILES) -> bool:
  """Whether this kernel takes XAttention heads of `xa_block`-token blocks for these shapes:
  `applies`, and blocks made of whole KV tiles and whole programs' rows."""
  return (applies(q_shape, k_shape, dtype, streaming, tiles)
          and _xa_tiles_fit(q_shape[2] // k_shape[2], xa_block, tiles))


def _xa_tiles_fit(groups: int, xa_block: int, tiles: Tiles) -> bool:
  return xa_block % tiles.block_kv == 0 and xa_block % rows_per_program(groups, tiles) == 0


def _checked_xa_call(name: str, q_shape, k_shape, keep_shape, patterns: str, xa_block: int,
                     takes: bool, refusal: str):
  """(the pattern pair, the XA blocks of T) of a call under the XAttention settings, after one
  clear error for each way it can be wrong: patterns without XA, shapes its kernels do not
  take (takes False; refusal: the sentence), kept blocks of the wrong shape."""
  pair = split_patterns(patterns)
  if "xa" not in pair:
    raise ValueError(f"{name} runs the XAttention settings, not '{patterns}'")
  if not takes:
    raise ValueError(refusal)
  b, t = q_shape[:2]
  nb = -(-t // xa_block)
  want = (b, k_shape[2], nb, nb)
  if tuple(keep_shape) != want:
    raise ValueError(f"xa_keep has shape {tuple(keep_shape)}; {want} expected for {t} tokens "
                     f"in blocks of {xa_block}")
  return pair, nb


def _checked_xa_forward(name: str, q, k, xa_keep, streaming: Streaming, patterns: str,
                        xa_block: int, tiles: Tiles):
  """`_checked_xa_call` for this file's XA forwards (the shapes: `xa_applies`)."""
  return _checked_xa_call(
      name, q.shape, k.shape, xa_keep.shape, patterns, xa_block,
      xa_applies(q.shape, k.shape, q.dtype, streaming, xa_block, tiles),
      f"the Mosaic GPU kernel does not take XAttention blocks of {xa_block} with q {q.shape} "
      f"{q.dtype}, k {k.shape}, {streaming}, {tiles} (see mosaic_gpu.xa_applies)")


@functools.partial(jax.jit, static_argnames=("streaming", "patterns", "xa_block", "tiles",
                                             "interpret"))
def xa_forward_hard(q, k, v, gate_bk, xa_keep, streaming: Streaming, *, patterns: str,
                    xa_block: int, tiles: Tiles = DEFAULT_TILES, interpret: bool = False):
  """The kernel alone under the XAttention settings ("fa-xa", "xa-ssa"), for gates of 0 or 1
  (a fractional gate takes the gate-1 pattern's walk; `make_hybrid(xa=True)` sends fractional
  gates to the Triton kernel): the heads of XA's mode walk their kept blocks (xa_keep [B, K, nb, nb]
  bool, blocks of xa_block tokens; the diagonal block is always attended, as XAttention's
  selection always keeps it, and blocks above it are ignored), the others their full or
  streaming walk. Shapes as `hybrid_forward_hard`."""
  (hi, lo), nb = _checked_xa_forward("xa_forward_hard", q, k, xa_keep, streaming, patterns,
                                     xa_block, tiles)
  b, t = q.shape[:2]
  kh = k.shape[2]
  q, k, v = (pad_to(x, 1, tiles.block_kv) for x in (q, k, v))
  # The kernels' shared lists (blocks above the diagonal dropped, the diagonal last); this
  # walk counts the blocks below the diagonal and walks the diagonal block apart.
  index, count, _ = xa_operands(xa_keep, nb, b * kh)
  xa = XAWalk(mode=MODE_SPARSE if lo == "xa" else MODE_FULL, block=xa_block, num_blocks=nb)
  modes = modes_from_gate(gate_bk.astype(jnp.float32)).reshape(-1)
  out = forward_call(q, k, v, modes, streaming=streaming, tiles=tiles, scale=q.shape[3] ** -0.5,
              interpret=interpret, xa=xa,
              xa_lists=(index.reshape(-1), (count - 1).reshape(-1)))
  return out[:, :t]


def _build_xa(tiles: Tiles, training: str):
  """`make_hybrid(xa=True)`: `pallas_gpu.make_hybrid(xa=True)` with this kernel as the
  undifferentiated forward where gates are 0 or 1 (decided at run time) and it `xa_applies`.
  training (`TRAINING`): the Mosaic kernels are `xa_forward_train` and `xa_backward`, where
  `xa_trains`; the Triton training kernels elsewhere."""
  triton_forward, triton_train, triton_backward = pallas_gpu.xa_parts()

  def forward(q, k, v, gate_bk, xa_keep, streaming, patterns, xa_block, interpret):
    triton = lambda: triton_forward(q, k, v, gate_bk, xa_keep, streaming, patterns, xa_block,
                                    interpret)
    if not xa_applies(q.shape, k.shape, q.dtype, streaming, xa_block, tiles):
      return triton()
    return lax.cond(
        hard_gates(gate_bk),
        lambda: xa_forward_hard(q, k, v, gate_bk, xa_keep, streaming, patterns=patterns,
                                xa_block=xa_block, tiles=tiles, interpret=interpret),
        triton)

  train, grads = _training(
      lambda q_shape, k_shape, dtype, streaming, patterns, xa_block, interpret: (
          _mosaic_training(training, interpret) and xa_trains(
              q_shape, k_shape, dtype, streaming, xa_block, tiles)),
      lambda q, k, v, gate_bk, xa_keep, streaming, patterns, xa_block, interpret: (
          xa_forward_train(q, k, v, gate_bk, xa_keep, streaming, patterns=patterns,
                           xa_block=xa_block, tiles=tiles, interpret=interpret)),
      lambda streaming, patterns, xa_block, interpret, res, d_out: (*xa_backward(
          res, d_out, streaming, patterns=patterns, xa_block=xa_block, tiles=tiles,
          interpret=interpret), None),
      triton_train, triton_backward, num_static=4)
  return with_fused_backward(forward, train, grads, num_arrays=5, num_static=4)


def hard_gates(gate) -> jax.Array:
  """Whether every gate is 0 or 1 (a traced bool): what this kernel's inference forward takes."""
  return jnp.all((gate <= 0.0) | (gate >= 1.0))


def _after(done, operands):
  """`operands`, made to wait for `done`: one kernel launch after the other. Pallas's GPU
  interpreter keeps global state and stalls when two kernels run at once (a GPU runs them in
  order anyway)."""
  return lax.optimization_barrier((done, operands))[1]


def _training_outputs(fa, sa, r, t: int, dtype):
  """The training forward's output and the gate's residuals from its two launches, each an
  (O rounded, remainder) pair of `forward_call(..., lse=True)`: (r O_FA + (1 - r) O_SSA, O_FA
  rounded, O_FA - O_SSA), the first and the last formed in float32 from the pairs' sums before
  their one rounding to `dtype`; the first T rows (r broadcasts against [B, T, N, H]). The
  difference carries the gate's gradient; rounding O_FA and O_SSA first would lose it where
  XA's kept blocks make the two nearly equal (`common.row_deltas`)."""
  o_fa, o_sa = ((hi[:, :t].astype(jnp.float32) + lo[:, :t].astype(jnp.float32))
                for hi, lo, _ in (fa, sa))
  return ((r * o_fa + (1.0 - r) * o_sa).astype(dtype), fa[0][:, :t],
          (o_fa - o_sa).astype(dtype))


def _row_terms(tp: int, lse_fa, lse_sa, d_fa, d_sa, *more):
  """The backward kernels' row terms [B, N, 4 (+ more), Tp] float32: the log-sum-exps [B, N,
  Tp], the row deltas [B, T, N] padded to Tp, then any further [B, N, Tp] terms."""
  rows = lambda x: pad_to(x, 1, tp).transpose(0, 2, 1)
  return jnp.stack([lse_fa, lse_sa, rows(d_fa), rows(d_sa), *more], axis=2)


def _check_training(training: str):
  if training not in TRAINING:
    raise ValueError(f"training kernels '{training}' are unknown ({', '.join(TRAINING)})")


def _mosaic_training(training: str, interpret: bool) -> bool:
  """Whether a builder's `training` choice asks for the Mosaic GPU training kernels: "mosaic"
  always, "auto" when running natively (in interpret mode "auto" takes the Triton kernels:
  the Mosaic ones are checked there by their own tests, with training="mosaic")."""
  return training == "mosaic" or (training == "auto" and not interpret)


@takes_backward_tiles(positional=True)
def trains(q_shape, k_shape, dtype, streaming: Streaming, tiles: Tiles = DEFAULT_TILES) -> bool:
  """Whether the Mosaic GPU training kernels take a call of these shapes: the forward's layout
  (`applies`) and the backward's (`mosaic_gpu_backward.applies`)."""
  groups = q_shape[2] // k_shape[2]
  return (applies(q_shape, k_shape, dtype, streaming, tiles)
          and mosaic_gpu_backward.applies(groups, streaming, tiles, q_shape[3]))


@takes_backward_tiles()
def forward_train(q, k, v, gate_bk, streaming: Streaming, *, tiles: Tiles = DEFAULT_TILES,
                  interpret: bool = False):
  """The training forward on this kernel: O = r O_FA + (1 - r) O_SSA for any gates, and the
  residuals of `backward`. O_FA and O_SSA of every head (the gate's gradient needs both) are
  two launches with every head full, then every head streaming; the second visits only the
  sink and window tiles, so the pair costs one full pass and a small one, as the one-walk
  Triton training forward does. Shapes as `hybrid_forward_hard`. The residuals' padding
  depends on the backward kernels' tiles too (`_training_length`): pass `backward` the same
  tiles."""
  return _forward_train(q, k, v, gate_bk, streaming, tiles, interpret)


def _training_length(t: int, groups: int, tiles: Tiles, xa_block: int = 1):
  """T padded to whole programs of the forward and of both backward kernels (and to whole XA
  blocks: the dK/dV kernel walks a listed query block's every tile)."""
  tp = mosaic_gpu_backward.padded_length(t, groups, tiles)
  return tp + -tp % math.lcm(rows_per_program(groups, tiles), tiles.block_kv, xa_block)


def _forward_train(q, k, v, gate_bk, streaming, tiles, interpret, xa=None):
  """`forward_train`; under the XAttention settings xa = (`XATerms`, `common.xa_operands`'s
  lists; its blocks span the padded length), and a launch whose pattern is "xa" walks every
  head's kept blocks."""
  b, t, n, d = q.shape
  kh = k.shape[2]
  tp = (xa[0].num_blocks * xa[0].block if xa
        else _training_length(t, n // kh, tiles))
  qp, kp, vp = (pad_to(x, 1, tp) for x in (q, k, v))

  def run(term, mode, q, k, v):
    walk = lists = None
    if xa is not None and xa[0].pair[term] == "xa":
      index, count, _ = xa[1]
      walk = XAWalk(mode=mode, block=xa[0].block, num_blocks=xa[0].num_blocks)
      lists = (index.reshape(-1), (count - 1).reshape(-1))
    return forward_call(q, k, v, jnp.full((b * kh,), mode, jnp.int32), streaming=streaming,
                 tiles=tiles, scale=d ** -0.5, interpret=interpret, xa=walk, xa_lists=lists,
                 lse=True)

  fa = run(0, MODE_FULL, qp, kp, vp)
  sa = run(1, MODE_SPARSE, *_after(fa[0], (qp, kp, vp)))
  r = jnp.repeat(gate_bk.astype(jnp.float32), n // kh, axis=1)[:, None, :, None]
  o, o_fa, o_gap = _training_outputs(fa, sa, r, t, q.dtype)
  return o, (qp, kp, vp, gate_bk, o_fa, o_gap, fa[2], sa[2])


@takes_backward_tiles()
def backward(residuals, d_out, streaming: Streaming, *, tiles: Tiles = DEFAULT_TILES,
             interpret: bool = False):
  """(dq, dk, dv, d_gate) from `forward_train`'s residuals: the Mosaic GPU dQ and dK/dV
  kernels (`mosaic_gpu_backward`); the gate's gradient is rowsum(dO * (O_FA - O_SSA)) summed
  per (batch, KV head) (`common.row_deltas`)."""
  return _backward(residuals, d_out, streaming, tiles, interpret)


def _backward(residuals, d_out, streaming, tiles, interpret, dq_xa=None, dkv_xa=None):
  """`backward`; under the XAttention settings dq_xa and dkv_xa are the kernels' `xa`."""
  qp, kp, vp, gate_bk, o_fa, o_gap, lse_fa, lse_sa = residuals
  t, tp = d_out.shape[1], qp.shape[1]
  d_fa, d_sa, d_gate = row_deltas(d_out, o_fa, o_gap, gate_bk)
  terms = _row_terms(tp, lse_fa, lse_sa, d_fa, d_sa)
  do = pad_to(d_out.astype(qp.dtype), 1, tp)
  gate = gate_bk.astype(jnp.float32).reshape(-1)
  kw = dict(streaming=streaming, tiles=tiles, interpret=interpret)
  operands = (qp, kp, vp, do, terms, modes_from_gate(gate), gate)
  dq = mosaic_gpu_backward.dq_call(*operands, xa=dq_xa, **kw)
  dk, dv = mosaic_gpu_backward.dkv_call(*_after(dq, operands), xa=dkv_xa, **kw)
  return dq[:, :t], dk[:, :t], dv[:, :t], d_gate


@takes_backward_tiles(positional=True)
def xa_trains(q_shape, k_shape, dtype, streaming: Streaming, xa_block: int,
              tiles: Tiles = DEFAULT_TILES) -> bool:
  """Whether the Mosaic GPU training kernels take the XAttention settings with blocks of
  `xa_block` tokens: `trains` and `_xa_blocks_fit`."""
  return (trains(q_shape, k_shape, dtype, streaming, tiles)
          and _xa_blocks_fit(q_shape, k_shape, xa_block, tiles))


def _xa_blocks_fit(q_shape, k_shape, xa_block: int, tiles: Tiles) -> bool:
  """XAttention blocks made of whole KV tiles and whole programs of the forward
  (`_xa_tiles_fit`) and of both backward kernels."""
  groups = q_shape[2] // k_shape[2]
  return (_xa_tiles_fit(groups, xa_block, tiles)
          and all(xa_block % x == 0
                  for x in mosaic_gpu_backward.program_sizes(groups, tiles)))


@takes_backward_tiles()
def xa_forward_train(q, k, v, gate_bk, xa_keep, streaming: Streaming, *, patterns: str,
                     xa_block: int, tiles: Tiles = DEFAULT_TILES, interpret: bool = False):
  """`forward_train` under the XAttention settings ("fa-xa", "xa-ssa"; kept blocks xa_keep
  [B, K, nb, nb] as `xa_forward_hard`): the launch of XA's term walks every head's kept
  blocks. Residuals: `forward_train`'s and the kept-block lists (`common.xa_operands`)."""
  pair, _ = _checked_xa_call(
      "xa_forward_train", q.shape, k.shape, xa_keep.shape, patterns, xa_block,
      xa_trains(q.shape, k.shape, q.dtype, streaming, xa_block, tiles),
      f"the Mosaic GPU training kernels do not take XAttention blocks of {xa_block} with q "
      f"{q.shape} {q.dtype}, k {k.shape}, {streaming} (see mosaic_gpu.xa_trains)")
  b, t, n, _ = q.shape
  kh = k.shape[2]
  num_blocks = _training_length(t, n // kh, tiles, xa_block) // xa_block
  lists = xa_operands(xa_keep, num_blocks, b * kh)
  out, res = _forward_train(q, k, v, gate_bk, streaming, tiles, interpret,
                            xa=(XATerms(pair, xa_block, num_blocks), lists))
  return out, (*res, *lists)


@takes_backward_tiles()
def xa_backward(residuals, d_out, streaming: Streaming, *, patterns: str, xa_block: int,
                tiles: Tiles = DEFAULT_TILES, interpret: bool = False):
  """(dq, dk, dv, d_gate) from `xa_forward_train`'s residuals: `backward` with the XA term
  walking the kept blocks (the dQ kernel a query block's row of the lists, the dK/dV kernel
  a key block's column, `mosaic_gpu_backward.xa_column_lists`)."""
  *residuals, index, count, keep = residuals
  terms = XATerms(split_patterns(patterns), xa_block, keep.shape[-1])
  columns = mosaic_gpu_backward.xa_column_lists(keep)
  return _backward(residuals, d_out, streaming, tiles, interpret,
                   dq_xa=(terms, (index, count, keep)), dkv_xa=(terms, (*columns, keep)))


def _build_plain(tiles: Tiles, training: str):
  """`make_hybrid()`: `pallas_gpu.make_hybrid` with this kernel as the undifferentiated
  forward where it `applies`. training (`TRAINING`): the Mosaic kernels are `forward_train`
  and `backward`, where `trains`; the Triton training kernels elsewhere."""
  triton_forward, triton_train, triton_backward = pallas_gpu.hybrid_parts()

  def forward(q, k, v, gate_bk, streaming, interpret):
    if applies(q.shape, k.shape, q.dtype, streaming, tiles):
      return hybrid_forward(q, k, v, gate_bk, streaming, tiles=tiles, interpret=interpret)
    return triton_forward(q, k, v, gate_bk, streaming, interpret)

  train, grads = _training(
      lambda q_shape, k_shape, dtype, streaming, interpret: _mosaic_training(
          training, interpret) and trains(q_shape, k_shape, dtype, streaming, tiles),
      lambda q, k, v, gate_bk, streaming, interpret: forward_train(
          q, k, v, gate_bk, streaming, tiles=tiles, interpret=interpret),
      lambda streaming, interpret, res, d_out: backward(
          res, d_out, streaming, tiles=tiles, interpret=interpret),
      triton_train, triton_backward)
  return with_fused_backward(forward, train, grads)


# ----------------------------------------------------------------------------------------------
# Packed rows: segment ids and positions at run time
#
# The walk comes from `common.packed_plan` over program tiles (tiles of earlier segments are
# skipped), and a masked tile checks each row's key range with three per-row bounds instead
# of segment ids and positions: key j is visible to row i iff start_i <= j <= i and
# (j < sink_end_i or j >= window_i). That holds whenever positions run 0, 1, ... (or any
# offset, +1 per token) within each segment; other positions and fractional gates run the
# Triton kernel (decided at run time).


def _row_bounds(seg, pos, gate_btk, streaming: Streaming, xa_gate: float | None = None):
  """[B, K, 3, T] int32: per row and KV head, the segment's start, the end of its sink and
  the start of the window of a streaming row (the segment's start for a full one). With
  xa_gate (packed rows under the XAttention settings, `XAWalk.mixed`), rows of that gate are
  XA rows: no sink (it ends at their start) and a window that starts past every row
  (`NO_WINDOW`, which marks them: a real window never starts past its row); the kernel shows
  them their segment's keys in kept blocks."""
  start, _ = segment_bounds(seg)
  t = seg.shape[1]
  origin = jnp.arange(t, dtype=jnp.int32)[None] - pos          # where position 0 would lie
  blk = streaming.block
  sink_end = origin + streaming.sink_blocks * blk
  window = origin + jnp.maximum(pos // blk - streaming.local_blocks + 1, 0) * blk
  full = (gate_btk >= 1.0).transpose(0, 2, 1)                     # [B, K, T]
  per_row = lambda x: jnp.broadcast_to(x[:, None], full.shape)
  fields = [per_row(start), per_row(sink_end), jnp.where(full, start[:, None], window[:, None])]
  if xa_gate is not None:
    xa = full == (xa_gate >= 1.0)
    fields[1:] = jnp.where(xa, start[:, None], fields[1]), jnp.where(xa, NO_WINDOW, fields[2])
  return jnp.stack(fields, axis=2).astype(jnp.int32)


def positions_count_up(seg, pos):
  """Whether positions count up by one from a non-negative start within each segment (a
  traced bool): then a row's visible keys are an index range (`_row_bounds`)."""
  start, _ = segment_bounds(seg)
  offset = pos - jnp.arange(seg.shape[1], dtype=jnp.int32)[None]
  return jnp.all(offset == jnp.take_along_axis(offset, start, axis=1)) & jnp.all(pos >= 0)


def packed_rows_apply(seg, pos, gate_btk):
  """Whether this kernel computes packed rows exactly (a traced bool): every gate 0 or 1, and
  positions that count up by one from a non-negative start within each segment."""
  return positions_count_up(seg, pos) & hard_gates(gate_btk)


@functools.partial(jax.jit, static_argnames=("streaming", "rows", "block_kv", "xa_block",
                                             "xa_gate"))
def _packed_operands(q, k, v, gate_btk, segment_ids, positions, streaming: Streaming, rows: int,
                     block_kv: int, xa_lists=None, xa_block: int = 0, xa_gate=None):
  """Padded q, k, v, the programs' walks (`packed_walk`'s fields, flat) and `_row_bounds`.
  With xa_lists (`common.xa_operands`'s, blocks of xa_block tokens) every row is an XA row:
  the walks are `packed_xa_walk`'s. With xa_gate too (0 or 1, `XAWalk.mixed`), the rows of
  that gate are: programs whose rows all are walk `packed_xa_walk`'s tiles, the others their
  own (a program of both kinds the full range, masked), and a seventh field flags the
  former."""
  t = q.shape[1]
  tp = t + (-t % math.lcm(rows, block_kv))
  q, k, v = (pad_to(x, 1, tp) for x in (q, k, v))
  seg, pos = pad_packed(segment_ids, positions, tp)
  gate = pad_to(gate_btk.astype(jnp.float32), 1, tp)
  plan = packed_plan(seg, pos, gate, streaming, rows, block_kv)
  q_plan = jnp.broadcast_to(plan["q_plan"][:, None], plan["q_modes"].shape + (PLAN_WIDTH,))
  own = lambda: packed_walk([q_plan[..., x] for x in range(7)], plan["q_modes"])
  if xa_lists is None:
    walks = own()
  elif xa_gate is None:
    walks = packed_xa_walk(q_plan, xa_lists, rows, block_kv, xa_block)
  else:
    walks = own()
    listed = plan["q_modes"] == (MODE_FULL if xa_gate >= 1.0 else MODE_SPARSE)
    walks = [jnp.where(listed, x, y) for x, y in zip(
        packed_xa_walk(q_plan, xa_lists, rows, block_kv, xa_block), walks)] + [listed]
  return (q, k, v), [x.reshape(-1).astype(jnp.int32) for x in walks], _row_bounds(
      seg, pos, gate, streaming, xa_gate)


def _first_listed(keep, q_blocks, kv_lo, block_kv: int, xa_block: int):
  """Per packed program: its list row's first entry not before the block holding kv_lo (its
  first row's segment start, in tiles of block_kv): the kept blocks of earlier segments are
  skipped. keep [B, K, nb, nb], q_blocks [n] each program's query block, kv_lo [B, K, n]."""
  return _listed_before(keep, q_blocks, kv_lo * block_kv // xa_block)


def _listed_before(keep, rows, ends):
  """Per program: how many of its list row's kept entries lie before `ends`. keep [B, K, nb,
  nb] int32 (`common.xa_operands`'s, reshaped), rows [n] the program's list row, ends [B, K,
  n] a block index (entries j < ends counted)."""
  prefix = jnp.concatenate([jnp.zeros(keep.shape[:3] + (1,), jnp.int32),
                            jnp.cumsum(keep, axis=-1)], axis=-1)       # [B, K, nb, nb + 1]
  return jnp.take_along_axis(prefix[:, :, rows], ends[..., None], axis=-1)[..., 0]


def packed_xa_walk(q_plan, xa_lists, rows: int, block_kv: int, xa_block: int):
  """`packed_walk` with every row an XA row: per program (q_plan [B, K, nq, 8] of
  `common.packed_plan`), its query block's kept blocks below the diagonal from the block
  holding kv_lo on (list positions [first, count - 1), read as tiles through the list), then
  the diagonal block's tiles from kv_lo to the causal end. Fields as `packed_walk`'s, but lo
  is the first list position in tiles, and the unmasked range [in_lo, in_hi) holds for the
  listed piece alone: the kernel turns it into steps (`step_ranges`' `listed`,
  `mosaic_gpu_backward.listed_unmasked_steps`) and masks the diagonal block's."""
  index, count, keep = xa_lists
  b, kh, nq = q_plan.shape[:3]
  nb = keep.shape[-1]
  per_block = xa_block // block_kv
  q_block = jnp.arange(nq, dtype=jnp.int32) * rows // xa_block                 # [nq]
  kv_lo, causal_hi, in_lo, in_hi = (q_plan[..., x] for x in (0, 3, 4, 5))
  first = _first_listed(keep.reshape(b, kh, nb, nb), q_block, kv_lo, block_kv, xa_block)
  below = count.reshape(b, kh, nb)[:, :, q_block] - 1
  n1 = (below - first) * per_block
  second = jnp.maximum(q_block[None, None] * per_block, kv_lo)
  return n1 + causal_hi - second, first * per_block, n1, second, in_lo, in_hi


def packed_forward_hard(q, k, v, gate_btk, segment_ids, positions, streaming: Streaming, *,
                        tiles: Tiles = DEFAULT_TILES, interpret: bool = False):
  """The kernel alone on packed rows (`packed_rows_apply` must hold): q [B, T, N, H], k/v
  [B, T, K, H], gate [B, T, K] of 0 or 1, segment ids and positions [B, T] int.

  The operands are prepared in one jitted function and the kernel launched apart: Pallas's
  GPU interpreter can stall when the kernel shares one CPU computation with other work, so
  interpret-mode callers (tests) call this outside `jax.jit`."""
  if not applies(q.shape, k.shape, q.dtype, streaming, tiles):
    raise ValueError(f"the Mosaic GPU kernel does not take q {q.shape} {q.dtype}, k {k.shape}, "
                     f"{streaming} with {tiles} (see mosaic_gpu.applies)")
  rows = rows_per_program(q.shape[2] // k.shape[2], tiles)
  (qp, kp, vp), walks, bounds = _packed_operands(q, k, v, gate_btk, segment_ids, positions,
                                                 streaming, rows, tiles.block_kv)
  out = forward_call(qp, kp, vp, None, streaming=streaming, tiles=tiles, scale=q.shape[3] ** -0.5,
              interpret=interpret, walks=walks, row_bounds=bounds)
  return out[:, :q.shape[1]]


def packed_xa_forward_hard(q, k, v, gate_btk, segment_ids, positions, xa_keep,
                           streaming: Streaming, *, patterns: str, xa_block: int,
                           tiles: Tiles = DEFAULT_TILES, interpret: bool = False):
  """The kernel alone on packed rows under the XAttention settings ("fa-xa", "xa-ssa";
  `packed_rows_apply` must hold; xa_keep [B, K, nb, nb] as `xa_forward_hard`'s, e.g.
  `xattention.select` with the segment ids): each row takes its gate's pattern in one launch.
  Programs whose rows are all XA rows walk their kept blocks from their segment's on
  (`packed_xa_walk`), the others their full or streaming tiles; a program with rows of both
  patterns walks its full range, its XA rows masked to kept blocks (`XAWalk.mixed`). Called
  outside `jax.jit` in interpret mode, as `packed_forward_hard`."""
  (hi, _), _ = _checked_xa_forward("packed_xa_forward_hard", q, k, xa_keep, streaming,
                                   patterns, xa_block, tiles)
  b, t = q.shape[:2]
  kh = k.shape[2]
  rows = rows_per_program(q.shape[2] // kh, tiles)
  tp = t + (-t % math.lcm(rows, tiles.block_kv))
  lists = xa_operands(xa_keep, -(-tp // xa_block), b * kh)
  xa_gate = 1.0 if hi == "xa" else 0.0
  (qp, kp, vp), walks, bounds = _packed_operands(q, k, v, gate_btk, segment_ids, positions,
                                                 streaming, rows, tiles.block_kv, lists,
                                                 xa_block, xa_gate)
  xa = XAWalk(MODE_FULL if hi == "xa" else MODE_SPARSE, xa_block, lists[0].shape[-1],
              mixed=True)
  out = forward_call(qp, kp, vp, None, streaming=streaming, tiles=tiles, scale=q.shape[3] ** -0.5,
              interpret=interpret, walks=walks, row_bounds=bounds, xa=xa,
              xa_lists=(lists[0].reshape(-1), lists[2].reshape(-1)))
  return out[:, :t]


def _packed_trains(q_shape, k_shape, dtype, streaming, tiles) -> bool:
  """Whether the Mosaic GPU training kernels take packed rows of these shapes: `trains`, and
  rows long enough that both training paths pad them alike (the residuals of either path then
  have one layout, so the choice can be made at run time)."""
  t, groups = q_shape[1], q_shape[2] // k_shape[2]
  triton_tp = -(-t // 128) * 128          # the Triton training kernels' padding, for t > 64
  forward_tp = t + (-t % math.lcm(rows_per_program(groups, tiles), tiles.block_kv))
  return (trains(q_shape, k_shape, dtype, streaming, tiles) and t > 64
          and forward_tp == triton_tp
          and mosaic_gpu_backward.padded_length(t, groups, tiles) == triton_tp)


def packed_forward_train(q, k, v, gate_btk, segment_ids, positions, streaming: Streaming, *,
                         tiles: Tiles = DEFAULT_TILES, interpret: bool = False):
  """The training forward over packed rows (positions must count up within each segment,
  `positions_count_up`): O = r O_FA + (1 - r) O_SSA per row, and the residuals in the layout
  of the Triton packed kernels' (`pallas_gpu.packed_parts`), so that either backward takes
  them. Two launches of the packed forward kernel with every row full, then streaming."""
  return _packed_forward_train(q, k, v, gate_btk, segment_ids, positions, streaming, tiles,
                               interpret)


def _packed_xa_lists(xa_keep, tp: int, xa_block: int):
  """The kept-block lists of packed rows, with as many blocks as the Triton packed kernels'
  (a power of two), so that both paths leave residuals of one layout."""
  nbp = pl.next_power_of_2(max(xa_keep.shape[-1], -(-tp // xa_block)))
  return xa_operands(xa_keep, nbp, xa_keep.shape[0] * xa_keep.shape[1])


def _packed_forward_train(q, k, v, gate_btk, segment_ids, positions, streaming, tiles,
                          interpret, xa_keep=None, pair=("full", "stream"), xa_block=0):
  """`packed_forward_train`; under the XAttention settings (xa_keep, the pattern pair, the XA
  block) the launch of XA's term walks every row's kept blocks (`packed_xa_walk`)."""
  b, t, n, d = q.shape
  kh = k.shape[2]
  rows = rows_per_program(n // kh, tiles)
  tp = t + (-t % math.lcm(rows, tiles.block_kv))
  lists = None if xa_keep is None else _packed_xa_lists(xa_keep, tp, xa_block)
  outs = []
  for pattern, forced in zip(pair, (1.0, 0.0)):
    xa = pattern == "xa"       # XA rows: every key of the segment's kept blocks (full bounds)
    (qp, kp, vp), walks, bounds = _packed_operands(
        q, k, v, jnp.full(gate_btk.shape, 1.0 if xa else forced, jnp.float32), segment_ids,
        positions, streaming, rows, tiles.block_kv, lists if xa else None, xa_block)
    if outs:
      qp, kp, vp = _after(outs[-1][0], (qp, kp, vp))
    walk = XAWalk(MODE_FULL, xa_block, lists[0].shape[-1]) if xa else None
    outs.append(forward_call(qp, kp, vp, None, streaming=streaming, tiles=tiles, scale=d ** -0.5,
                      interpret=interpret, walks=walks, row_bounds=bounds, lse=True, xa=walk,
                      xa_lists=(lists[0].reshape(-1),) if xa else None))
  r = jnp.repeat(gate_btk.astype(jnp.float32), n // kh, axis=2)[..., None]      # [B, T, N, 1]
  o, o_fa, o_gap = _training_outputs(*outs, r, t, q.dtype)
  seg, pos = pad_packed(segment_ids, positions, tp)
  gate = pad_to(gate_btk.astype(jnp.float32), 1, tp).transpose(0, 2, 1)        # [B, K, Tp]
  return o, (qp, kp, vp, seg, pos, gate, None if lists is None else lists[2], gate_btk, o_fa,
             o_gap, outs[0][2], outs[1][2], segment_ids, positions, xa_keep)


@takes_backward_tiles()
def packed_xa_list_spans(keep, q_plan, k_plan, xa_block: int, tiles: Tiles, groups: int):
  """The parts of the kept-block lists the packed backward kernels walk (keep [B * K, nb, nb]
  int32 of `common.xa_operands`; `common.packed_plan`'s q_plan broadcast to [B, K, nq, 8]
  over dQ programs, k_plan [B, nk, 4] over dK/dV programs):
    first [B, K, nq]: per dQ program, its row's first entry not before the block holding
      kv_lo (blocks of earlier segments are skipped; entries from there to count - 1 are
      walked);
    later [B, K, nk]: per dK/dV program, how many entries of its column (the later query
      blocks that kept its key block) lie before its segment's end."""
  b, kh, nq = q_plan.shape[:3]
  nb = keep.shape[-1]
  dq_rows, dq_block_kv, keys, block_q = mosaic_gpu_backward.program_sizes(groups, tiles)
  keep = keep.reshape(b, kh, nb, nb)
  q_blocks = jnp.arange(nq, dtype=jnp.int32) * dq_rows // xa_block
  first = _first_listed(keep, q_blocks, q_plan[..., 0], dq_block_kv, xa_block)
  nk = k_plan.shape[1]
  k_blocks = jnp.arange(nk, dtype=jnp.int32) * keys // xa_block
  ends = -(-k_plan[..., 1] * block_q // xa_block)                          # [B, nk]
  ends = jnp.broadcast_to(jnp.maximum(ends, k_blocks[None] + 1)[:, None], (b, kh, nk))
  columns = jnp.swapaxes(keep, 2, 3)
  later = _listed_before(columns, k_blocks, ends) - _listed_before(
      columns, k_blocks, jnp.broadcast_to(k_blocks[None, None] + 1, ends.shape))
  return first, later


@takes_backward_tiles()
def packed_backward(residuals, d_out, streaming: Streaming, *, tiles: Tiles = DEFAULT_TILES,
                    interpret: bool = False):
  """(dq, dk, dv, d_gate, 0, 0) of packed rows from `packed_forward_train`'s residuals (the
  gate's gradient per row; float0 zeros for the segment ids and positions): the Mosaic GPU
  dQ and dK/dV kernels walking `common.packed_plan`'s schedules, masks from per-row bounds."""
  return _packed_backward(residuals, d_out, streaming, tiles, interpret)


def _packed_backward(residuals, d_out, streaming, tiles, interpret, pair=None,
                     xa_block: int = 0):
  """`packed_backward`; under the XAttention settings (the pattern pair and the XA block) the
  kernels also walk the kept-block lists built from the residuals' kept blocks
  (`packed_xa_dq_walk`, `packed_xa_dkv_walk`)."""
  (qp, kp, vp, seg, pos, gate, keep, gate_btk, o_fa, o_gap, lse_fa, lse_sa, segment_ids,
   positions, _) = residuals
  b, t, n = d_out.shape[:3]
  tp, kh = qp.shape[1], kp.shape[2]
  groups = n // kh
  d_fa, d_sa, d_gate = row_deltas(d_out, o_fa, o_gap, gate_btk)
  terms = _row_terms(tp, lse_fa, lse_sa, d_fa, d_sa,
                     jnp.repeat(gate, groups, axis=1))          # each row's gate, [B, N, Tp]
  gate_rows = gate.transpose(0, 2, 1)                                     # [B, Tp, K]
  bounds = _row_bounds(seg, pos, jnp.zeros_like(gate_rows), streaming)[:, 0]   # [B, 3, Tp]
  do = pad_to(d_out.astype(qp.dtype), 1, tp)
  flat = lambda x: x.reshape(-1).astype(jnp.int32)
  dq_rows, dq_block_kv, keys, block_q = mosaic_gpu_backward.program_sizes(groups, tiles)
  q_sched = packed_plan(seg, pos, gate_rows, streaming, dq_rows, dq_block_kv)
  q_plan = jnp.broadcast_to(q_sched["q_plan"][:, None], q_sched["q_modes"].shape + (8,))
  k_sched = packed_plan(seg, pos, gate_rows, streaming, block_q, keys)
  dq_xa = dkv_xa = None
  if pair is not None:
    terms_xa = XATerms(pair, xa_block, keep.shape[-1])
    index, count = block_lists(keep != 0)
    first, later = packed_xa_list_spans(keep, q_plan, k_sched["k_plan"], xa_block, tiles,
                                        groups)
    dq_xa = (terms_xa, (index, count, keep, first))
    dkv_xa = (terms_xa, (mosaic_gpu_backward.xa_column_lists(keep)[0], later, keep))
  kw = dict(streaming=streaming, tiles=tiles, interpret=interpret, bounds=bounds)
  dq = mosaic_gpu_backward.dq_call(qp, kp, vp, do, terms, flat(q_sched["q_modes"]), None,
                                   plan=[flat(q_plan[..., x]) for x in range(7)], xa=dq_xa,
                                   **kw)
  qp, kp, vp, do, terms = _after(dq, (qp, kp, vp, do, terms))
  dk, dv = mosaic_gpu_backward.dkv_call(
      qp, kp, vp, do, terms, flat(k_sched["k_modes"]), None,
      plan=[flat(k_sched["k_plan"][..., x]) for x in range(3)], xa=dkv_xa, **kw)
  zero_int = lambda x: np.zeros(x.shape, jax.dtypes.float0)
  return (dq[:, :t], dk[:, :t], dv[:, :t], d_gate, zero_int(segment_ids), zero_int(positions))


def _build_packed(tiles: Tiles, training: str):
  """`make_hybrid(packed=True)`: `pallas_gpu.make_hybrid(packed=True)` with this kernel as the
  undifferentiated forward where it `applies` and, at run time, `packed_rows_apply`.
  training (`TRAINING`): the Mosaic kernels are `packed_forward_train` and `packed_backward`,
  where `_packed_trains` and, at run time, `positions_count_up` (the Triton kernels
  otherwise; both leave residuals of one layout)."""
  triton_forward, triton_train, triton_backward = pallas_gpu.packed_parts()

  def forward(q, k, v, gate_btk, seg, pos, streaming, interpret):
    if not applies(q.shape, k.shape, q.dtype, streaming, tiles):
      return triton_forward(q, k, v, gate_btk, seg, pos, streaming, interpret)
    return lax.cond(
        packed_rows_apply(seg, pos, gate_btk),
        lambda: packed_forward_hard(q, k, v, gate_btk, seg, pos, streaming, tiles=tiles,
                                    interpret=interpret),
        lambda: triton_forward(q, k, v, gate_btk, seg, pos, streaming, interpret))

  train, grads = _training(
      lambda q_shape, k_shape, dtype, streaming, interpret: _mosaic_training(
          training, interpret) and (
          _packed_trains(q_shape, k_shape, dtype, streaming, tiles)),
      lambda q, k, v, gate_btk, seg, pos, streaming, interpret: packed_forward_train(
          q, k, v, gate_btk, seg, pos, streaming, tiles=tiles, interpret=interpret),
      lambda streaming, interpret, res, d_out: packed_backward(
          res, d_out, streaming, tiles=tiles, interpret=interpret),
      triton_train, triton_backward, packed=True)
  return with_fused_backward(forward, train, grads, num_arrays=6)


def _training(mosaic_trains, mosaic_train, mosaic_backward, triton_train, triton_backward,
              num_static: int = 2, packed: bool = False):
  """(forward_train, backward) of an op for `common.with_fused_backward`: the Mosaic GPU
  training kernels where mosaic_trains(q_shape, k_shape, dtype, *static) holds (trace time;
  static: the op's last `num_static` arguments) and, for packed rows, positions count up
  within each segment (run time, `lax.cond`: both paths leave residuals of one layout); the
  Triton ones otherwise. Each callable takes the op's own arguments (q, k, v, gate, [segment
  ids, positions,] then the rest; the backward: the static arguments, the residuals, dO)."""
  def train(*args):
    q, k = args[:2]
    if not mosaic_trains(q.shape, k.shape, q.dtype, *args[-num_static:]):
      return triton_train(*args)
    if not packed:
      return mosaic_train(*args)
    return lax.cond(positions_count_up(args[4], args[5]), lambda: mosaic_train(*args),
                    lambda: triton_train(*args))

  def backward(*args):
    *static, res, d_out = args
    if not mosaic_trains(d_out.shape, res[1].shape, d_out.dtype, *static):   # res[1]: padded k
      return triton_backward(*args)
    if not packed:
      return mosaic_backward(*args)
    return lax.cond(positions_count_up(res[3], res[4]),     # the padded segment ids, positions
                    lambda: mosaic_backward(*args), lambda: triton_backward(*args))

  return train, backward


@takes_backward_tiles()
def packed_xa_forward_train(q, k, v, gate_btk, segment_ids, positions, xa_keep,
                            streaming: Streaming, *, patterns: str, xa_block: int,
                            tiles: Tiles = DEFAULT_TILES, interpret: bool = False):
  """`packed_forward_train` under the XAttention settings ("fa-xa", "xa-ssa"; xa_keep [B, K,
  nb, nb] the kept blocks of `xa_block` tokens, `xattention.select` with the segment ids):
  the launch of XA's term walks every row's kept blocks from its segment's on
  (`packed_xa_walk`). Residuals in the layout of the Triton packed XA kernels'."""
  pair, _ = _checked_xa_call(
      "packed_xa_forward_train", q.shape, k.shape, xa_keep.shape, patterns, xa_block,
      _packed_xa_trains(q.shape, k.shape, q.dtype, streaming, xa_block, tiles),
      f"the Mosaic GPU training kernels do not take packed rows with XAttention blocks of "
      f"{xa_block}, q {q.shape} {q.dtype}, k {k.shape}, {streaming} (see "
      f"mosaic_gpu._packed_xa_trains)")
  return _packed_forward_train(q, k, v, gate_btk, segment_ids, positions, streaming, tiles,
                               interpret, xa_keep, pair, xa_block)


@takes_backward_tiles()
def packed_xa_backward(residuals, d_out, streaming: Streaming, *, patterns: str, xa_block: int,
                       tiles: Tiles = DEFAULT_TILES, interpret: bool = False):
  """(dq, dk, dv, d_gate, 0, 0, 0) from `packed_xa_forward_train`'s residuals (or the Triton
  packed XA kernels'): `packed_backward` with the XA term walking the kept-block lists."""
  grads = _packed_backward(residuals, d_out, streaming, tiles, interpret,
                           split_patterns(patterns), xa_block)
  return (*grads, np.zeros(residuals[-1].shape, jax.dtypes.float0))


def _packed_xa_trains(q_shape, k_shape, dtype, streaming, xa_block, tiles):
  """`_packed_trains` under the XAttention settings: also `xa_trains`, and a padded length
  (both paths': T rounded up to 128) of whole XA blocks, since the dK/dV kernel walks a listed
  query block's every tile (packed rows cannot pad further: the Triton path's residuals fix
  the layout); other lengths take the Triton kernels."""
  return (_packed_trains(q_shape, k_shape, dtype, streaming, tiles)
          and _xa_blocks_fit(q_shape, k_shape, xa_block, tiles)
          and -(-q_shape[1] // 128) * 128 % xa_block == 0)


def _build_packed_xa(tiles: Tiles, training: str):
  """`make_hybrid(packed=True, xa=True)`: `pallas_gpu.make_hybrid(packed=True, xa=True)` (packed rows
  under the XAttention settings) with this kernel as the undifferentiated forward where it
  `xa_applies` and, at run time, `packed_rows_apply` (`packed_xa_forward_hard`; the Triton
  kernel otherwise). training (`TRAINING`): the Mosaic kernels are `packed_xa_forward_train`
  and `packed_xa_backward`, where `_packed_xa_trains` and, at run time, `positions_count_up`
  (the Triton kernels otherwise; both leave residuals of one layout)."""
  triton_forward, triton_train, triton_backward = pallas_gpu.packed_parts(xa=True)

  def forward(q, k, v, gate_btk, seg, pos, xa_keep, streaming, patterns, xa_block, interpret):
    triton = lambda: triton_forward(q, k, v, gate_btk, seg, pos, xa_keep, streaming, patterns,
                                    xa_block, interpret)
    if not xa_applies(q.shape, k.shape, q.dtype, streaming, xa_block, tiles):
      return triton()
    return lax.cond(
        packed_rows_apply(seg, pos, gate_btk),
        lambda: packed_xa_forward_hard(q, k, v, gate_btk, seg, pos, xa_keep, streaming,
                                       patterns=patterns, xa_block=xa_block, tiles=tiles,
                                       interpret=interpret), triton)

  train, grads = _training(
      lambda q_shape, k_shape, dtype, streaming, patterns, xa_block, interpret: (
          _mosaic_training(training, interpret) and _packed_xa_trains(
              q_shape, k_shape, dtype, streaming, xa_block, tiles)),
      lambda q, k, v, gate_btk, seg, pos, xa_keep, streaming, patterns, xa_block, interpret: (
          packed_xa_forward_train(q, k, v, gate_btk, seg, pos, xa_keep, streaming,
                                  patterns=patterns, xa_block=xa_block, tiles=tiles,
                                  interpret=interpret)),
      lambda streaming, patterns, xa_block, interpret, res, d_out: packed_xa_backward(
          res, d_out, streaming, patterns=patterns, xa_block=xa_block, tiles=tiles,
          interpret=interpret),
      triton_train, triton_backward, num_static=4, packed=True)
  return with_fused_backward(forward, train, grads, num_arrays=7, num_static=4)


@takes_backward_tiles(positional=True)
def make_hybrid(tiles: Tiles = DEFAULT_TILES, training: str = "auto", *, packed: bool = False,
                xa: bool = False):
  """This backend's op with a fused backward (`common.with_fused_backward`), the Triton
  kernels' counterpart (`pallas_gpu.make_hybrid` and its packed and XAttention kinds) with
  this file's kernels where they take the call. Its arguments by kind:
    make_hybrid()                  (q, k, v, gate [B, K], streaming, interpret)
    make_hybrid(packed=True)       (q, k, v, gate [B, T, K], segment_ids, positions,
                                    streaming, interpret)
    make_hybrid(xa=True)           (q, k, v, gate [B, K], xa_keep, streaming, patterns,
                                    xa_block, interpret)
    make_hybrid(packed=True, xa=True)
                                   (q, k, v, gate [B, T, K], segment_ids, positions, xa_keep,
                                    streaming, patterns, xa_block, interpret)
  tiles (`Tiles`): the forward kernel's, the dQ and dK/dV kernels' (backward_tiles=, their
  former own, is deprecated: merged into tiles).
  training (`TRAINING`): which training kernels run ("auto": the Mosaic GPU ones natively
  where they take the shapes, the Triton ones in interpret mode and elsewhere; "mosaic";
  "triton"). Where each kind's kernels run: `_build_plain`, `_build_packed`, `_build_xa`,
  `_build_packed_xa`."""
  _check_training(training)
  build = {(False, False): _build_plain, (True, False): _build_packed,
           (False, True): _build_xa, (True, True): _build_packed_xa}[bool(packed), bool(xa)]
  return build(tiles, training)


def _renamed(old: str, packed: bool, xa: bool):
  warnings.warn(f"mosaic_gpu.{old} is deprecated: use make_hybrid(packed={packed}, xa={xa})",
                DeprecationWarning, stacklevel=4)   # past the `takes_backward_tiles` call


@takes_backward_tiles(positional=True)
def make_xa_hybrid(tiles: Tiles = DEFAULT_TILES, training: str = "auto"):
  """Deprecated: `make_hybrid(xa=True)`."""
  _renamed("make_xa_hybrid", packed=False, xa=True)
  return make_hybrid(tiles, training, xa=True)


@takes_backward_tiles(positional=True)
def make_packed_hybrid(tiles: Tiles = DEFAULT_TILES, training: str = "auto"):
  """Deprecated: `make_hybrid(packed=True)`."""
  _renamed("make_packed_hybrid", packed=True, xa=False)
  return make_hybrid(tiles, training, packed=True)


@takes_backward_tiles(positional=True)
def make_packed_xa_hybrid(tiles: Tiles = DEFAULT_TILES, training: str = "auto"):
  """Deprecated: `make_hybrid(packed=True, xa=True)`."""
  _renamed("make_packed_xa_hybrid", packed=True, xa=True)
  return make_hybrid(tiles, training, packed=True, xa=True)


hybrid_attention = functools.partial(kernel_or_reference, make_hybrid(),
                                     xa_kernel=make_hybrid(xa=True),
                                     xa_kernel_applies=pallas_gpu.xa_kernel_applies,
                                     packed_kernel=make_hybrid(packed=True),
                                     packed_xa_kernel=make_hybrid(packed=True, xa=True))
