"""The hybrid FA/SSA inference forward for Hopper GPUs in Pallas Mosaic GPU (wgmma, TMA).

Warp-specialised, FlashAttention-3 style: per program, one memory warpgroup streams K/V tiles
into a ring of shared-memory slots with the bulk copy engine (TMA), and two compute
warpgroups run QK^T and PV on the tensor cores (wgmma) with an online softmax in registers,
taking turns on the tensor cores (a schedule barrier) so that one's softmax overlaps the
other's matrix products. `MosaicTiles(overlap=True)` adds FlashAttention-3's second technique,
each warpgroup's softmax overlapping its own PV product (tile s's QK^T and tile s-1's PV
issued together, `_kernel`'s `overlapped`); `MosaicTiles(persistent=P)` launches P
persistent programs that take the work items in turn, heaviest first, the K/V ring running
on from one item to the next (`_persistent`). Both are checked against the reference in
interpret mode (where wgmma runs synchronously) and natively. `MosaicTiles(multicast=True)`
launches the two programs of one KV head and query tile as a cluster that shares each K/V tile
(TMA multicast); Pallas's GPU interpreter has no multicast copy, so it is checked natively
only (against the reference in the tests; on an H100 its outputs were also bit-equal to the
default schedule's, plain, packed and XA rows). The overlap rescales the accumulator and casts P to bf16 after the PV product's wait, as
FlashAttention-3 does (with a product in flight, ptxas serialises every wgmma: warning C7513).
`MosaicTiles(q_registers=True)` feeds QK^T its Q tile from registers (loaded once per work
item), so that the tensor cores read only K out of shared memory; natively only (interpret
mode keeps Q in shared memory). Which schedule is fastest is measured, not assumed:
`benchmarks/attention.py --mosaic-tiles` times them side by side, and its records
(benchmarks/records/attention.md) show none of these beating the default schedule so far.

The routing is read at run time, one launch for all heads: every program loads its KV head's
mode from a small int32 array and walks that head's own list of KV tiles,
  FULL    tiles 0 .. causal end;
  SPARSE  the sink tiles, then the local window up to the diagonal;
so a streaming head never loads its far-away tiles. Both the memory and the compute warpgroups
derive the same list from the mode (`walk`); only the diagonal tile is masked. Programs start
heaviest first (the last query tiles have the most causal tiles).

GQA: when the KV head has G >= 2 query heads, the two compute warpgroups take two query heads
of the same KV head over the same rows and share every K/V tile load; with G = 1 they take two
consecutive row tiles of one head.

Scope. This kernel serves undifferentiated calls with gates of 0 or 1 (what routing at
inference produces): a call whose gates include a fraction runs the Triton kernel instead
(one run-time branch, `hybrid_forward`). XAttention heads (the "fa-xa" and "xa-ssa"
settings, `xa_forward_hard`) walk their kept-block lists: a third walk (`xa_walk`), the list
read at run time. Training runs this file's `forward_train` (the kernel launched twice with
every head full, then streaming, also writing each row's log-sum-exp) and the Mosaic GPU dQ
and dK/dV kernels (`mosaic_gpu_backward`) where they take the shapes (`trains`), the Triton
kernels (`pallas_gpu`) elsewhere and, by default, in interpret mode (`TRAINING`); likewise
under the XAttention settings (`xa_forward_train`, `xa_backward`). Its layout constraints
(`applies`): bf16 or fp16, head_dim a multiple of 64 whose tiles fit in shared memory (up to
128 with the default tiles), the streaming block a multiple of the KV tile (128) so the
window's edges fall on tile edges, and G even or 1. T is padded inside. Interpret mode
(`interpret=True`) runs it on a CPU.

Packed rows (segment ids and positions, `packed_forward_hard`, end of this file): the walk
starts at the tile of the segment start of the program's first row (`common.packed_plan`),
and masked tiles compare each key with three per-row bounds; see the section there. Under the
XAttention settings (`packed_xa_forward_hard`) the programs of XA rows walk their kept-block
lists in the same launch. Their
training (`packed_forward_train`, `packed_backward`; under the XAttention settings
`packed_xa_forward_train`, `packed_xa_backward`) is chosen as the unpacked one's.

Shape letters: B batch, T tokens, N query heads, K KV heads, G = N / K, D head dim.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from elastic_jax.attention import mosaic_gpu_backward, pallas_gpu
from elastic_jax.attention.common import (MODE_FULL, MODE_SPARSE, kernel_or_reference,
                                          modes_from_gate, packed_plan, pad_packed, pad_to,
                                          row_deltas, segment_bounds, with_fused_backward,
                                          xa_operands)
from elastic_jax.attention.mosaic_gpu_backward import (DEFAULT_BACKWARD_TILES, BackwardTiles,
                                                      XATerms)
from elastic_jax.attention.reference import MASK_VALUE, Streaming, split_patterns
from elastic_jax.attention.xattention import block_lists

try:  # the Mosaic GPU dialect ships with jaxlib; keep the package importable without it
  from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover
  plgpu = None

_LOG2E = math.log2(math.e)
_COMPUTE_WGS = 2
_PLAN_WIDTH = 8     # entries per query tile of common.packed_plan's q_plan
_ROW_FIELDS = 3     # per packed row: segment start, end of the sink, start of the window
SMEM_BYTES = 227 * 1024   # shared memory a Hopper thread block may use
_NO_WINDOW = np.iinfo(np.int32).max   # an XA row's window start (`_row_bounds`): beyond any row


@dataclasses.dataclass(frozen=True)
class MosaicTiles:
  """Rows per compute warpgroup, keys per KV tile, K/V slots in the shared-memory ring, and
  the compute warpgroups' schedule: with `overlap`, each issues tile s's QK^T and tile s-1's
  PV together and runs tile s's softmax while the PV product is in flight (FlashAttention-3's
  intra-warpgroup overlap, beside the two warpgroups' turns), holding one more score tile
  and P in registers; without, QK^T, softmax, PV in turn. persistent = P > 0 launches P
  programs (e.g. the GPU's SM count) that each take the work items p, p + P, ... in
  heavy-first order, the K/V ring running on across items (the next item's first tiles load
  while the last ones are computed); 0 launches one program per item. multicast (G a
  multiple of 4, not persistent) launches the two programs of one KV head and query tile as
  a cluster: each loads half of every K/V tile and the bulk copy engine multicasts it into
  both programs' rings, halving the K/V traffic out of L2; a slot is free once both
  programs' warpgroups have released it (a cluster barrier). q_registers (natively; interpret
  mode keeps Q in shared memory) loads each warpgroup's Q tile into registers once, so that
  QK^T reads only K out of shared memory. trace (natively; a diagnostic): a folder where the
  Mosaic GPU profiler writes, on every call, a timeline of each warpgroup's regions of the
  schedule with neither overlap nor chain (`TRACE_REGIONS`) as a Perfetto trace (JSON); each
  region costs a few cycles of clock reads and stores, so a traced kernel runs slower. The events
  collect in the shared memory the tiles leave free (about 64 KiB at the default tiles and
  head_dim 128: walks up to about 24K tokens); not with persistent programs. chain (not with
  overlap, persistent or trace): in its turn a compute warpgroup issues tile s+1's QK^T and
  tile s's PV back to back and awaits both after the turn, where the schedule without overlap
  awaits PV before it issues the next QK^T; the tensor cores then see no wait between a
  warpgroup's two products, and the other warpgroup's softmax still covers them. A tile's K
  is then released a step before its V, and each is refilled as soon as it is free. The
  builders' default, `DEFAULT_TILES`, chains its products (on an H100, full heads 1.6-4.3%
  faster than without, hybrid rows 0.4-8.5%; benchmarks/README.md); `MosaicTiles()` is the
  schedule with neither overlap nor chain."""
  block_q: int = 64
  block_kv: int = 128
  slots: int = 2
  overlap: bool = False
  persistent: int = 0
  multicast: bool = False
  q_registers: bool = False
  trace: str = ""
  chain: bool = False


# The regions a traced kernel (`MosaicTiles.trace`) records per KV tile, in order, in the
# schedule with neither overlap nor chain: issuing QK^T, the warpgroups' turn before its
# result is read, waiting for the result, the softmax (with the accumulator's rescale and P's
# cast), the turn and the V tile before PV, then issuing PV, the next K tile's arrival and
# PV's end.
TRACE_REGIONS = ("qk_issue", "qk_turn", "qk_wait", "softmax", "pv_turn", "pv")


DEFAULT_TILES = MosaicTiles(chain=True)
# The builders' training kernels: "auto" (the Mosaic GPU ones natively where they take the
# shapes, the Triton ones in interpret mode and elsewhere), "mosaic" (also in interpret
# mode), "triton".
TRAINING = ("auto", "mosaic", "triton")


def applies(q_shape, k_shape, dtype, streaming: Streaming,
            tiles: MosaicTiles = DEFAULT_TILES) -> bool:
  """Whether this kernel takes a call of these shapes (else the Triton kernel does)."""
  if plgpu is None:
    return False
  n, d = q_shape[2], q_shape[3]
  kh = k_shape[2]
  groups = n // kh
  rows = _rows_per_program(groups, tiles)
  # Shared memory: the Q/O tiles of both compute warpgroups and the K and V rings (2 bytes an
  # element), the packed rows' bounds and the log-sum-exps (4 bytes a row each) and 1 KiB for
  # the barriers, against the 227 KiB a Hopper block may have: head_dim 128 takes 163 KiB
  # with the default tiles (227 with 3 slots), 192 does not fit.
  smem = ((_COMPUTE_WGS * tiles.block_q + 2 * tiles.slots * tiles.block_kv) * d * 2
          + _COMPUTE_WGS * tiles.block_q * 4 * (_ROW_FIELDS + 1) + 1024)
  return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
          and d % 64 == 0 and smem <= SMEM_BYTES and (groups == 1 or groups % 2 == 0)
          and streaming.block % tiles.block_kv == 0 and streaming.block % rows == 0
          and tiles.block_kv % rows == 0 and tiles.block_q % 64 == 0
          and tiles.block_kv % 64 == 0 and tiles.slots >= 2 and tiles.persistent >= 0
          and (not tiles.multicast or (groups % 4 == 0 and not tiles.persistent))
          and not (tiles.trace and tiles.persistent)
          and not (tiles.chain and (tiles.overlap or tiles.persistent or tiles.trace)))


def _rows_per_program(groups: int, tiles: MosaicTiles) -> int:
  return tiles.block_q if groups >= 2 else _COMPUTE_WGS * tiles.block_q


def walk(q_start, rows: int, mode, streaming: Streaming, block_kv: int):
  """The KV tiles a program of `rows` query rows from `q_start` visits, as a list of steps.

  Returns (steps, sink_end, second_start): step s reads tile s while s < sink_end, else tile
  second_start + s - sink_end. A full head's list is 0 .. causal end; a streaming head's is
  the sink tiles, then the window from its first tile to the causal end (the window's start
  is a multiple of the streaming block, itself a multiple of `block_kv`). Integer arithmetic
  on Python ints or traced scalars alike.
  """
  per_block = streaming.block // block_kv
  causal_end = (q_start + rows + block_kv - 1) // block_kv
  sink = jnp.minimum(streaming.sink_blocks * per_block, causal_end)
  first_block = q_start // streaming.block
  window = jnp.maximum(first_block - streaming.local_blocks + 1, 0) * per_block
  sparse = mode == MODE_SPARSE
  sink_end = jnp.where(sparse, sink, causal_end)
  second_start = jnp.where(sparse, jnp.maximum(window, sink), causal_end)
  steps = sink_end + causal_end - second_start
  return steps, sink_end, second_start


@dataclasses.dataclass(frozen=True)
class XAWalk:
  """How the kernel reads XAttention heads: the head mode that XA takes (MODE_SPARSE under
  "fa-xa", MODE_FULL under "xa-ssa"), the XA block in tokens (a multiple of the KV tile and of
  the rows per program) and the number of blocks per kept-block list. Packed rows: `mixed`
  when rows of both patterns share the launch (`packed_xa_forward_hard`), else every row is
  an XA row (the training forward's XA launch)."""
  mode: int
  block: int
  num_blocks: int
  mixed: bool = False


def xa_walk(q_start, rows: int, count, xa_block: int, block_kv: int):
  """The KV tiles an XAttention head's program visits, as `walk` returns them: its `count`
  kept blocks strictly below the diagonal block (whole: every key precedes every row), read
  from its list, then the diagonal block's tiles up to the causal end (XAttention always keeps
  the diagonal). Returns (steps, n1, second_start): steps < n1 read listed blocks' tiles."""
  per_block = xa_block // block_kv
  causal_end = (q_start + rows + block_kv - 1) // block_kv
  second_start = q_start // xa_block * per_block
  n1 = count * per_block
  return n1 + causal_end - second_start, n1, second_start


def _tile_of(step, lo, n1, second_start):
  """The KV tile of step `step` of a walk that reads tiles lo .. lo + n1 - 1, then tiles
  second_start onwards."""
  return jnp.where(step < n1, lo + step, second_start + step - n1)


def packed_walk(plan, mode):
  """The walk of a program over packed rows from its `common.packed_plan` entries (kv_lo,
  sink_hi, win_lo, causal_hi, in_lo, in_hi, sparse_in_hi): (steps, lo, n1, second_start,
  unmasked_lo, unmasked_hi). A full head and a program whose rows are routed differently
  (MODE_MIX: the per-row window masks decide) read [kv_lo, causal_hi); a streaming head its
  sink tiles then its window. Tiles [unmasked_lo, unmasked_hi) need no mask (none for MIX)."""
  kv_lo, sink_hi, win_lo, causal_hi, in_lo, in_hi, sparse_in_hi = plan
  sparse = mode == MODE_SPARSE
  n1 = jnp.where(sparse, sink_hi, causal_hi) - kv_lo
  second = jnp.where(sparse, jnp.maximum(win_lo, sink_hi), causal_hi)
  unmasked_hi = jnp.where(sparse, sparse_in_hi, jnp.where(mode == MODE_FULL, in_hi, in_lo))
  return n1 + causal_hi - second, kv_lo, n1, second, in_lo, unmasked_hi


def _kernel(modes_ref, plan_ref, xa_refs, q_ref, k_ref, v_ref, rows_ref, out_refs, scoped, *,
            groups, num_kv_heads, streaming, tiles: MosaicTiles, scale, num_q_tiles,
            xa: "XAWalk | None", item=None, base=None, role=None):
  """One program: `rows` query rows of one or two query heads. Unpacked rows (plan_ref None)
  walk `walk`'s list (an XA head: `xa_walk`'s, reading its kept-block list from xa_refs) and
  mask the causal diagonal; packed rows walk their precomputed `packed_walk` (plan_ref: its
  six fields' arrays) and mask every tile outside its unmasked range with per-row bounds
  (rows_ref); with `xa` there (every row XA, `packed_xa_walk`) the walk's first piece reads
  list positions through the kept-block list, masked outside its unmasked steps; with
  `xa.mixed`, only the programs flagged by the walk's seventh field do, and XA rows
  (`_row_bounds`) see the keys of kept blocks (read from the dense keep array, xa_refs'
  second). A persistent program (`_persistent`) runs it per work item: item = its (batch,
  head pair, query tile), base = the ring steps of its earlier items, role = "compute" or
  "memory" (that warpgroup's part alone; returns the item's steps)."""
  (qo_smem2, k_smem, v_smem, p_smem2, rows_smem2, lse_smem2), ready, (k_free, v_free), turn = (
      scoped)
  out_ref, lo_ref, lse_ref = out_refs
  k_ready, v_ready, q_ready, rows_ready = ready
  block_q, block_kv, slots = tiles.block_q, tiles.block_kv, tiles.slots
  pair_heads = groups >= 2
  rows = _rows_per_program(groups, tiles)
  head_dim = q_ref.shape[-1]
  dtype = q_ref.dtype
  packed = plan_ref is not None

  if item is None:
    b = lax.axis_index("b")
    hp = lax.axis_index("hp")
    if tiles.multicast:   # a cluster: the two head pairs of one KV head
      hp = hp * 2 + lax.axis_index("pair")
    # Heavy first: programs launch in grid order, and the last query tiles have the most
    # causal tiles to visit, so they start first and the short ones fill the tail. Light first
    # measured slower on full heads (benchmarks/records/attention.md), though the Triton
    # kernels want light first.
    qt = num_q_tiles - 1 - lax.axis_index("qt")
  else:
    b, hp, qt = item
  wg = lax.axis_index("wg")
  # A step's slot in the K/V ring (which runs on across a persistent program's items).
  ring = lambda s: lax.rem(s if base is None else base + s, jnp.int32(slots))
  heads_per_program = _COMPUTE_WGS if pair_heads else 1
  kv_head = lax.div(hp * heads_per_program, jnp.int32(groups))
  q_start = qt * rows
  if packed:   # the program's walk, precomputed (`packed_walk`), one array per field
    at = (b * num_kv_heads + kv_head) * num_q_tiles + qt
    steps, lo, n1, second_start, unmasked_lo, unmasked_hi = (ref[at] for ref in plan_ref[:6])
    tile_of = lambda s: _tile_of(s, lo, n1, second_start)
    walks_list = None if xa is None else True   # `_step_ranges`' listed
    if xa is not None:   # an XA program (`packed_xa_walk`): steps < n1 read list positions lo..
      index_ref = xa_refs[0]
      list_at = (b * num_kv_heads + kv_head) * xa.num_blocks + q_start // xa.block
      listed = lambda s: mosaic_gpu_backward.kept_list_tile(
          index_ref, list_at, lo + jnp.minimum(s, n1 - 1), xa.block // block_kv, xa.num_blocks)
      tile_of = lambda s: jnp.where(s < n1, listed(s), second_start + s - n1)
      if xa.mixed:   # the other programs walk their own tiles
        walks_list = plan_ref[6][at] != 0
        tile_of = lambda s: jnp.where(s < n1, jnp.where(walks_list, listed(s), lo + s),
                                      second_start + s - n1)
  else:
    slot = b * num_kv_heads + kv_head
    mode = modes_ref[slot]
    steps, n1, second_start = walk(q_start, rows, mode, streaming, block_kv)
    lo = jnp.int32(0)
    if xa is None:
      tile_of = lambda s: _tile_of(s, lo, n1, second_start)
    else:   # an XA head walks its kept blocks below the diagonal, then the diagonal
      index_ref, count_ref = xa_refs
      is_xa = mode == xa.mode
      q_block = q_start // xa.block
      list_at = (slot * xa.num_blocks + q_block) * xa.num_blocks
      xa_steps, xa_n1, xa_second = xa_walk(q_start, rows, count_ref[slot * xa.num_blocks
                                                                    + q_block], xa.block,
                                           block_kv)
      steps, n1, second_start = (jnp.where(is_xa, x, y) for x, y in (
          (xa_steps, steps), (xa_n1, n1), (xa_second, second_start)))
      per_block = xa.block // block_kv

      def tile_of(s):   # other heads read one fixed entry (a cached load, not a dependent one)
        entry = list_at + jnp.minimum(s // per_block, xa.num_blocks - 1)
        kept = index_ref[jnp.where(is_xa, entry, 0)]
        first = jnp.where(is_xa, kept * per_block + lax.rem(s, jnp.int32(per_block)), s)
        return jnp.where(s < n1, first, second_start + s - n1)

  def take_turn():
    plgpu.barrier_arrive(turn)
    plgpu.barrier_wait(turn)

  def _compute():
    if role is None:
      plgpu.set_max_registers(232, action="increase")
    qo_smem = qo_smem2.at[wg]
    head = hp * heads_per_program + (wg if pair_heads else 0)
    row0 = q_start + (0 if pair_heads else wg * block_q)
    plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(row0, block_q), head], qo_smem,
                            q_ready.at[wg])
    if packed:   # this warpgroup's rows: segment start, end of the sink, start of the window
      for x in range(_ROW_FIELDS):
        plgpu.copy_gmem_to_smem(rows_ref.at[b, kv_head, x, pl.ds(row0, block_q)],
                                rows_smem2.at[wg, x], rows_ready.at[wg * _ROW_FIELDS + x])
      bounds = []
      for x in range(_ROW_FIELDS):
        plgpu.barrier_wait(rows_ready.at[wg * _ROW_FIELDS + x])
        bounds.append(plgpu.load(rows_smem2.at[wg, x], layout=plgpu.Layout.WGMMA.reduce(1)))
    plgpu.barrier_wait(q_ready.at[wg])
    # QK^T's left operand: the Q tile from shared memory, or (q_registers, natively) from
    # registers, so that the tensor cores read only K out of shared memory.
    q_op = (plgpu.load(qo_smem, layout=plgpu.Layout.WGMMA)
            if tiles.q_registers and p_smem2 is None else qo_smem)

    def mask(x, tile):
      shape = (block_q, block_kv)
      row = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA) + row0
      col = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA) + (
          tile * block_kv)
      ok = row >= col
      if packed:
        start, sink_end, window = (lax.broadcast_in_dim(v, shape, [0]) for v in bounds)
        ok = ok & (col >= start)
        seen = (col < sink_end) | (col >= window)
        if xa is not None and xa.mixed:   # XA rows: no window (`_NO_WINDOW`), kept blocks
          keep_ref = xa_refs[1]
          kept = keep_ref[list_at * xa.num_blocks + tile * block_kv // xa.block] != 0
          seen = seen | ((window == _NO_WINDOW) & kept)
        ok = ok & seen
      return jnp.where(ok, x, MASK_VALUE)

    m_i = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32),
                            plgpu.Layout.WGMMA.reduce(1))
    l_i = plgpu.layout_cast(jnp.full((block_q,), 0.0, jnp.float32),
                            plgpu.Layout.WGMMA.reduce(1))
    acc = plgpu.layout_cast(jnp.full((block_q, head_dim), 0.0, jnp.float32),
                            plgpu.Layout.WGMMA)
    bcast = lambda x, like: lax.broadcast_in_dim(x, like.shape, [0])

    def softmax(x, tile, m_i, l_i, masked: bool, acc=None):
      """A KV tile's scores -> (P in float32, new row max, new row sum, the factor that
      rescales the accumulator to the new max, and acc so rescaled where given); tile:
      a callable giving the KV tile (its masks' columns). Base-2 with the scale folded in: m
      is kept scaled, p = exp2(x * c - m) is an FMA. A masked tile scales first and masks to
      a finite MASK_VALUE: a row none of whose keys the tile shows (another segment's) then
      gets p = exp2(0) weights that the first visible key's larger maximum scales to zero
      (an FMA of the huge mask value would not cancel)."""
      c = scale * _LOG2E
      if masked:
        x = mask(x * c, tile())
        m_new = jnp.maximum(m_i, x.max(axis=1))
        p = jnp.exp2(x - bcast(m_new, x))
      else:
        m_new = jnp.maximum(m_i, x.max(axis=1) * c)
        p = jnp.exp2(x * c - bcast(m_new, x))
      alpha = jnp.exp2(m_i - m_new)
      if acc is not None:
        acc = acc * bcast(alpha, acc)
      l_i = l_i * alpha + p.sum(axis=1)
      return p, m_new, l_i, alpha, acc

    def pv_product(acc_ref, p_lo, slot):
      if p_smem2 is None:
        plgpu.wgmma(acc_ref, p_lo, v_smem.at[slot])
      else:   # interpret mode: P through shared memory
        p_smem2.at[wg][...] = p_lo
        plgpu.commit_smem()
        plgpu.wgmma(acc_ref, p_smem2.at[wg], v_smem.at[slot])

    def add_pv(acc, body, outs_like=()):
      """(acc + the PV product that body(acc_ref) issues, body's outputs): natively wgmma adds
      into the running accumulator (`run_state`, whose end awaits it; body's outputs, shaped
      as outs_like, leave through its state); interpret mode has no run_state, so there a
      fresh accumulator is added after."""
      if p_smem2 is None and not outs_like:
        return pl.run_state(body)(plgpu.ACC.init(acc)), ()
      if p_smem2 is None:
        def state(refs):
          acc_ref, *out_refs = refs
          for ref, x in zip(out_refs, body(acc_ref)):
            ref[...] = x

        acc, *outs = pl.run_state(state)((plgpu.ACC.init(acc), *outs_like))
        return acc, tuple(outs)
      pv, outs = pl.run_scoped(lambda ref: (lambda outs: (ref[...], outs))(body(ref) or ()),
                               plgpu.ACC((block_q, head_dim), jnp.float32))
      return acc + pv, outs

    def overlapped(acc, m_i, l_i, ranges):
      """The walk with FlashAttention-3's intra-warpgroup overlap (`MosaicTiles.overlap`).
      Step s issues tile s's QK^T and tile s-1's PV back to back, awaits only the first, and
      runs tile s's softmax (P in float32) while the PV product is in flight; once that product
      is awaited it rescales the accumulator to the new row max and casts P for step s+1's PV
      (registers a wgmma reads are defined only while none is in flight). The warpgroups take
      turns issuing: turn[w] is warpgroup w's, arrived at by the other once it has issued, so
      that one's softmax also overlaps the other's products. Step 0 issues its QK^T alone,
      masked (the masks are exact on any tile of a walk); the last PV is issued after the loop.
      The turns run on across a persistent program's items: a one-arrival barrier must not
      complete twice before its waiter has seen the first completion, so warpgroup 1's first
      arrival and warpgroup 0's last wait are the program's, not each item's."""
      scores = lambda: plgpu.ACC((block_q, block_kv), jnp.float32)

      def issue_qk(s_ref, slot):
        plgpu.barrier_wait(turn.at[wg])
        plgpu.wgmma(s_ref, q_op, k_smem.at[slot].transpose((1, 0)))

      slot0 = ring(0)
      plgpu.barrier_wait(k_ready.at[slot0])
      if base is None:   # warpgroup 0 goes first (a persistent program: once, `_persistent`)
        pl.when(wg == 1)(lambda: plgpu.barrier_arrive(turn.at[0]))

      def first(s_ref):
        issue_qk(s_ref, slot0)
        plgpu.barrier_arrive(turn.at[1 - wg])
        return s_ref[...]

      x = pl.run_scoped(first, scores())
      plgpu.barrier_arrive(k_free.at[slot0])
      p, m_i, l_i, _, _ = softmax(x, lambda: tile_of(0), m_i, l_i, masked=True)
      p_lo = p.astype(dtype)
      x_like = plgpu.layout_cast(jnp.full((block_q, block_kv), 0.0, jnp.float32),
                                 plgpu.Layout.WGMMA)   # the shape of a step's P, leaving PV's state

      def step(s, carry, masked: bool):
        acc, m_i, l_i, p_lo = carry   # acc at the row max m_i; p_lo: tile s-1's P
        slot, prev = ring(s), ring(s - 1)
        tile = tile_of(s)   # outside run_state, which cannot close over constants
        plgpu.barrier_wait(k_ready.at[slot])
        plgpu.barrier_wait(v_ready.at[prev])

        def products(s_ref):
          issue_qk(s_ref, slot)

          def pv_then_softmax(acc_ref):
            pv_product(acc_ref, p_lo, prev)
            plgpu.barrier_arrive(turn.at[1 - wg])
            x = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)   # QK^T done; PV may run on
            plgpu.barrier_arrive(k_free.at[slot])
            p, m_new, l_new, alpha, _ = softmax(x, lambda: tile, m_i, l_i, masked)
            return p, m_new, l_new, alpha

          return add_pv(acc, pv_then_softmax, (x_like, m_i, l_i, m_i))

        acc, outs = pl.run_scoped(products, scores())
        # Only now, the PV product awaited, are its operands' registers redefined: the
        # accumulator's rescale and P's cast while a product is in flight would make ptxas
        # serialise the wgmma (C7513); the barrier keeps them after the wait.
        acc, (p, m_new, l_new, alpha) = lax.optimization_barrier((acc, outs))
        plgpu.barrier_arrive(v_free.at[prev])
        return acc * bcast(alpha, acc), m_new, l_new, p.astype(dtype)

      carry = (acc, m_i, l_i, p_lo)
      for s_lo, s_hi, masked in ranges:
        carry = lax.fori_loop(jnp.maximum(s_lo, 1), jnp.maximum(s_hi, 1),
                              functools.partial(step, masked=masked), carry)
      acc, m_i, l_i, p_lo = carry
      last = ring(steps - 1)
      plgpu.barrier_wait(v_ready.at[last])
      plgpu.barrier_wait(turn.at[wg])

      def pv_last(acc_ref):
        pv_product(acc_ref, p_lo, last)
        plgpu.barrier_arrive(turn.at[1 - wg])

      acc, _ = add_pv(acc, pv_last)
      plgpu.barrier_arrive(v_free.at[last])
      if base is None:   # observe warpgroup 1's last arrival (a persistent program: at its end;
        # between items that arrival is the next item's first turn)
        pl.when(wg == 0)(lambda: plgpu.barrier_wait(turn.at[0]))
      return acc, m_i, l_i

    def chained(acc, m_i, l_i, ranges):
      """The walk without overlap, its products chained (`MosaicTiles.chain`): step s runs
      tile s's softmax on the scores the last turn left, then, in the warpgroup's turn, issues
      tile s+1's QK^T and tile s's PV, and awaits both after the turn. Step 0's QK^T is issued
      alone before the loop; the last step, peeled, issues its PV alone and runs masked (the
      masks are exact on any tile of a walk). Two turns a step, as without the chain."""
      scores = lambda: plgpu.ACC((block_q, block_kv), jnp.float32)
      plgpu.barrier_wait(k_ready.at[ring(0)])
      pl.when(wg == 1)(take_turn)

      def first(s_ref):
        plgpu.wgmma(s_ref, q_op, k_smem.at[ring(0)].transpose((1, 0)))
        take_turn()
        return s_ref[...]

      x = pl.run_scoped(first, scores())
      plgpu.barrier_arrive(k_free.at[ring(0)])

      def softmax_and_turn(s, carry, masked: bool):
        acc, m_i, l_i, x = carry
        p, m_new, l_i, _, acc = softmax(x, lambda: tile_of(s), m_i, l_i, masked, acc)
        acc, l_i, m_new, p_lo = lax.optimization_barrier((acc, l_i, m_new, p.astype(dtype)))
        plgpu.barrier_arrive(turn)
        plgpu.barrier_wait(v_ready.at[ring(s)])
        return acc, m_new, l_i, p_lo

      def step(s, carry, masked: bool):
        acc, m_i, l_i, p_lo = softmax_and_turn(s, carry, masked)
        slot, nxt = ring(s), ring(s + 1)
        plgpu.barrier_wait(k_ready.at[nxt])
        plgpu.barrier_wait(turn)

        def products(s_ref):
          # QK^T first: its accumulator's zero fill precedes every product in flight.
          plgpu.wgmma(s_ref, q_op, k_smem.at[nxt].transpose((1, 0)))

          def pv(acc_ref):
            pv_product(acc_ref, p_lo, slot)
            take_turn()

          acc_new, _ = add_pv(acc, pv)
          return acc_new, s_ref[...]

        acc, x = pl.run_scoped(products, scores())
        plgpu.barrier_arrive(v_free.at[slot])
        plgpu.barrier_arrive(k_free.at[nxt])
        return acc, m_i, l_i, x

      carry = (acc, m_i, l_i, x)
      for s_lo, s_hi, masked in ranges:
        carry = lax.fori_loop(s_lo, jnp.minimum(s_hi, steps - 1),
                              functools.partial(step, masked=masked), carry)
      last = steps - 1
      acc, m_i, l_i, p_lo = softmax_and_turn(last, carry, masked=True)
      plgpu.barrier_wait(turn)
      acc, _ = add_pv(acc, lambda acc_ref: pv_product(acc_ref, p_lo, ring(last)))
      plgpu.barrier_arrive(v_free.at[ring(last)])
      pl.when(wg == 0)(take_turn)
      return acc, m_i, l_i

    step_ranges = lambda: _step_ranges(
        packed, steps, lo, n1, second_start, q_start, rows, row0, block_kv,
        *((unmasked_lo, unmasked_hi, None if walks_list is None else (walks_list, listed(0)))
          if packed else ()))
    if tiles.overlap:
      acc, m_i, l_i = overlapped(acc, m_i, l_i, step_ranges())
    elif tiles.chain:
      acc, m_i, l_i = chained(acc, m_i, l_i, step_ranges())
    else:
      plgpu.barrier_wait(k_ready.at[0 if base is None else ring(0)])
      pl.when(wg == 1)(take_turn)

      def step(s, carry, masked: bool):
        acc, m_i, l_i = carry
        slot = ring(s)

        def qk(acc_ref):
          with jax.named_scope("qk_issue"):
            plgpu.wgmma(acc_ref, q_op, k_smem.at[slot].transpose((1, 0)))
          with jax.named_scope("qk_turn"):
            take_turn()
          with jax.named_scope("qk_wait"):
            return acc_ref[...]

        x = pl.run_scoped(qk, plgpu.ACC((block_q, block_kv), jnp.float32))
        plgpu.barrier_arrive(k_free.at[slot])
        with jax.named_scope("softmax"):
          p, m_new, l_i, _, acc = softmax(x, lambda: tile_of(s), m_i, l_i, masked, acc)
          acc, l_i, m_new, p_lo = lax.optimization_barrier((acc, l_i, m_new, p.astype(dtype)))
        with jax.named_scope("pv_turn"):
          plgpu.barrier_arrive(turn)
          plgpu.barrier_wait(v_ready.at[slot])
          plgpu.barrier_wait(turn)

        def pv(acc_ref):
          pv_product(acc_ref, p_lo, slot)
          nxt = s + 1

          @pl.when(nxt < steps)
          def _():
            plgpu.barrier_wait(k_ready.at[ring(nxt)])

        with jax.named_scope("pv"):
          acc, _ = add_pv(acc, pv)
        plgpu.barrier_arrive(v_free.at[slot])
        return acc, m_new, l_i

      carry = (acc, m_i, l_i)
      for s_lo, s_hi, masked in step_ranges():
        carry = lax.fori_loop(s_lo, s_hi, functools.partial(step, masked=masked), carry)
      acc, m_i, l_i = carry
      pl.when(wg == 0)(take_turn)
    acc = acc / lax.broadcast_in_dim(l_i, acc.shape, [0])
    hi = acc.astype(dtype)
    qo_smem[...] = hi
    if lse_ref is not None:
      lse_smem2.at[wg][...] = m_i + jnp.log2(l_i)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[b, pl.ds(row0, block_q), head])
    if lse_ref is not None:
      plgpu.copy_smem_to_gmem(lse_smem2.at[wg], lse_ref.at[b, head, pl.ds(row0, block_q)])
    if lo_ref is not None:   # the rounding remainder, once the first store has read the tile
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      qo_smem[...] = (acc - hi.astype(jnp.float32)).astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(qo_smem, lo_ref.at[b, pl.ds(row0, block_q), head])
    plgpu.wait_smem_to_gmem(0)

  def _memory():
    if role is None:
      plgpu.set_max_registers(40, action="decrease")
    # Multicast: each program of the cluster loads half of a tile into both rings.
    multicast = dict(collective_axes="pair") if tiles.multicast else {}

    def load(s, slot, parts=((k_ref, k_smem, k_ready), (v_ref, v_smem, v_ready))):
      rows_kv = pl.ds(tile_of(s) * block_kv, block_kv)
      for src, dst, ready_ in parts:
        plgpu.copy_gmem_to_smem(src.at[b, rows_kv, kv_head], dst.at[slot], ready_.at[slot],
                                **multicast)

    if base is not None:   # a persistent program's item: the ring's slots may still be busy
      @pl.loop(0, steps)
      def _(s):
        slot = ring(s)
        wait = lambda free: pl.when(base + s >= slots)(
            lambda: plgpu.barrier_wait(free.at[slot]))
        if tiles.overlap:
          wait(k_free)
          load(s, slot, ((k_ref, k_smem, k_ready),))
          wait(v_free)
          load(s, slot, ((v_ref, v_smem, v_ready),))
        else:
          wait(k_free)
          wait(v_free)
          load(s, slot)
      return

    for i in range(slots):
      pl.when(i < steps)(functools.partial(load, jnp.int32(i), i))

    @pl.loop(0, jnp.maximum(steps - slots, 0))
    def _(s):
      slot = lax.rem(s, jnp.int32(slots))
      if tiles.overlap or tiles.chain:   # K is released a step before V: load each when free
        plgpu.barrier_wait(k_free.at[slot])
        load(s + slots, slot, ((k_ref, k_smem, k_ready),))
        plgpu.barrier_wait(v_free.at[slot])
        load(s + slots, slot, ((v_ref, v_smem, v_ready),))
      else:
        plgpu.barrier_wait(k_free.at[slot])
        plgpu.barrier_wait(v_free.at[slot])
        load(s + slots, slot)

    @pl.loop(jnp.maximum(steps - slots, 0), steps)
    def _(s):  # observe the last releases too, so every barrier phase is consumed
      slot = lax.rem(s, jnp.int32(slots))
      plgpu.barrier_wait(k_free.at[slot])
      plgpu.barrier_wait(v_free.at[slot])

  if role is None:
    pl.when(wg < _COMPUTE_WGS)(_compute)
    pl.when(wg == _COMPUTE_WGS)(_memory)
    return None
  (_compute if role == "compute" else _memory)()
  return steps


