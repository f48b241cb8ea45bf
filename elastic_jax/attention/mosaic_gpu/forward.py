"""The hybrid FA/SSA inference forward for Hopper GPUs in Pallas Mosaic GPU (wgmma, TMA).

Warp-specialised, FlashAttention-3 style: per program, one memory warpgroup streams K/V tiles
into a ring of shared-memory slots with the bulk copy engine (TMA; `_producer`), and two
compute warpgroups run QK^T and PV on the tensor cores (wgmma) with an online softmax in
registers (`_consumer`: one schedule per `Tiles`, `_plain`, `_chained` or
`_overlapped`, each step's softmax `online_softmax`, then `_epilogue`), taking turns on the
tensor cores (a schedule barrier) so that one's softmax overlaps the other's matrix products.
`Tiles(overlap=True, chain=False)` adds FlashAttention-3's second technique,
each warpgroup's softmax overlapping its own PV product (tile s's QK^T and tile s-1's PV
issued together, `_overlapped`); `Tiles(persistent=P, chain=False)` launches P
persistent programs that take the work items in turn, heaviest first, the K/V ring running
on from one item to the next (`_persistent`). Both are checked against the reference in
interpret mode (where wgmma runs synchronously) and natively. `Tiles(multicast=True)`
launches the two programs of one KV head and query tile as a cluster that shares each K/V tile
(TMA multicast); Pallas's GPU interpreter has no multicast copy, so it is checked natively
only (against the reference in the tests; on an H100 its outputs were also bit-equal to the
default schedule's, plain, packed and XA rows). The overlap rescales the accumulator and casts
P to bf16 after the PV product's wait, as FlashAttention-3 does (with a product in flight,
ptxas serialises every wgmma: warning C7513).
`Tiles(q_registers=True)` feeds QK^T its Q tile from registers (loaded once per work
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
read at run time. Training runs `hybrid.py`'s `forward_train` (the kernel launched twice with
every head full, then streaming, also writing each row's log-sum-exp) and the Mosaic GPU dQ
and dK/dV kernels (`backward.py`) where they take the shapes (`trains`), the Triton
kernels (`pallas_gpu`) elsewhere and, by default, in interpret mode (`TRAINING`); likewise
under the XAttention settings (`xa_forward_train`, `xa_backward`). Its layout constraints
(`applies`): bf16 or fp16, head_dim a multiple of 64 whose tiles fit in shared memory (up to
128 with the default tiles), the streaming block a multiple of the KV tile (128) so the
window's edges fall on tile edges, and G even or 1. T is padded inside. Interpret mode
(`interpret=True`) runs it on a CPU.

Packed rows (segment ids and positions, `hybrid.py`'s `packed_forward_hard`): the walk
starts at the tile of the segment start of the program's first row (`common.packed_plan`),
and masked tiles compare each key with three per-row bounds; see the section there. Under the
XAttention settings (`packed_xa_forward_hard`) the programs of XA rows walk their kept-block
lists in the same launch. Their
training (`packed_forward_train`, `packed_backward`; under the XAttention settings
`packed_xa_forward_train`, `packed_xa_backward`) is chosen as the unpacked one's.

Shape letters: B batch, T tokens, N query heads, K KV heads, G = N / K, H head dim.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from elastic_jax.attention.common import MODE_FULL, MODE_SPARSE
from elastic_jax.attention.mosaic_gpu import backward as mosaic_gpu_backward
from elastic_jax.attention.mosaic_gpu.tiles import (  # noqa: F401  (MosaicTiles: deprecated)
    DEFAULT_TILES, MosaicTiles, Tiles)
from elastic_jax.attention.reference import MASK_VALUE, Streaming

try:  # the Mosaic GPU dialect ships with jaxlib; keep the package importable without it
  from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover
  plgpu = None

_LOG2E = math.log2(math.e)
_COMPUTE_WGS = 2
PLAN_WIDTH = 8     # entries per query tile of common.packed_plan's q_plan
_ROW_FIELDS = 3     # per packed row: segment start, end of the sink, start of the window
SMEM_BYTES = 227 * 1024   # shared memory a Hopper thread block may use
NO_WINDOW = np.iinfo(np.int32).max   # an XA row's window start (`_row_bounds`): beyond any row


# The regions a traced kernel (`Tiles.trace`) records per KV tile, in order, in the
# schedule with neither overlap nor chain: issuing QK^T, the warpgroups' turn before its
# result is read, waiting for the result, the softmax (with the accumulator's rescale and P's
# cast), the turn and the V tile before PV, then issuing PV, the next K tile's arrival and
# PV's end.
TRACE_REGIONS = ("qk_issue", "qk_turn", "qk_wait", "softmax", "pv_turn", "pv")


# The builders' training kernels: "auto" (the Mosaic GPU ones natively where they take the
# shapes, the Triton ones in interpret mode and elsewhere), "mosaic" (also in interpret
# mode), "triton".
TRAINING = ("auto", "mosaic", "triton")


def applies(q_shape, k_shape, dtype, streaming: Streaming,
            tiles: Tiles = DEFAULT_TILES) -> bool:
  """Whether this kernel takes a call of these shapes (else the Triton kernel does)."""
  if plgpu is None:
    return False
  n, d = q_shape[2], q_shape[3]
  kh = k_shape[2]
  groups = n // kh
  rows = rows_per_program(groups, tiles)
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


def rows_per_program(groups: int, tiles: Tiles) -> int:
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


@dataclasses.dataclass(frozen=True)
class _Launch:
  """A launch's static settings (`forward_call`'s): G, the KV heads, the streaming pattern, the
  tiles, the softmax scale, the query tiles per head, the XAttention walk (None: none) and
  whether the rows are packed."""
  groups: int
  num_kv_heads: int
  streaming: Streaming
  tiles: Tiles
  scale: float
  num_q_tiles: int
  xa: XAWalk | None
  packed: bool

  @property
  def pair_heads(self) -> bool:
    """Whether the two compute warpgroups take two query heads (G >= 2) or two row tiles."""
    return self.groups >= 2

  @property
  def rows(self) -> int:
    return rows_per_program(self.groups, self.tiles)

  @property
  def heads_per_program(self) -> int:
    return _COMPUTE_WGS if self.pair_heads else 1


@dataclasses.dataclass(frozen=True)
class _Refs:
  """A program's refs: its operands and outputs in device memory (modes, the packed walks'
  fields `plan`, the XAttention lists `xa`, q, k, v, the packed rows' bounds `rows`; out, the
  rounding remainder `lo`, the log-sum-exps `lse`), its shared memory (the compute
  warpgroups' Q/O tiles, the K and V rings, P's staging buffer in interpret mode, the rows'
  bounds, the log-sum-exps) and its barriers (a ring slot's arrival and release, each
  warpgroup's Q tile and bounds, the warpgroups' turns). None where the launch has none."""
  modes: Any
  plan: Any
  xa: Any
  q: Any
  k: Any
  v: Any
  rows: Any
  out: Any
  lo: Any
  lse: Any
  qo_smem2: Any
  k_smem: Any
  v_smem: Any
  p_smem2: Any
  rows_smem2: Any
  lse_smem2: Any
  k_ready: Any
  v_ready: Any
  q_ready: Any
  rows_ready: Any
  k_free: Any
  v_free: Any
  turn: Any

  @classmethod
  def of(cls, modes_ref, plan_ref, xa_refs, q_ref, k_ref, v_ref, rows_ref, out_refs,
         scoped) -> "_Refs":
    """From `_kernel`'s arguments (`forward_call`'s scratch: buffers, ready, free, turn)."""
    smem, (k_ready, v_ready, q_ready, rows_ready), (k_free, v_free), turn = scoped
    return cls(modes_ref, plan_ref, xa_refs, q_ref, k_ref, v_ref, rows_ref, *out_refs, *smem,
               k_ready, v_ready, q_ready, rows_ready, k_free, v_free, turn)


@dataclasses.dataclass(frozen=True)
class _Walk:
  """Where a program stands and the KV tiles it walks: batch row b, head pair hp, this
  thread's warpgroup wg, the KV head, the first query row; `steps` steps, step s reading tile
  tile_of(s) into ring slot ring(s) (base: the ring steps of a persistent program's earlier
  items, None otherwise); lo, n1, second_start as `walk`'s or `packed_walk`'s. Packed rows
  also: the unmasked tiles [unmasked_lo, unmasked_hi) and, under the XAttention settings,
  whether the program walks a kept-block list (walks_list, maybe traced), listed(step) the
  tile of a listed step and list_at the program's list row."""
  b: Any
  hp: Any
  wg: Any
  kv_head: Any
  q_start: Any
  steps: Any
  lo: Any
  n1: Any
  second_start: Any
  tile_of: Callable
  ring: Callable
  base: Any = None
  unmasked_lo: Any = None
  unmasked_hi: Any = None
  walks_list: Any = None
  listed: Callable | None = None
  list_at: Any = None


def _program_walk(launch: _Launch, refs: _Refs, item, base) -> _Walk:
  """The program's place (from the grid, or a persistent program's `item`) and its walk:
  unpacked rows `walk`'s list (an XA head `xa_walk`'s, its kept-block list read from
  refs.xa), packed rows their precomputed `packed_walk` (`_packed_program_walk`)."""
  tiles = launch.tiles
  if item is None:
    b = lax.axis_index("b")
    hp = lax.axis_index("hp")
    if tiles.multicast:   # a cluster: the two head pairs of one KV head
      hp = hp * 2 + lax.axis_index("pair")
    # Heavy first: programs launch in grid order, and the last query tiles have the most
    # causal tiles to visit, so they start first and the short ones fill the tail. Light first
    # measured slower on full heads (benchmarks/records/attention.md), though the Triton
    # kernels want light first.
    qt = launch.num_q_tiles - 1 - lax.axis_index("qt")
  else:
    b, hp, qt = item
  wg = lax.axis_index("wg")
  # A step's slot in the K/V ring (which runs on across a persistent program's items).
  ring = lambda s: lax.rem(s if base is None else base + s, jnp.int32(tiles.slots))
  kv_head = lax.div(hp * launch.heads_per_program, jnp.int32(launch.groups))
  q_start = qt * launch.rows
  place = dict(b=b, hp=hp, wg=wg, kv_head=kv_head, q_start=q_start, ring=ring, base=base)
  if launch.packed:
    return _Walk(**place, **_packed_program_walk(launch, refs, b, kv_head, qt, q_start))
  xa, block_kv = launch.xa, tiles.block_kv
  slot = b * launch.num_kv_heads + kv_head
  mode = refs.modes[slot]
  steps, n1, second_start = walk(q_start, launch.rows, mode, launch.streaming, block_kv)
  lo = jnp.int32(0)
  if xa is None:
    tile_of = lambda s: _tile_of(s, lo, n1, second_start)
  else:   # an XA head walks its kept blocks below the diagonal, then the diagonal
    index_ref, count_ref = refs.xa
    is_xa = mode == xa.mode
    q_block = q_start // xa.block
    list_at = (slot * xa.num_blocks + q_block) * xa.num_blocks
    xa_steps, xa_n1, xa_second = xa_walk(q_start, launch.rows, count_ref[slot * xa.num_blocks
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
  return _Walk(**place, steps=steps, lo=lo, n1=n1, second_start=second_start, tile_of=tile_of)


def _packed_program_walk(launch: _Launch, refs: _Refs, b, kv_head, qt, q_start) -> dict:
  """`_Walk`'s walk fields of a program over packed rows: its precomputed `packed_walk`
  (refs.plan: its six fields' arrays); with `xa` (every row XA, `packed_xa_walk`) the walk's
  first piece reads list positions through the kept-block list; with `xa.mixed`, only the
  programs flagged by the walk's seventh field do."""
  xa, block_kv = launch.xa, launch.tiles.block_kv
  at = (b * launch.num_kv_heads + kv_head) * launch.num_q_tiles + qt
  steps, lo, n1, second_start, unmasked_lo, unmasked_hi = (ref[at] for ref in refs.plan[:6])
  tile_of = lambda s: _tile_of(s, lo, n1, second_start)
  walks_list = None if xa is None else True   # `_step_ranges`' listed
  listed = list_at = None
  if xa is not None:   # an XA program (`packed_xa_walk`): steps < n1 read list positions lo..
    index_ref = refs.xa[0]
    list_at = (b * launch.num_kv_heads + kv_head) * xa.num_blocks + q_start // xa.block
    listed = lambda s: mosaic_gpu_backward.kept_list_tile(
        index_ref, list_at, lo + jnp.minimum(s, n1 - 1), xa.block // block_kv, xa.num_blocks)
    tile_of = lambda s: jnp.where(s < n1, listed(s), second_start + s - n1)
    if xa.mixed:   # the other programs walk their own tiles
      walks_list = refs.plan[6][at] != 0
      tile_of = lambda s: jnp.where(s < n1, jnp.where(walks_list, listed(s), lo + s),
                                    second_start + s - n1)
  return dict(steps=steps, lo=lo, n1=n1, second_start=second_start, tile_of=tile_of,
              unmasked_lo=unmasked_lo, unmasked_hi=unmasked_hi, walks_list=walks_list,
              listed=listed, list_at=list_at)


def _kernel(modes_ref, plan_ref, xa_refs, q_ref, k_ref, v_ref, rows_ref, out_refs, scoped, *,
            groups, num_kv_heads, streaming, tiles: Tiles, scale, num_q_tiles,
            xa: "XAWalk | None", item=None, base=None, role=None):
  """One program: `rows` query rows of one or two query heads. Unpacked rows (plan_ref None)
  walk `walk`'s list (an XA head: `xa_walk`'s, reading its kept-block list from xa_refs) and
  mask the causal diagonal; packed rows walk their precomputed `packed_walk` (plan_ref: its
  six fields' arrays) and mask every tile outside its unmasked range with per-row bounds
  (rows_ref); with `xa` there (every row XA, `packed_xa_walk`) the walk's first piece reads
  list positions through the kept-block list, masked outside its unmasked steps; with
  `xa.mixed`, only the programs flagged by the walk's seventh field do, and XA rows
  (`_row_bounds`) see the keys of kept blocks (read from the dense keep array, xa_refs'
  second). The warpgroups' roles: `_consumer` (the compute warpgroups: QK^T, the online
  softmax and PV in one of the schedules, then `_epilogue`) and `_producer` (the memory
  warpgroup's loads into the K/V ring). A persistent program (`_persistent`) runs it per work
  item: item = its (batch, head pair, query tile), base = the ring steps of its earlier
  items, role = "compute" or "memory" (that warpgroup's part alone; returns the item's
  steps)."""
  launch = _Launch(groups, num_kv_heads, streaming, tiles, scale, num_q_tiles, xa,
                   packed=plan_ref is not None)
  refs = _Refs.of(modes_ref, plan_ref, xa_refs, q_ref, k_ref, v_ref, rows_ref, out_refs, scoped)
  program = _program_walk(launch, refs, item, base)
  consumer = functools.partial(_consumer, launch, refs, program, role)
  producer = functools.partial(_producer, launch, refs, program, role)
  if role is None:
    pl.when(program.wg < _COMPUTE_WGS)(consumer)
    pl.when(program.wg == _COMPUTE_WGS)(producer)
    return None
  (consumer if role == "compute" else producer)()
  return program.steps


@dataclasses.dataclass(frozen=True)
class _Consumer:
  """A compute warpgroup's part of a program, as its schedules read it: the launch, the refs,
  the walk, the warpgroup's query head, first row and Q/O tile in shared memory, QK^T's left
  operand (that tile, or it loaded into registers), packed rows' bounds (segment start, end of
  the sink, start of the window) and the turn between the two warpgroups (`_take_turn`)."""
  launch: _Launch
  refs: _Refs
  walk: _Walk
  head: Any
  row0: Any
  qo_smem: Any
  q_op: Any
  bounds: Any
  take_turn: Callable   # one callable, so that every turn traces to one shared jaxpr

  @property
  def dtype(self):
    return self.refs.q.dtype

  @property
  def acc_shape(self) -> tuple:
    return (self.launch.tiles.block_q, self.refs.q.shape[-1])

  def scores(self):
    """A fresh accumulator for one QK^T product."""
    return plgpu.ACC((self.launch.tiles.block_q, self.launch.tiles.block_kv), jnp.float32)

  def mask(self, tile, masked: bool):
    """`online_softmax`'s mask for KV tile tile() (a callable: read only on a masked tile),
    None where the tile runs unmasked."""
    return (lambda x: _mask(self, x, tile())) if masked else None


def _consumer(launch: _Launch, refs: _Refs, program: _Walk, role):
  """A compute warpgroup: its Q tile (and packed rows' bounds) in, the walk in the tiles'
  schedule (`_overlapped`, `_chained` or `_plain`), then `_epilogue`."""
  tiles = launch.tiles
  block_q = tiles.block_q
  wg = program.wg
  if role is None:
    plgpu.set_max_registers(232, action="increase")
  qo_smem = refs.qo_smem2.at[wg]
  head = program.hp * launch.heads_per_program + (wg if launch.pair_heads else 0)
  row0 = program.q_start + (0 if launch.pair_heads else wg * block_q)
  plgpu.copy_gmem_to_smem(refs.q.at[program.b, pl.ds(row0, block_q), head], qo_smem,
                          refs.q_ready.at[wg])
  bounds = None
  if launch.packed:   # this warpgroup's rows: segment start, end of the sink, start of the window
    for x in range(_ROW_FIELDS):
      plgpu.copy_gmem_to_smem(refs.rows.at[program.b, program.kv_head, x, pl.ds(row0, block_q)],
                              refs.rows_smem2.at[wg, x],
                              refs.rows_ready.at[wg * _ROW_FIELDS + x])
    bounds = []
    for x in range(_ROW_FIELDS):
      plgpu.barrier_wait(refs.rows_ready.at[wg * _ROW_FIELDS + x])
      bounds.append(plgpu.load(refs.rows_smem2.at[wg, x], layout=plgpu.Layout.WGMMA.reduce(1)))
  plgpu.barrier_wait(refs.q_ready.at[wg])
  # QK^T's left operand: the Q tile from shared memory, or (q_registers, natively) from
  # registers, so that the tensor cores read only K out of shared memory.
  q_op = (plgpu.load(qo_smem, layout=plgpu.Layout.WGMMA)
          if tiles.q_registers and refs.p_smem2 is None else qo_smem)
  cons = _Consumer(launch, refs, program, head, row0, qo_smem, q_op, bounds,
                   functools.partial(_take_turn, refs.turn))
  m_i = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32),
                          plgpu.Layout.WGMMA.reduce(1))
  l_i = plgpu.layout_cast(jnp.full((block_q,), 0.0, jnp.float32),
                          plgpu.Layout.WGMMA.reduce(1))
  acc = plgpu.layout_cast(jnp.full(cons.acc_shape, 0.0, jnp.float32), plgpu.Layout.WGMMA)
  if tiles.overlap:
    acc, m_i, l_i = _overlapped(cons, acc, m_i, l_i, _consumer_step_ranges(cons))
  elif tiles.chain:
    acc, m_i, l_i = _chained(cons, acc, m_i, l_i, _consumer_step_ranges(cons))
  else:
    acc, m_i, l_i = _plain(cons, acc, m_i, l_i)
  _epilogue(cons, acc, m_i, l_i)


def _take_turn(turn):
  """Arrive at the warpgroups' turn barrier and wait for the other warpgroup."""
  plgpu.barrier_arrive(turn)
  plgpu.barrier_wait(turn)


def _consumer_step_ranges(cons: _Consumer):
  """`_step_ranges` of a compute warpgroup's walk."""
  launch, w = cons.launch, cons.walk
  return _step_ranges(
      launch.packed, w.steps, w.lo, w.n1, w.second_start, w.q_start, launch.rows, cons.row0,
      launch.tiles.block_kv,
      *((w.unmasked_lo, w.unmasked_hi, None if w.walks_list is None else (w.walks_list,
                                                                         w.listed(0)))
        if launch.packed else ()))


def _mask(cons: _Consumer, x, tile):
  """Scores x of KV tile `tile` with MASK_VALUE where a row may not see a key: after the row
  (causal); packed rows also before the segment start and, streaming rows, between the sink
  and the window; XA rows of a mixed launch see their segment's keys in kept blocks."""
  launch, xa = cons.launch, cons.launch.xa
  block_q, block_kv = launch.tiles.block_q, launch.tiles.block_kv
  shape = (block_q, block_kv)
  row = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA) + cons.row0
  col = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA) + (
      tile * block_kv)
  ok = row >= col
  if launch.packed:
    start, sink_end, window = (lax.broadcast_in_dim(v, shape, [0]) for v in cons.bounds)
    ok = ok & (col >= start)
    seen = (col < sink_end) | (col >= window)
    if xa is not None and xa.mixed:   # XA rows: no window (`NO_WINDOW`), kept blocks
      keep_ref = cons.refs.xa[1]
      kept = keep_ref[cons.walk.list_at * xa.num_blocks + tile * block_kv // xa.block] != 0
      seen = seen | ((window == NO_WINDOW) & kept)
    ok = ok & seen
  return jnp.where(ok, x, MASK_VALUE)


def _bcast_rows(x, like):
  """A per-row vector broadcast to the shape of `like` [rows, ...]."""
  return lax.broadcast_in_dim(x, like.shape, [0])


def online_softmax(x, m_i, l_i, scale: float, mask=None, acc=None):
  """One KV tile's step of the online softmax, the one every schedule runs: the tile's scores
  x [rows, keys] float32 -> (P in float32, new row max, new row sum, the factor alpha that
  rescales the accumulator to the new max, and acc so rescaled where given). Base-2 with the
  scale folded in: m is kept scaled, p = exp2(x * c - m) is an FMA. A masked tile (`mask`, a
  callable on the scaled scores) scales first and masks to a finite MASK_VALUE: a row none of
  whose keys the tile shows (another segment's) then gets p = exp2(0) weights that the first
  visible key's larger maximum scales to zero (an FMA of the huge mask value would not
  cancel)."""
  c = scale * _LOG2E
  if mask is not None:
    x = mask(x * c)
    m_new = jnp.maximum(m_i, x.max(axis=1))
    p = jnp.exp2(x - _bcast_rows(m_new, x))
  else:
    m_new = jnp.maximum(m_i, x.max(axis=1) * c)
    p = jnp.exp2(x * c - _bcast_rows(m_new, x))
  alpha = jnp.exp2(m_i - m_new)
  if acc is not None:
    acc = acc * _bcast_rows(alpha, acc)
  l_i = l_i * alpha + p.sum(axis=1)
  return p, m_new, l_i, alpha, acc


def _pv_product(cons: _Consumer, acc_ref, p_lo, slot):
  """Issue P V of ring slot `slot` into acc_ref: P from registers, or in interpret mode
  through shared memory."""
  refs = cons.refs
  if refs.p_smem2 is None:
    plgpu.wgmma(acc_ref, p_lo, refs.v_smem.at[slot])
  else:   # interpret mode: P through shared memory
    refs.p_smem2.at[cons.walk.wg][...] = p_lo
    plgpu.commit_smem()
    plgpu.wgmma(acc_ref, refs.p_smem2.at[cons.walk.wg], refs.v_smem.at[slot])


def _add_pv(cons: _Consumer, acc, body, outs_like=()):
  """(acc + the PV product that body(acc_ref) issues, body's outputs): natively wgmma adds
  into the running accumulator (`run_state`, whose end awaits it; body's outputs, shaped as
  outs_like, leave through its state); interpret mode has no run_state, so there a fresh
  accumulator is added after."""
  if cons.refs.p_smem2 is None and not outs_like:
    return pl.run_state(body)(plgpu.ACC.init(acc)), ()
  if cons.refs.p_smem2 is None:
    def state(refs):
      acc_ref, *out_refs = refs
      for ref, x in zip(out_refs, body(acc_ref)):
        ref[...] = x

    acc, *outs = pl.run_state(state)((plgpu.ACC.init(acc), *outs_like))
    return acc, tuple(outs)
  pv, outs = pl.run_scoped(lambda ref: (lambda outs: (ref[...], outs))(body(ref) or ()),
                           plgpu.ACC(cons.acc_shape, jnp.float32))
  return acc + pv, outs


def _overlapped(cons: _Consumer, acc, m_i, l_i, ranges):
  """The walk with FlashAttention-3's intra-warpgroup overlap (`Tiles.overlap`). Step s
  issues tile s's QK^T and tile s-1's PV back to back, awaits only the first, and runs tile
  s's softmax (P in float32) while the PV product is in flight; once that product is awaited
  it rescales the accumulator to the new row max and casts P for step s+1's PV (registers a
  wgmma reads are defined only while none is in flight). The warpgroups take turns issuing:
  turn[w] is warpgroup w's, arrived at by the other once it has issued, so that one's softmax
  also overlaps the other's products. Step 0 issues its QK^T alone, masked (the masks are
  exact on any tile of a walk); the last PV is issued after the loop. The turns run on across
  a persistent program's items: a one-arrival barrier must not complete twice before its
  waiter has seen the first completion, so warpgroup 1's first arrival and warpgroup 0's last
  wait are the program's, not each item's."""
  refs, w, scale = cons.refs, cons.walk, cons.launch.scale
  wg, turn, ring = w.wg, refs.turn, w.ring

  def issue_qk(s_ref, slot):
    plgpu.barrier_wait(turn.at[wg])
    plgpu.wgmma(s_ref, cons.q_op, refs.k_smem.at[slot].transpose((1, 0)))

  slot0 = ring(0)
  plgpu.barrier_wait(refs.k_ready.at[slot0])
  if w.base is None:   # warpgroup 0 goes first (a persistent program: once, `_persistent`)
    pl.when(wg == 1)(lambda: plgpu.barrier_arrive(turn.at[0]))

  def first(s_ref):
    issue_qk(s_ref, slot0)
    plgpu.barrier_arrive(turn.at[1 - wg])
    return s_ref[...]

  x = pl.run_scoped(first, cons.scores())
  plgpu.barrier_arrive(refs.k_free.at[slot0])
  p, m_i, l_i, _, _ = online_softmax(x, m_i, l_i, scale, cons.mask(lambda: w.tile_of(0), True))
  p_lo = p.astype(cons.dtype)
  x_like = plgpu.layout_cast(
      jnp.full((cons.launch.tiles.block_q, cons.launch.tiles.block_kv), 0.0, jnp.float32),
      plgpu.Layout.WGMMA)   # the shape of a step's P, leaving PV's state

  def step(s, carry, masked: bool):
    acc, m_i, l_i, p_lo = carry   # acc at the row max m_i; p_lo: tile s-1's P
    slot, prev = ring(s), ring(s - 1)
    tile = w.tile_of(s)   # outside run_state, which cannot close over constants
    plgpu.barrier_wait(refs.k_ready.at[slot])
    plgpu.barrier_wait(refs.v_ready.at[prev])

    def products(s_ref):
      issue_qk(s_ref, slot)

      def pv_then_softmax(acc_ref):
        _pv_product(cons, acc_ref, p_lo, prev)
        plgpu.barrier_arrive(turn.at[1 - wg])
        x = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)   # QK^T done; PV may run on
        plgpu.barrier_arrive(refs.k_free.at[slot])
        p, m_new, l_new, alpha, _ = online_softmax(x, m_i, l_i, scale,
                                                   cons.mask(lambda: tile, masked))
        return p, m_new, l_new, alpha

      return _add_pv(cons, acc, pv_then_softmax, (x_like, m_i, l_i, m_i))

    acc, outs = pl.run_scoped(products, cons.scores())
    # Only now, the PV product awaited, are its operands' registers redefined: the
    # accumulator's rescale and P's cast while a product is in flight would make ptxas
    # serialise the wgmma (C7513); the barrier keeps them after the wait.
    acc, (p, m_new, l_new, alpha) = lax.optimization_barrier((acc, outs))
    plgpu.barrier_arrive(refs.v_free.at[prev])
    return acc * _bcast_rows(alpha, acc), m_new, l_new, p.astype(cons.dtype)

  carry = (acc, m_i, l_i, p_lo)
  for s_lo, s_hi, masked in ranges:
    carry = lax.fori_loop(jnp.maximum(s_lo, 1), jnp.maximum(s_hi, 1),
                          functools.partial(step, masked=masked), carry)
  acc, m_i, l_i, p_lo = carry
  last = ring(w.steps - 1)
  plgpu.barrier_wait(refs.v_ready.at[last])
  plgpu.barrier_wait(turn.at[wg])

  def pv_last(acc_ref):
    _pv_product(cons, acc_ref, p_lo, last)
    plgpu.barrier_arrive(turn.at[1 - wg])

  acc, _ = _add_pv(cons, acc, pv_last)
  plgpu.barrier_arrive(refs.v_free.at[last])
  if w.base is None:   # observe warpgroup 1's last arrival (a persistent program: at its end;
    # between items that arrival is the next item's first turn)
    pl.when(wg == 0)(lambda: plgpu.barrier_wait(turn.at[0]))
  return acc, m_i, l_i