def _persistent(kernel, scoped, *, programs: int, num_heads: int, batch: int,
                num_q_tiles: int, slots: int, overlap: bool):
  """A persistent program: the work items p, p + P, ... of P = `programs` (item w: head pair w
  mod num_heads, batch row w // num_heads mod batch, query tile counted from the last, so
  that items run heaviest first), each through kernel(item, base, role), the K/V ring's step
  count carried across items; at the end the memory warpgroup observes the last releases.
  With `overlap`, the turns' first arrival and last wait (`_kernel`'s `overlapped`)."""
  _, _, (k_free, v_free), turn = scoped
  p = lax.axis_index("p")
  wg = lax.axis_index("wg")
  total = num_heads * batch * num_q_tiles
  count = jnp.maximum((total - p + programs - 1) // programs, 0)

  def run(role):
    def one(i, base):
      w = p + i * programs
      item = (lax.rem(w // num_heads, batch), lax.rem(w, num_heads),
              num_q_tiles - 1 - w // (num_heads * batch))
      return base + kernel(item, base, role)
    return lax.fori_loop(0, count, one, jnp.int32(0))

  @pl.when(wg < _COMPUTE_WGS)
  def _():
    plgpu.set_max_registers(232, action="increase")
    if overlap:
      pl.when(wg == 1)(lambda: plgpu.barrier_arrive(turn.at[0]))
    run("compute")
    if overlap:
      pl.when(wg == 0)(lambda: plgpu.barrier_wait(turn.at[0]))

  @pl.when(wg == _COMPUTE_WGS)
  def _():
    plgpu.set_max_registers(40, action="decrease")
    steps = run("memory")

    @pl.loop(jnp.maximum(steps - slots, 0), steps)
    def _(g):
      slot = lax.rem(g, jnp.int32(slots))
      plgpu.barrier_wait(k_free.at[slot])
      plgpu.barrier_wait(v_free.at[slot])


def _step_ranges(packed, steps, lo, n1, second_start, q_start, rows, row0, block_kv,
                 unmasked_lo=None, unmasked_hi=None, listed=None):
  """The walk's steps as (first, end, masked) ranges, run in order. Unpacked: the steps whose
  tile may hold keys after the warpgroup's first row are masked, the last ones (the window
  always reaches the diagonal). Packed: in each of the walk's two pieces, the steps of tiles
  in [unmasked_lo, unmasked_hi) run unmasked, the others masked; where `listed` = (flag, the
  first piece's first tile), the flag (maybe traced) set, the program walks a kept-block list
  (`packed_xa_walk`): its first piece's unmasked steps are `listed_unmasked_steps`', and the
  second piece is masked whole."""
  if not packed:
    masked_from = steps - ((q_start + rows + block_kv - 1) // block_kv - row0 // block_kv)
    return [(0, masked_from, False), (masked_from, steps, True)]
  ranges = []
  for piece, (s_lo, s_hi, first_tile) in enumerate(((0, n1, lo), (n1, steps, second_start))):
    a = jnp.clip(unmasked_lo - first_tile + s_lo, s_lo, s_hi)
    z = jnp.clip(unmasked_hi - first_tile + s_lo, a, s_hi)
    if listed is not None:
      flag, first_listed = listed
      a_list, z_list = ((s_hi, s_hi) if piece else mosaic_gpu_backward.listed_unmasked_steps(
          unmasked_lo, unmasked_hi, first_listed, n1))
      a, z = jnp.where(flag, a_list, a), jnp.where(flag, z_list, z)
    ranges += [(s_lo, a, True), (a, z, False), (z, s_hi, True)]
  return ranges


def _call(q, k, v, modes, *, streaming: Streaming, tiles: MosaicTiles, scale, interpret,
          walks=None, row_bounds=None, xa: XAWalk | None = None, xa_lists=None,
          lse: bool = False):
  """The kernel over padded inputs. Packed rows: `walks`, the six fields of `packed_walk`,
  each int32 [B * K * nq] (one array per field: Pallas's GPU interpreter stalls when a kernel
  reads two scalars of one array), and `row_bounds` [B, K, 3, Tp] int32 (`_row_bounds`);
  `modes` is unused then. XAttention heads (unpacked rows): `xa` and `xa_lists`, the kept
  blocks below the diagonal as (index int32 [B * K * nb * nb], count int32 [B * K * nb]);
  packed rows with every row XA (`packed_xa_walk`): `xa` and xa_lists = (index,); packed rows
  of both patterns (`xa.mixed`): walks' seventh field flags the programs that walk a list,
  and xa_lists = (index, keep int32 [B * K * nb * nb]).
  lse (training): return (O, O - O rounded, lse): the output rounded to the inputs' dtype, the
  rounding's remainder in that dtype (their float32 sum carries ~16 bits, for the gate's
  gradient, `_training_outputs`), and each row's base-2 log-sum-exp of its scaled scores,
  float32 [B, N, Tp] (the backward's residual)."""
  b, tp, n, d = q.shape
  kh = k.shape[2]
  groups = n // kh
  if tiles.multicast and interpret:
    raise ValueError("MosaicTiles(multicast=True) runs natively only: Pallas's GPU interpreter "
                     "has no multicast copy between the programs of a cluster")
  rows = _rows_per_program(groups, tiles)
  heads_per_program = _COMPUTE_WGS if groups >= 2 else 1
  slots = tiles.slots
  dtype = q.dtype
  packed = walks is not None

  def entry(*refs):
    xa_refs = None
    if lse:
      *refs, out_ref, lo_ref, lse_ref = refs
    else:
      (*refs, out_ref), lo_ref, lse_ref = refs, None, None
    if packed:
      *plan_ref, q_ref, k_ref, v_ref, rows_ref = refs
      modes_ref = None
      if xa is not None:   # the lists' index (and, mixed, the dense keep array)
        split = len(plan_ref) - (2 if xa.mixed else 1)
        plan_ref, xa_refs = plan_ref[:split], tuple(plan_ref[split:])
    elif xa is not None:
      (modes_ref, *xa_refs, q_ref, k_ref, v_ref), plan_ref, rows_ref = refs, None, None
    else:
      (modes_ref, q_ref, k_ref, v_ref), plan_ref, rows_ref = refs, None, None
    item_bits = jnp.dtype(dtype).itemsize * 8
    transforms = (plgpu.TilingTransform((8, 1024 // item_bits)), plgpu.SwizzleTransform(128))
    def program(*scoped):
      kernel = functools.partial(_kernel, modes_ref, plan_ref, xa_refs, q_ref, k_ref, v_ref,
                                 rows_ref, (out_ref, lo_ref, lse_ref), scoped, groups=groups,
                                 num_kv_heads=kh, streaming=streaming, tiles=tiles,
                                 scale=scale, num_q_tiles=tp // rows, xa=xa)
      if not tiles.persistent:
        return kernel()
      return _persistent(
          lambda item, base, role: kernel(item=item, base=base, role=role), scoped,
          programs=tiles.persistent, num_heads=n // heads_per_program, batch=b,
          num_q_tiles=tp // rows, slots=slots, overlap=tiles.overlap)

    pl.run_scoped(
        program,
        (plgpu.SMEM((_COMPUTE_WGS, tiles.block_q, d), dtype, transforms=transforms),
         plgpu.SMEM((slots, tiles.block_kv, d), dtype, transforms=transforms),
         plgpu.SMEM((slots, tiles.block_kv, d), dtype, transforms=transforms),
         # P goes to the tensor cores from registers; interpret mode's wgmma reads only
         # shared memory, so there P takes a trip through it.
         plgpu.SMEM((_COMPUTE_WGS, tiles.block_q, tiles.block_kv), dtype,
                    transforms=transforms) if interpret else None,
         plgpu.SMEM((_COMPUTE_WGS, _ROW_FIELDS, tiles.block_q), jnp.int32) if packed else None,
         plgpu.SMEM((_COMPUTE_WGS, tiles.block_q), jnp.float32) if lse else None),
        (plgpu.Barrier(num_barriers=slots), plgpu.Barrier(num_barriers=slots),
         plgpu.Barrier(num_barriers=_COMPUTE_WGS),
         plgpu.Barrier(num_barriers=_COMPUTE_WGS * _ROW_FIELDS) if packed else None),
        # A slot's release: by both programs of a multicast cluster, whose rings it fills.
        (plgpu.ClusterBarrier(collective_axes=("pair",), num_arrivals=_COMPUTE_WGS,
                              num_barriers=slots) if tiles.multicast else
         plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=slots),) * 2,
        # The warpgroups' turns: one barrier both arrive at, or with `overlap` one each.
        plgpu.Barrier(num_barriers=_COMPUTE_WGS) if tiles.overlap else plgpu.Barrier(
            num_arrivals=_COMPUTE_WGS),
        collective_axes="wg",
    )

  kwargs = {"interpret": plgpu.InterpretGPUParams()} if interpret else {}
  operands = ((*walks, *(xa_lists if xa is not None else ()), q, k, v, row_bounds) if packed
              else (modes, *(xa_lists if xa is not None else ()), q, k, v))
  out_type = jax.ShapeDtypeStruct(q.shape, dtype)
  if lse:
    out_type = (out_type, out_type, jax.ShapeDtypeStruct((b, n, tp), jnp.float32))
  grid = dict(grid=(n // heads_per_program, tp // rows, b), grid_names=("hp", "qt", "b"))
  if tiles.multicast:   # clusters of two programs along the head pairs
    grid = dict(grid=(n // heads_per_program // 2, tp // rows, b), grid_names=("hp", "qt", "b"),
                cluster=(2, 1, 1), cluster_names=("pair", "pair_qt", "pair_b"))
  if tiles.persistent:
    grid = dict(grid=(tiles.persistent,), grid_names=("p",))
  trace = {}
  if tiles.trace and not interpret:   # room for every region of the longest walk; the events
    # collect in shared memory (4 bytes each, two entries an event), past which they are dropped
    trace = dict(profile_space=len(TRACE_REGIONS) * (-(-tp // tiles.block_kv) + 2),
                 profile_dir=tiles.trace, profile_bounds_check=True)
  return plgpu.kernel(
      entry,
      out_type=out_type,
      **grid,
      num_threads=_COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True, **trace),
      **kwargs,
  )(*operands)


@functools.partial(jax.jit, static_argnames=("streaming", "tiles", "interpret"))
def hybrid_forward_hard(q, k, v, gate_bk, streaming: Streaming, *,
                        tiles: MosaicTiles = DEFAULT_TILES, interpret: bool = False):
  """The kernel alone, for gates of 0 or 1 (a fractional gate counts as full): q [B, T, N, D],
  k/v [B, T, K, D], gate [B, K] -> [B, T, N, D]."""
  if not applies(q.shape, k.shape, q.dtype, streaming, tiles):
    raise ValueError(f"the Mosaic GPU kernel does not take q {q.shape} {q.dtype}, k {k.shape}, "
                     f"{streaming} with {tiles} (see mosaic_gpu.applies)")
  t = q.shape[1]
  q, k, v = (pad_to(x, 1, tiles.block_kv) for x in (q, k, v))
  modes = modes_from_gate(gate_bk.astype(jnp.float32)).reshape(-1)
  out = _call(q, k, v, modes, streaming=streaming, tiles=tiles, scale=q.shape[3] ** -0.5,
              interpret=interpret)
  return out[:, :t]


def hybrid_forward(q, k, v, gate_bk, streaming: Streaming, *,
                   tiles: MosaicTiles = DEFAULT_TILES, interpret: bool = False):
  """Inference forward: this kernel where every gate is 0 or 1, the Triton kernel otherwise
  (decided at run time: one compilation serves both). Shapes as `hybrid_forward_hard`."""
  hard = hard_gates(gate_bk)
  return lax.cond(
      hard,
      lambda: hybrid_forward_hard(q, k, v, gate_bk, streaming, tiles=tiles,
                                  interpret=interpret),
      lambda: pallas_gpu.hybrid_forward(q, k, v, gate_bk, streaming, interpret=interpret))


def xa_applies(q_shape, k_shape, dtype, streaming: Streaming, xa_block: int,
               tiles: MosaicTiles = DEFAULT_TILES) -> bool:
  """Whether this kernel takes XAttention heads of `xa_block`-token blocks for these shapes:
  `applies`, and blocks made of whole KV tiles and whole programs' rows."""
  return (applies(q_shape, k_shape, dtype, streaming, tiles)
          and _xa_tiles_fit(q_shape[2] // k_shape[2], xa_block, tiles))


def _xa_tiles_fit(groups: int, xa_block: int, tiles: MosaicTiles) -> bool:
  return xa_block % tiles.block_kv == 0 and xa_block % _rows_per_program(groups, tiles) == 0


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
                        xa_block: int, tiles: MosaicTiles):
  """`_checked_xa_call` for this file's XA forwards (the shapes: `xa_applies`)."""
  return _checked_xa_call(
      name, q.shape, k.shape, xa_keep.shape, patterns, xa_block,
      xa_applies(q.shape, k.shape, q.dtype, streaming, xa_block, tiles),
      f"the Mosaic GPU kernel does not take XAttention blocks of {xa_block} with q {q.shape} "
      f"{q.dtype}, k {k.shape}, {streaming}, {tiles} (see mosaic_gpu.xa_applies)")


@functools.partial(jax.jit, static_argnames=("streaming", "patterns", "xa_block", "tiles",
                                             "interpret"))
def xa_forward_hard(q, k, v, gate_bk, xa_keep, streaming: Streaming, *, patterns: str,
                    xa_block: int, tiles: MosaicTiles = DEFAULT_TILES, interpret: bool = False):
  """The kernel alone under the XAttention settings ("fa-xa", "xa-ssa"), for gates of 0 or 1
  (a fractional gate takes the gate-1 pattern's walk; `make_xa_hybrid` sends fractional gates
  to the Triton kernel): the heads of XA's mode walk their kept blocks (xa_keep [B, K, nb, nb]
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
  out = _call(q, k, v, modes, streaming=streaming, tiles=tiles, scale=q.shape[3] ** -0.5,
              interpret=interpret, xa=xa,
              xa_lists=(index.reshape(-1), (count - 1).reshape(-1)))
  return out[:, :t]


def make_xa_hybrid(tiles: MosaicTiles = DEFAULT_TILES, training: str = "auto",
                   backward_tiles: BackwardTiles = DEFAULT_BACKWARD_TILES):
  """`pallas_gpu.make_xa_hybrid` with this kernel as the undifferentiated forward where gates
  are 0 or 1 (decided at run time) and it `xa_applies`. training (`TRAINING`): the Mosaic
  kernels are `xa_forward_train` and `xa_backward`, where `xa_trains`; the Triton training
  kernels elsewhere."""
  _check_training(training)
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
              q_shape, k_shape, dtype, streaming, xa_block, tiles, backward_tiles)),
      lambda q, k, v, gate_bk, xa_keep, streaming, patterns, xa_block, interpret: (
          xa_forward_train(q, k, v, gate_bk, xa_keep, streaming, patterns=patterns,
                           xa_block=xa_block, tiles=tiles, backward_tiles=backward_tiles,
                           interpret=interpret)),
      lambda streaming, patterns, xa_block, interpret, res, d_out: (*xa_backward(
          res, d_out, streaming, patterns=patterns, xa_block=xa_block,
          backward_tiles=backward_tiles, interpret=interpret), None),
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
  (O rounded, remainder) pair of `_call(..., lse=True)`: (r O_FA + (1 - r) O_SSA, O_FA rounded,
  O_FA - O_SSA), the first and the last formed in float32 from the pairs' sums before their one
  rounding to `dtype`; the first T rows (r broadcasts against [B, T, N, D]). The difference
  carries the gate's gradient; rounding O_FA and O_SSA first would lose it where XA's kept
  blocks make the two nearly equal (`common.row_deltas`)."""
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


def trains(q_shape, k_shape, dtype, streaming: Streaming, tiles: MosaicTiles = DEFAULT_TILES,
           backward_tiles: BackwardTiles = DEFAULT_BACKWARD_TILES) -> bool:
  """Whether the Mosaic GPU training kernels take a call of these shapes: the forward's layout
  (`applies`) and the backward's (`mosaic_gpu_backward.applies`)."""
  groups = q_shape[2] // k_shape[2]
  return (applies(q_shape, k_shape, dtype, streaming, tiles)
          and mosaic_gpu_backward.applies(groups, streaming, backward_tiles, q_shape[3]))


def forward_train(q, k, v, gate_bk, streaming: Streaming, *, tiles: MosaicTiles = DEFAULT_TILES,
                  backward_tiles: BackwardTiles = DEFAULT_BACKWARD_TILES,
                  interpret: bool = False):
  """The training forward on this kernel: O = r O_FA + (1 - r) O_SSA for any gates, and the
  residuals of `backward`. O_FA and O_SSA of every head (the gate's gradient needs both) are
  two launches with every head full, then every head streaming; the second visits only the
  sink and window tiles, so the pair costs one full pass and a small one, as the one-walk
  Triton training forward does. Shapes as `hybrid_forward_hard`."""
  return _forward_train(q, k, v, gate_bk, streaming, tiles, backward_tiles, interpret)


def _training_length(t: int, groups: int, tiles: MosaicTiles, backward_tiles: BackwardTiles,
                     xa_block: int = 1):
  """T padded to whole programs of the forward and of both backward kernels (and to whole XA
  blocks: the dK/dV kernel walks a listed query block's every tile)."""
  tp = mosaic_gpu_backward.padded_length(t, groups, backward_tiles)
  return tp + -tp % math.lcm(_rows_per_program(groups, tiles), tiles.block_kv, xa_block)


def _forward_train(q, k, v, gate_bk, streaming, tiles, backward_tiles, interpret, xa=None):
  """`forward_train`; under the XAttention settings xa = (`XATerms`, `common.xa_operands`'s
  lists; its blocks span the padded length), and a launch whose pattern is "xa" walks every
  head's kept blocks."""
  b, t, n, d = q.shape
  kh = k.shape[2]
  tp = (xa[0].num_blocks * xa[0].block if xa
        else _training_length(t, n // kh, tiles, backward_tiles))
  qp, kp, vp = (pad_to(x, 1, tp) for x in (q, k, v))

  def run(term, mode, q, k, v):
    walk = lists = None
    if xa is not None and xa[0].pair[term] == "xa":
      index, count, _ = xa[1]
      walk = XAWalk(mode=mode, block=xa[0].block, num_blocks=xa[0].num_blocks)
      lists = (index.reshape(-1), (count - 1).reshape(-1))
    return _call(q, k, v, jnp.full((b * kh,), mode, jnp.int32), streaming=streaming,
                 tiles=tiles, scale=d ** -0.5, interpret=interpret, xa=walk, xa_lists=lists,
                 lse=True)

  fa = run(0, MODE_FULL, qp, kp, vp)
  sa = run(1, MODE_SPARSE, *_after(fa[0], (qp, kp, vp)))
  r = jnp.repeat(gate_bk.astype(jnp.float32), n // kh, axis=1)[:, None, :, None]
  o, o_fa, o_gap = _training_outputs(fa, sa, r, t, q.dtype)
  return o, (qp, kp, vp, gate_bk, o_fa, o_gap, fa[2], sa[2])


def backward(residuals, d_out, streaming: Streaming, *,
             backward_tiles: BackwardTiles = DEFAULT_BACKWARD_TILES, interpret: bool = False):
  """(dq, dk, dv, d_gate) from `forward_train`'s residuals: the Mosaic GPU dQ and dK/dV
  kernels (`mosaic_gpu_backward`); the gate's gradient is rowsum(dO * (O_FA - O_SSA)) summed
  per (batch, KV head) (`common.row_deltas`)."""
  return _backward(residuals, d_out, streaming, backward_tiles, interpret)


def _backward(residuals, d_out, streaming, backward_tiles, interpret, dq_xa=None, dkv_xa=None):
  """`backward`; under the XAttention settings dq_xa and dkv_xa are the kernels' `xa`."""
  qp, kp, vp, gate_bk, o_fa, o_gap, lse_fa, lse_sa = residuals
  t, tp = d_out.shape[1], qp.shape[1]
  d_fa, d_sa, d_gate = row_deltas(d_out, o_fa, o_gap, gate_bk)
  terms = _row_terms(tp, lse_fa, lse_sa, d_fa, d_sa)
  do = pad_to(d_out.astype(qp.dtype), 1, tp)
  gate = gate_bk.astype(jnp.float32).reshape(-1)
  kw = dict(streaming=streaming, tiles=backward_tiles, interpret=interpret)
  operands = (qp, kp, vp, do, terms, modes_from_gate(gate), gate)
  dq = mosaic_gpu_backward.dq_call(*operands, xa=dq_xa, **kw)
  dk, dv = mosaic_gpu_backward.dkv_call(*_after(dq, operands), xa=dkv_xa, **kw)
  return dq[:, :t], dk[:, :t], dv[:, :t], d_gate


def xa_trains(q_shape, k_shape, dtype, streaming: Streaming, xa_block: int,
              tiles: MosaicTiles = DEFAULT_TILES,
              backward_tiles: BackwardTiles = DEFAULT_BACKWARD_TILES) -> bool:
  """Whether the Mosaic GPU training kernels take the XAttention settings with blocks of
  `xa_block` tokens: `trains` and `_xa_blocks_fit`."""
  return (trains(q_shape, k_shape, dtype, streaming, tiles, backward_tiles)
          and _xa_blocks_fit(q_shape, k_shape, xa_block, tiles, backward_tiles))


def _xa_blocks_fit(q_shape, k_shape, xa_block: int, tiles: MosaicTiles,
                   backward_tiles: BackwardTiles) -> bool:
  """XAttention blocks made of whole KV tiles and whole programs of the forward
  (`_xa_tiles_fit`) and of both backward kernels."""
  groups = q_shape[2] // k_shape[2]
  return (_xa_tiles_fit(groups, xa_block, tiles)
          and all(xa_block % x == 0
                  for x in mosaic_gpu_backward.program_sizes(groups, backward_tiles)))


def xa_forward_train(q, k, v, gate_bk, xa_keep, streaming: Streaming, *, patterns: str,
                     xa_block: int, tiles: MosaicTiles = DEFAULT_TILES,
                     backward_tiles: BackwardTiles = DEFAULT_BACKWARD_TILES,
                     interpret: bool = False):
  """`forward_train` under the XAttention settings ("fa-xa", "xa-ssa"; kept blocks xa_keep
  [B, K, nb, nb] as `xa_forward_hard`): the launch of XA's term walks every head's kept
  blocks. Residuals: `forward_train`'s and the kept-block lists (`common.xa_operands`)."""
  pair, _ = _checked_xa_call(
      "xa_forward_train", q.shape, k.shape, xa_keep.shape, patterns, xa_block,
      xa_trains(q.shape, k.shape, q.dtype, streaming, xa_block, tiles, backward_tiles),
      f"the Mosaic GPU training kernels do not take XAttention blocks of {xa_block} with q "
      f"{q.shape} {q.dtype}, k {k.shape}, {streaming} (see mosaic_gpu.xa_trains)")
  b, t, n, _ = q.shape
  kh = k.shape[2]
  num_blocks = _training_length(t, n // kh, tiles, backward_tiles, xa_block) // xa_block
  lists = xa_operands(xa_keep, num_blocks, b * kh)
  out, res = _forward_train(q, k, v, gate_bk, streaming, tiles, backward_tiles, interpret,
                            xa=(XATerms(pair, xa_block, num_blocks), lists))
  return out, (*res, *lists)


def xa_backward(residuals, d_out, streaming: Streaming, *, patterns: str, xa_block: int,
                backward_tiles: BackwardTiles = DEFAULT_BACKWARD_TILES,
                interpret: bool = False):
  """(dq, dk, dv, d_gate) from `xa_forward_train`'s residuals: `backward` with the XA term
  walking the kept blocks (the dQ kernel a query block's row of the lists, the dK/dV kernel
  a key block's column, `mosaic_gpu_backward.xa_column_lists`)."""
  *residuals, index, count, keep = residuals
  terms = XATerms(split_patterns(patterns), xa_block, keep.shape[-1])
  columns = mosaic_gpu_backward.xa_column_lists(keep)
  return _backward(residuals, d_out, streaming, backward_tiles, interpret,
                   dq_xa=(terms, (index, count, keep)), dkv_xa=(terms, (*columns, keep)))


def make_hybrid(tiles: MosaicTiles = DEFAULT_TILES, training: str = "auto",
                backward_tiles: BackwardTiles = DEFAULT_BACKWARD_TILES):
  """`pallas_gpu.make_hybrid` with this kernel as the undifferentiated forward where it
  `applies`. training (`TRAINING`): the Mosaic kernels are `forward_train` and `backward`,
  where `trains`; the Triton training kernels elsewhere."""
  _check_training(training)
  triton_forward, triton_train, triton_backward = pallas_gpu.hybrid_parts()

  def forward(q, k, v, gate_bk, streaming, interpret):
    if applies(q.shape, k.shape, q.dtype, streaming, tiles):
      return hybrid_forward(q, k, v, gate_bk, streaming, tiles=tiles, interpret=interpret)
    return triton_forward(q, k, v, gate_bk, streaming, interpret)

  train, grads = _training(
      lambda q_shape, k_shape, dtype, streaming, interpret: _mosaic_training(
          training, interpret) and trains(q_shape, k_shape, dtype, streaming, tiles,
                                          backward_tiles),
      lambda q, k, v, gate_bk, streaming, interpret: forward_train(
          q, k, v, gate_bk, streaming, tiles=tiles, backward_tiles=backward_tiles,
          interpret=interpret),
      lambda streaming, interpret, res, d_out: backward(
          res, d_out, streaming, backward_tiles=backward_tiles, interpret=interpret),
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
  (`_NO_WINDOW`, which marks them: a real window never starts past its row); the kernel shows
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
    fields[1:] = jnp.where(xa, start[:, None], fields[1]), jnp.where(xa, _NO_WINDOW, fields[2])
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
  q_plan = jnp.broadcast_to(plan["q_plan"][:, None], plan["q_modes"].shape + (_PLAN_WIDTH,))
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
  listed piece alone: the kernel turns it into steps (`_step_ranges`' `listed`,
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
                        tiles: MosaicTiles = DEFAULT_TILES, interpret: bool = False):
  """The kernel alone on packed rows (`packed_rows_apply` must hold): q [B, T, N, D], k/v
  [B, T, K, D], gate [B, T, K] of 0 or 1, segment ids and positions [B, T] int.

  The operands are prepared in one jitted function and the kernel launched apart: Pallas's
  GPU interpreter can stall when the kernel shares one CPU computation with other work, so
  interpret-mode callers (tests) call this outside `jax.jit`."""
  if not applies(q.shape, k.shape, q.dtype, streaming, tiles):
    raise ValueError(f"the Mosaic GPU kernel does not take q {q.shape} {q.dtype}, k {k.shape}, "
                     f"{streaming} with {tiles} (see mosaic_gpu.applies)")
  rows = _rows_per_program(q.shape[2] // k.shape[2], tiles)
  (qp, kp, vp), walks, bounds = _packed_operands(q, k, v, gate_btk, segment_ids, positions,
                                                 streaming, rows, tiles.block_kv)
  out = _call(qp, kp, vp, None, streaming=streaming, tiles=tiles, scale=q.shape[3] ** -0.5,
              interpret=interpret, walks=walks, row_bounds=bounds)
  return out[:, :q.shape[1]]


def packed_xa_forward_hard(q, k, v, gate_btk, segment_ids, positions, xa_keep,
                           streaming: Streaming, *, patterns: str, xa_block: int,
                           tiles: MosaicTiles = DEFAULT_TILES, interpret: bool = False):
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
  rows = _rows_per_program(q.shape[2] // kh, tiles)
  tp = t + (-t % math.lcm(rows, tiles.block_kv))
  lists = xa_operands(xa_keep, -(-tp // xa_block), b * kh)
  xa_gate = 1.0 if hi == "xa" else 0.0
  (qp, kp, vp), walks, bounds = _packed_operands(q, k, v, gate_btk, segment_ids, positions,
                                                 streaming, rows, tiles.block_kv, lists,
                                                 xa_block, xa_gate)
  xa = XAWalk(MODE_FULL if hi == "xa" else MODE_SPARSE, xa_block, lists[0].shape[-1],
              mixed=True)
  out = _call(qp, kp, vp, None, streaming=streaming, tiles=tiles, scale=q.shape[3] ** -0.5,
              interpret=interpret, walks=walks, row_bounds=bounds, xa=xa,
              xa_lists=(lists[0].reshape(-1), lists[2].reshape(-1)))
  return out[:, :t]


def _packed_trains(q_shape, k_shape, dtype, streaming, tiles, backward_tiles) -> bool:
  """Whether the Mosaic GPU training kernels take packed rows of these shapes: `trains`, and
  rows long enough that both training paths pad them alike (the residuals of either path then
  have one layout, so the choice can be made at run time)."""
  t, groups = q_shape[1], q_shape[2] // k_shape[2]
  triton_tp = -(-t // 128) * 128          # the Triton training kernels' padding, for t > 64
  forward_tp = t + (-t % math.lcm(_rows_per_program(groups, tiles), tiles.block_kv))
  return (trains(q_shape, k_shape, dtype, streaming, tiles, backward_tiles) and t > 64
          and forward_tp == triton_tp
          and mosaic_gpu_backward.padded_length(t, groups, backward_tiles) == triton_tp)


def packed_forward_train(q, k, v, gate_btk, segment_ids, positions, streaming: Streaming, *,
                         tiles: MosaicTiles = DEFAULT_TILES, interpret: bool = False):
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
  rows = _rows_per_program(n // kh, tiles)
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
    outs.append(_call(qp, kp, vp, None, streaming=streaming, tiles=tiles, scale=d ** -0.5,
                      interpret=interpret, walks=walks, row_bounds=bounds, lse=True, xa=walk,
                      xa_lists=(lists[0].reshape(-1),) if xa else None))
  r = jnp.repeat(gate_btk.astype(jnp.float32), n // kh, axis=2)[..., None]      # [B, T, N, 1]
  o, o_fa, o_gap = _training_outputs(*outs, r, t, q.dtype)
  seg, pos = pad_packed(segment_ids, positions, tp)
  gate = pad_to(gate_btk.astype(jnp.float32), 1, tp).transpose(0, 2, 1)        # [B, K, Tp]
  return o, (qp, kp, vp, seg, pos, gate, None if lists is None else lists[2], gate_btk, o_fa,
             o_gap, outs[0][2], outs[1][2], segment_ids, positions, xa_keep)


def packed_xa_list_spans(keep, q_plan, k_plan, xa_block: int, backward_tiles: BackwardTiles,
                         groups: int):
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
  dq_rows, dq_block_kv, keys, block_q = mosaic_gpu_backward.program_sizes(groups,
                                                                         backward_tiles)
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


def packed_backward(residuals, d_out, streaming: Streaming, *,
                    backward_tiles: BackwardTiles = DEFAULT_BACKWARD_TILES,
                    interpret: bool = False):
  """(dq, dk, dv, d_gate, 0, 0) of packed rows from `packed_forward_train`'s residuals (the
  gate's gradient per row; float0 zeros for the segment ids and positions): the Mosaic GPU
  dQ and dK/dV kernels walking `common.packed_plan`'s schedules, masks from per-row bounds."""
  return _packed_backward(residuals, d_out, streaming, backward_tiles, interpret)


def _packed_backward(residuals, d_out, streaming, backward_tiles, interpret, pair=None,
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
  bt = backward_tiles
  flat = lambda x: x.reshape(-1).astype(jnp.int32)
  dq_rows, dq_block_kv, keys, block_q = mosaic_gpu_backward.program_sizes(groups, bt)
  q_sched = packed_plan(seg, pos, gate_rows, streaming, dq_rows, dq_block_kv)
  q_plan = jnp.broadcast_to(q_sched["q_plan"][:, None], q_sched["q_modes"].shape + (8,))
  k_sched = packed_plan(seg, pos, gate_rows, streaming, block_q, keys)
  dq_xa = dkv_xa = None
  if pair is not None:
    terms_xa = XATerms(pair, xa_block, keep.shape[-1])
    index, count = block_lists(keep != 0)
    first, later = packed_xa_list_spans(keep, q_plan, k_sched["k_plan"], xa_block, bt,
                                        groups)
    dq_xa = (terms_xa, (index, count, keep, first))
    dkv_xa = (terms_xa, (mosaic_gpu_backward.xa_column_lists(keep)[0], later, keep))
  kw = dict(streaming=streaming, tiles=bt, interpret=interpret, bounds=bounds)
  dq = mosaic_gpu_backward.dq_call(qp, kp, vp, do, terms, flat(q_sched["q_modes"]), None,
                                   plan=[flat(q_plan[..., x]) for x in range(7)], xa=dq_xa,
                                   **kw)
  qp, kp, vp, do, terms = _after(dq, (qp, kp, vp, do, terms))
  dk, dv = mosaic_gpu_backward.dkv_call(
      qp, kp, vp, do, terms, flat(k_sched["k_modes"]), None,
      plan=[flat(k_sched["k_plan"][..., x]) for x in range(3)], xa=dkv_xa, **kw)
  zero_int = lambda x: np.zeros(x.shape, jax.dtypes.float0)
  return (dq[:, :t], dk[:, :t], dv[:, :t], d_gate, zero_int(segment_ids), zero_int(positions))


def make_packed_hybrid(tiles: MosaicTiles = DEFAULT_TILES, training: str = "auto",
                       backward_tiles: BackwardTiles = DEFAULT_BACKWARD_TILES):
  """`pallas_gpu.make_packed_hybrid` with this kernel as the undifferentiated forward where it
  `applies` and, at run time, `packed_rows_apply`. training (`TRAINING`): the Mosaic kernels
  are `packed_forward_train` and `packed_backward`, where `_packed_trains` and, at run time,
  `positions_count_up` (the Triton kernels otherwise; both leave residuals of one layout)."""
  _check_training(training)
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
          _packed_trains(q_shape, k_shape, dtype, streaming, tiles, backward_tiles)),
      lambda q, k, v, gate_btk, seg, pos, streaming, interpret: packed_forward_train(
          q, k, v, gate_btk, seg, pos, streaming, tiles=tiles, interpret=interpret),
      lambda streaming, interpret, res, d_out: packed_backward(
          res, d_out, streaming, backward_tiles=backward_tiles, interpret=interpret),
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


def packed_xa_forward_train(q, k, v, gate_btk, segment_ids, positions, xa_keep,
                            streaming: Streaming, *, patterns: str, xa_block: int,
                            tiles: MosaicTiles = DEFAULT_TILES,
                            backward_tiles: BackwardTiles = DEFAULT_BACKWARD_TILES,
                            interpret: bool = False):
  """`packed_forward_train` under the XAttention settings ("fa-xa", "xa-ssa"; xa_keep [B, K,
  nb, nb] the kept blocks of `xa_block` tokens, `xattention.select` with the segment ids):
  the launch of XA's term walks every row's kept blocks from its segment's on
  (`packed_xa_walk`). Residuals in the layout of the Triton packed XA kernels'."""
  pair, _ = _checked_xa_call(
      "packed_xa_forward_train", q.shape, k.shape, xa_keep.shape, patterns, xa_block,
      _packed_xa_trains(q.shape, k.shape, q.dtype, streaming, xa_block, tiles, backward_tiles),
      f"the Mosaic GPU training kernels do not take packed rows with XAttention blocks of "
      f"{xa_block}, q {q.shape} {q.dtype}, k {k.shape}, {streaming} (see "
      f"mosaic_gpu._packed_xa_trains)")
  return _packed_forward_train(q, k, v, gate_btk, segment_ids, positions, streaming, tiles,
                               interpret, xa_keep, pair, xa_block)


def packed_xa_backward(residuals, d_out, streaming: Streaming, *, patterns: str, xa_block: int,
                       backward_tiles: BackwardTiles = DEFAULT_BACKWARD_TILES,
                       interpret: bool = False):
  """(dq, dk, dv, d_gate, 0, 0, 0) from `packed_xa_forward_train`'s residuals (or the Triton
  packed XA kernels'): `packed_backward` with the XA term walking the kept-block lists."""
  grads = _packed_backward(residuals, d_out, streaming, backward_tiles, interpret,
                           split_patterns(patterns), xa_block)
  return (*grads, np.zeros(residuals[-1].shape, jax.dtypes.float0))


def _packed_xa_trains(q_shape, k_shape, dtype, streaming, xa_block, tiles, backward_tiles):
  """`_packed_trains` under the XAttention settings: also `xa_trains`, and a padded length
  (both paths': T rounded up to 128) of whole XA blocks, since the dK/dV kernel walks a listed
  query block's every tile (packed rows cannot pad further: the Triton path's residuals fix
  the layout); other lengths take the Triton kernels."""
  return (_packed_trains(q_shape, k_shape, dtype, streaming, tiles, backward_tiles)
          and _xa_blocks_fit(q_shape, k_shape, xa_block, tiles, backward_tiles)
          and -(-q_shape[1] // 128) * 128 % xa_block == 0)


def make_packed_xa_hybrid(tiles: MosaicTiles = DEFAULT_TILES, training: str = "auto",
                          backward_tiles: BackwardTiles = DEFAULT_BACKWARD_TILES):
  """`pallas_gpu.make_packed_xa_hybrid` (packed rows under the XAttention settings) with this
  kernel as the undifferentiated forward where it `xa_applies` and, at run time,
  `packed_rows_apply` (`packed_xa_forward_hard`; the Triton kernel otherwise). training
  (`TRAINING`): the Mosaic kernels are `packed_xa_forward_train` and `packed_xa_backward`,
  where `_packed_xa_trains` and, at run time, `positions_count_up` (the Triton kernels
  otherwise; both leave residuals of one layout)."""
  _check_training(training)
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
              q_shape, k_shape, dtype, streaming, xa_block, tiles, backward_tiles)),
      lambda q, k, v, gate_btk, seg, pos, xa_keep, streaming, patterns, xa_block, interpret: (
          packed_xa_forward_train(q, k, v, gate_btk, seg, pos, xa_keep, streaming,
                                  patterns=patterns, xa_block=xa_block, tiles=tiles,
                                  backward_tiles=backward_tiles, interpret=interpret)),
      lambda streaming, patterns, xa_block, interpret, res, d_out: packed_xa_backward(
          res, d_out, streaming, patterns=patterns, xa_block=xa_block,
          backward_tiles=backward_tiles, interpret=interpret),
      triton_train, triton_backward, num_static=4, packed=True)
  return with_fused_backward(forward, train, grads, num_arrays=7, num_static=4)


hybrid_attention = functools.partial(kernel_or_reference, make_hybrid(),
                                     xa_kernel=make_xa_hybrid(),
                                     xa_kernel_applies=pallas_gpu.xa_kernel_applies,
                                     packed_kernel=make_packed_hybrid(),
                                     packed_xa_kernel=make_packed_xa_hybrid())