def _chained(cons: _Consumer, acc, m_i, l_i, ranges):
  """The walk without overlap, its products chained (`Tiles.chain`): step s runs tile
  s's softmax on the scores the last turn left, then, in the warpgroup's turn, issues tile
  s+1's QK^T and tile s's PV, and awaits both after the turn. Step 0's QK^T is issued alone
  before the loop; the last step, peeled, issues its PV alone and runs masked (the masks are
  exact on any tile of a walk). Two turns a step, as without the chain."""
  refs, w, scale = cons.refs, cons.walk, cons.launch.scale
  ring, k_smem = w.ring, refs.k_smem
  plgpu.barrier_wait(refs.k_ready.at[ring(0)])
  pl.when(w.wg == 1)(cons.take_turn)

  def first(s_ref):
    plgpu.wgmma(s_ref, cons.q_op, k_smem.at[ring(0)].transpose((1, 0)))
    cons.take_turn()
    return s_ref[...]

  x = pl.run_scoped(first, cons.scores())
  plgpu.barrier_arrive(refs.k_free.at[ring(0)])

  def softmax_and_turn(s, carry, masked: bool):
    acc, m_i, l_i, x = carry
    p, m_new, l_i, _, acc = online_softmax(x, m_i, l_i, scale,
                                           cons.mask(lambda: w.tile_of(s), masked), acc)
    acc, l_i, m_new, p_lo = lax.optimization_barrier((acc, l_i, m_new, p.astype(cons.dtype)))
    plgpu.barrier_arrive(refs.turn)
    plgpu.barrier_wait(refs.v_ready.at[ring(s)])
    return acc, m_new, l_i, p_lo

  def step(s, carry, masked: bool):
    acc, m_i, l_i, p_lo = softmax_and_turn(s, carry, masked)
    slot, nxt = ring(s), ring(s + 1)
    plgpu.barrier_wait(refs.k_ready.at[nxt])
    plgpu.barrier_wait(refs.turn)

    def products(s_ref):
      # QK^T first: its accumulator's zero fill precedes every product in flight.
      plgpu.wgmma(s_ref, cons.q_op, k_smem.at[nxt].transpose((1, 0)))

      def pv(acc_ref):
        _pv_product(cons, acc_ref, p_lo, slot)
        cons.take_turn()

      acc_new, _ = _add_pv(cons, acc, pv)
      return acc_new, s_ref[...]

    acc, x = pl.run_scoped(products, cons.scores())
    plgpu.barrier_arrive(refs.v_free.at[slot])
    plgpu.barrier_arrive(refs.k_free.at[nxt])
    return acc, m_i, l_i, x

  carry = (acc, m_i, l_i, x)
  for s_lo, s_hi, masked in ranges:
    carry = lax.fori_loop(s_lo, jnp.minimum(s_hi, w.steps - 1),
                          functools.partial(step, masked=masked), carry)
  last = w.steps - 1
  acc, m_i, l_i, p_lo = softmax_and_turn(last, carry, masked=True)
  plgpu.barrier_wait(refs.turn)
  acc, _ = _add_pv(cons, acc, lambda acc_ref: _pv_product(cons, acc_ref, p_lo, ring(last)))
  plgpu.barrier_arrive(refs.v_free.at[ring(last)])
  pl.when(w.wg == 0)(cons.take_turn)
  return acc, m_i, l_i


def _plain(cons: _Consumer, acc, m_i, l_i):
  """The walk with neither overlap nor chain (`Tiles(chain=False)`): per step, in the warpgroup's
  turn, QK^T, its wait, the softmax, then, in the next turn, PV (awaited before the next
  step's QK^T), in the regions a traced kernel records (`TRACE_REGIONS`)."""
  refs, w, scale = cons.refs, cons.walk, cons.launch.scale
  ring = w.ring
  plgpu.barrier_wait(refs.k_ready.at[0 if w.base is None else ring(0)])
  pl.when(w.wg == 1)(cons.take_turn)

  def step(s, carry, masked: bool):
    acc, m_i, l_i = carry
    slot = ring(s)

    def qk(acc_ref):
      with jax.named_scope("qk_issue"):
        plgpu.wgmma(acc_ref, cons.q_op, refs.k_smem.at[slot].transpose((1, 0)))
      with jax.named_scope("qk_turn"):
        cons.take_turn()
      with jax.named_scope("qk_wait"):
        return acc_ref[...]

    x = pl.run_scoped(qk, cons.scores())
    plgpu.barrier_arrive(refs.k_free.at[slot])
    with jax.named_scope("softmax"):
      p, m_new, l_i, _, acc = online_softmax(x, m_i, l_i, scale,
                                             cons.mask(lambda: w.tile_of(s), masked), acc)
      acc, l_i, m_new, p_lo = lax.optimization_barrier((acc, l_i, m_new, p.astype(cons.dtype)))
    with jax.named_scope("pv_turn"):
      plgpu.barrier_arrive(refs.turn)
      plgpu.barrier_wait(refs.v_ready.at[slot])
      plgpu.barrier_wait(refs.turn)

    def pv(acc_ref):
      _pv_product(cons, acc_ref, p_lo, slot)
      nxt = s + 1

      @pl.when(nxt < w.steps)
      def _():
        plgpu.barrier_wait(refs.k_ready.at[ring(nxt)])

    with jax.named_scope("pv"):
      acc, _ = _add_pv(cons, acc, pv)
    plgpu.barrier_arrive(refs.v_free.at[slot])
    return acc, m_new, l_i

  carry = (acc, m_i, l_i)
  for s_lo, s_hi, masked in _consumer_step_ranges(cons):
    carry = lax.fori_loop(s_lo, s_hi, functools.partial(step, masked=masked), carry)
  acc, m_i, l_i = carry
  pl.when(w.wg == 0)(cons.take_turn)
  return acc, m_i, l_i


def _epilogue(cons: _Consumer, acc, m_i, l_i):
  """A compute warpgroup's outputs: O = acc / l rounded to the inputs' dtype; with the
  log-sum-exps (training), each row's base-2 log-sum-exp m + log2(l) and the rounding's
  remainder, written once the first store has read the shared tile."""
  refs, w, block_q = cons.refs, cons.walk, cons.launch.tiles.block_q
  qo_smem, rows_here = cons.qo_smem, pl.ds(cons.row0, block_q)
  acc = acc / lax.broadcast_in_dim(l_i, acc.shape, [0])
  hi = acc.astype(cons.dtype)
  qo_smem[...] = hi
  if refs.lse is not None:
    refs.lse_smem2.at[w.wg][...] = m_i + jnp.log2(l_i)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(qo_smem, refs.out.at[w.b, rows_here, cons.head])
  if refs.lse is not None:
    plgpu.copy_smem_to_gmem(refs.lse_smem2.at[w.wg], refs.lse.at[w.b, cons.head, rows_here])
  if refs.lo is not None:   # the rounding remainder, once the first store has read the tile
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    qo_smem[...] = (acc - hi.astype(jnp.float32)).astype(cons.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(qo_smem, refs.lo.at[w.b, rows_here, cons.head])
  plgpu.wait_smem_to_gmem(0)


def _producer(launch: _Launch, refs: _Refs, program: _Walk, role):
  """The memory warpgroup: the walk's K and V tiles into the ring with the bulk copy engine
  (TMA), each slot refilled once both compute warpgroups released it (K and V apart where
  the schedule releases K a step before V), then the last releases observed so that every
  barrier phase is consumed. Multicast: each program of the cluster loads half of a tile
  into both rings. A persistent program's item waits for each slot it fills (the ring runs on
  from the earlier items)."""
  tiles, w = launch.tiles, program
  block_kv, slots = tiles.block_kv, tiles.slots
  k_parts, v_parts = (refs.k, refs.k_smem, refs.k_ready), (refs.v, refs.v_smem, refs.v_ready)
  if role is None:
    plgpu.set_max_registers(40, action="decrease")
  # Multicast: each program of the cluster loads half of a tile into both rings.
  multicast = dict(collective_axes="pair") if tiles.multicast else {}

  def load(s, slot, parts=(k_parts, v_parts)):
    rows_kv = pl.ds(w.tile_of(s) * block_kv, block_kv)
    for src, dst, ready_ in parts:
      plgpu.copy_gmem_to_smem(src.at[w.b, rows_kv, w.kv_head], dst.at[slot], ready_.at[slot],
                              **multicast)

  if w.base is not None:   # a persistent program's item: the ring's slots may still be busy
    @pl.loop(0, w.steps)
    def _(s):
      slot = w.ring(s)
      wait = lambda free: pl.when(w.base + s >= slots)(
          lambda: plgpu.barrier_wait(free.at[slot]))
      if tiles.overlap:
        wait(refs.k_free)
        load(s, slot, (k_parts,))
        wait(refs.v_free)
        load(s, slot, (v_parts,))
      else:
        wait(refs.k_free)
        wait(refs.v_free)
        load(s, slot)
    return

  for i in range(slots):
    pl.when(i < w.steps)(functools.partial(load, jnp.int32(i), i))

  @pl.loop(0, jnp.maximum(w.steps - slots, 0))
  def _(s):
    slot = lax.rem(s, jnp.int32(slots))
    if tiles.overlap or tiles.chain:   # K is released a step before V: load each when free
      plgpu.barrier_wait(refs.k_free.at[slot])
      load(s + slots, slot, (k_parts,))
      plgpu.barrier_wait(refs.v_free.at[slot])
      load(s + slots, slot, (v_parts,))
    else:
      plgpu.barrier_wait(refs.k_free.at[slot])
      plgpu.barrier_wait(refs.v_free.at[slot])
      load(s + slots, slot)

  @pl.loop(jnp.maximum(w.steps - slots, 0), w.steps)
  def _(s):  # observe the last releases too, so every barrier phase is consumed
    slot = lax.rem(s, jnp.int32(slots))
    plgpu.barrier_wait(refs.k_free.at[slot])
    plgpu.barrier_wait(refs.v_free.at[slot])


def _persistent(kernel, scoped, *, programs: int, num_heads: int, batch: int,
                num_q_tiles: int, slots: int, overlap: bool):
  """A persistent program: the work items p, p + P, ... of P = `programs` (item w: head pair w
  mod num_heads, batch row w // num_heads mod batch, query tile counted from the last, so
  that items run heaviest first), each through kernel(item, base, role), the K/V ring's step
  count carried across items; at the end the memory warpgroup observes the last releases.
  With `overlap`, the turns' first arrival and last wait (`_overlapped`)."""
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


def forward_call(q, k, v, modes, *, streaming: Streaming, tiles: Tiles, scale, interpret,
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
    raise ValueError("Tiles(multicast=True) runs natively only: Pallas's GPU interpreter "
                     "has no multicast copy between the programs of a cluster")
  rows = rows_per_program(groups, tiles)
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
