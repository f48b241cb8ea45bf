"""The hybrid FA/SSA backward for Hopper GPUs in Pallas Mosaic GPU (wgmma, TMA): dQ and dK/dV.

The training forward (`mosaic_gpu.forward_train`) leaves, per query row and head, O_FA and
O_FA - O_SSA (`common.row_deltas`) and the base-2 log-sum-exps of both patterns; with
D_FA = rowsum(dO * O_FA), D_SSA = rowsum(dO * O_SSA), and a gate r per (batch, KV head),
each visited tile gives
  P_x = exp2(S * c - lse_x)  (x = FA, SSA; c = scale * log2 e; zero where x hides the key),
  dP  = dO V^T,
  dS  = r P_FA (dP - D_FA) + (1 - r) P_SSA (dP - D_SSA),
and dQ = scale * dS K, dK = scale * dS^T Q, dV = (r P_FA + (1 - r) P_SSA)^T dO. The FA term
is skipped where r = 0 and the SSA term where r = 1 or the tile lies outside the head's sink
and window: the run-time mode picks the walk, as in the forward.

Both kernels are warp-specialised like the forward (`mosaic_gpu`): one memory warpgroup
streams tiles into a ring of shared-memory slots with the bulk copy engine, two compute
warpgroups run the matrix products on the tensor cores (wgmma) and the elementwise terms in
registers.
  dQ   a program per (query head pair or row-tile pair, query tiles, batch), as the forward:
       it walks the KV tiles of its mode (`dq_walk`), K and V streamed.
  dK/dV a program per (KV head, 2 x block_k keys, batch): each compute warpgroup owns block_k
       keys; the program walks, for each of the KV head's G query heads, the query tiles that
       see its keys (`dkv_walk`), Q, dO and the four row terms streamed; the G heads' sums
       stay in the accumulators (GQA without a reduction afterwards).
Tiles of a walk are a fixed sequence of ranges, each with its terms (FA, SSA or both) known
at trace time; a range's tiles that straddle the causal diagonal run masked, the others not.
Packed rows (`packed_dq_walk`, `packed_dkv_walk`) take their ranges from `common.packed_plan`
and the gate per row (a fifth row term); their masks compare each key with the query row's
bounds (`_packed_masks`), on every tile outside the plan's unmasked ranges.
The streaming window needs no mask: `applies` demands SSA blocks made of whole tiles on both
kernels' sides, so a tile is wholly inside or outside a head's window.
XAttention settings (`xa_dq_walk`, `xa_dkv_walk`): the FA and SSA terms carry the patterns of
the pair ("full"/"xa" or "xa"/"stream"). An XA term alone walks a listed range (the kept
blocks of the program's query block, or for dK/dV the later query blocks that kept its key
block, `xa_column_lists`; whole blocks, no mask) and then the diagonal block. A mixed head
walks every causal tile with both terms and switches each off per tile where its pattern does
not attend (flagged ranges): the term's row log-sum-exps are raised by `_OFF` there, so its
probabilities are exactly zero. Packed rows (`packed_xa_dq_walk`, `packed_xa_dkv_walk`) walk
only the part of a list that can hold their segment (`mosaic_gpu.packed_xa_list_spans`), their
tiles masked with the per-row bounds (the XA term with FA's mask), except, for dQ, the
listed tiles wholly inside the rows' segment (as the forward's, `mosaic_gpu.packed_xa_walk`).

Interpret mode (`interpret=True`) runs the kernels on a CPU: there the register operands of
wgmma take a trip through shared memory and accumulators are added after (no run_state).

Shape letters: B batch, T tokens (Tp padded), N query heads, K KV heads, G = N / K, H head dim.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from elastic_jax.attention.common import MODE_FULL, MODE_MIX, MODE_SPARSE, dkv_program
from elastic_jax.attention.mosaic_gpu.tiles import (  # noqa: F401  (BackwardTiles: deprecated)
    DEFAULT_TILES, BackwardTiles, Tiles)
from elastic_jax.attention.reference import Streaming
from elastic_jax.attention.xattention import block_lists

try:  # the Mosaic GPU dialect ships with jaxlib; keep the package importable without it
  from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover
  plgpu = None

_LOG2E = math.log2(math.e)
_COMPUTE_WGS = 2
_ROW_TERMS = 4      # per query row and head: lse_FA, lse_SSA, D_FA, D_SSA


# Registers a thread the kernels launch with: the register file (65536) over the three
# warpgroups' 384 threads, rounded down to 8.
_LAUNCH_REGISTERS = 168


def shared_bytes(tiles: Tiles, head_dim: int) -> int:
  """Shared memory of the larger of the two kernels (bf16 tiles, float32 row terms with the
  packed rows' gate, int32 packed bounds, 1 KiB for the barriers), against the 227 KiB a
  Hopper block may have: at head_dim 128 the default tiles take 133 KiB, each slot more 34."""
  terms = _ROW_TERMS + 1
  dq = (_COMPUTE_WGS * tiles.dq_block_q * (2 * head_dim * 2 + (terms + 3) * 4)
        + tiles.backward_slots * 2 * tiles.dq_block_kv * head_dim * 2)
  dkv = (_COMPUTE_WGS * 2 * tiles.dkv_block_k * head_dim * 2
         + tiles.backward_slots * tiles.dkv_block_q * (2 * head_dim * 2 + (terms + 3) * 4))
  return max(dq, dkv) + 1024


def memory_registers(tiles: Tiles) -> int:
  """The memory warpgroup's registers a thread, once the compute warpgroups took theirs."""
  return (_COMPUTE_WGS + 1) * _LAUNCH_REGISTERS - _COMPUTE_WGS * tiles.registers


DEFAULT_BACKWARD_TILES = DEFAULT_TILES   # deprecated: the one Tiles holds the backward's fields


def applies(groups: int, streaming: Streaming, tiles: Tiles = DEFAULT_TILES,
            head_dim: int = 128):
  """Whether these tiles fit the layout (with `mosaic_gpu.applies` for dtypes): SSA blocks of
  whole tiles on both kernels' sides, G even or 1 for the dQ head pairs, head_dim a multiple
  of 64 up to 128 (dK and dV accumulators of 192 would take 192 registers a thread, and the
  tiles of 256 would overflow shared memory)."""
  sizes = program_sizes(groups, tiles)
  return ((groups == 1 or groups % 2 == 0) and tiles.backward_slots >= 2
          and tiles.registers % 8 == 0 and _LAUNCH_REGISTERS < tiles.registers
          and memory_registers(tiles) >= 24 and shared_bytes(tiles, head_dim) <= 227 * 1024
          and head_dim % 64 == 0 and head_dim <= 128
          and tiles.dq_block_q % 64 == 0 and tiles.dkv_block_k % 64 == 0   # wgmma: M of 64
          and all(x % 64 == 0 and streaming.block % x == 0 for x in sizes))


def _dq_rows(groups: int, tiles: Tiles) -> int:
  """Rows of a dQ program: one row tile of two query heads, or two row tiles of one head."""
  return tiles.dq_block_q if groups >= 2 else _COMPUTE_WGS * tiles.dq_block_q


def program_sizes(groups: int, tiles: Tiles = DEFAULT_TILES) -> tuple:
  """Tokens per dQ program, per K/V tile of dQ, per dK/dV program and per Q tile of dK/dV:
  streaming and XAttention blocks must be made of each."""
  return (_dq_rows(groups, tiles), tiles.dq_block_kv, _COMPUTE_WGS * tiles.dkv_block_k,
          tiles.dkv_block_q)


def padded_length(t: int, groups: int, tiles: Tiles = DEFAULT_TILES) -> int:
  """T padded to whole programs of both kernels."""
  return t + (-t % math.lcm(*program_sizes(groups, tiles)))


class Range(NamedTuple):
  """A piece of a walk: tiles lo .. hi - 1 in order, with the FA / SSA terms fa, sa (fixed at
  trace time). listed: lo .. hi - 1 are positions in the program's kept-block list (each
  listed block's tiles in turn; off the diagonal block: before it for dQ, after it for dK/dV,
  so unpacked rows need no mask there). flagged: each
  tile's terms are switched on or off at run time by its own test (XAttention's kept blocks,
  the streaming window) as a MIX head under the XAttention settings walks. unmasked: packed
  rows' tiles [a, b) that need no mask (None: every tile masked)."""
  lo: Any
  hi: Any
  fa: bool
  sa: bool
  listed: bool = False
  flagged: bool = False
  unmasked: tuple | None = None


def _as_ranges(walk) -> list[Range]:
  """A walk's pieces as `Range`s: (lo, hi, fa, sa) tuples, packed rows' (lo, hi, fa, sa,
  unmasked_lo, unmasked_hi), or `Range`s already."""
  return [x if isinstance(x, Range) else
          Range(*x[:4], unmasked=tuple(x[4:]) if len(x) == 6 else None) for x in walk]


def _ranges_tile(s, ranges, listed_tile=None):
  """The tile of step `s` of a walk made of `ranges` in order; a listed range's positions go
  through `listed_tile(position)`."""
  tile, offset = jnp.int32(0), jnp.int32(0)
  for lo, hi, _, _, listed, *_ in _as_ranges(ranges):
    n = hi - lo
    here = lo + s - offset
    tile = jnp.where((s >= offset) & (s < offset + n),
                     listed_tile(here) if listed else here, tile)
    offset = offset + n
  return tile


def _offsets(ranges):
  """The first step of each range and the walk's length."""
  out, offset = [], jnp.int32(0)
  for lo, hi, *_ in ranges:
    out.append(offset)
    offset = offset + (hi - lo)
  return out, offset


def _upto(on, lo, hi):
  """The range [lo, hi) where `on` (a traced bool), else the empty [lo, lo)."""
  return lo, jnp.where(on, hi, lo)


def _stream_tiles(q_start, rows: int, streaming: Streaming, block_kv: int):
  """(causal end, end of the sink, start of the window past the sink) in KV tiles for a
  program of `rows` rows from `q_start` (inside one streaming block)."""
  per_block = streaming.block // block_kv
  causal_end = (q_start + rows + block_kv - 1) // block_kv
  sink_end = jnp.minimum(streaming.sink_blocks * per_block, causal_end)
  window = jnp.maximum(q_start // streaming.block - streaming.local_blocks + 1, 0) * per_block
  return causal_end, sink_end, jnp.maximum(window, sink_end)


def _stream_reach(k_start, streaming: Streaming, block_q: int, num_q_tiles):
  """The query tile up to which a key from `k_start` is seen by the streaming pattern: every
  later row for a sink key, else the rows whose window still reaches its block."""
  blk = streaming.block
  kb = k_start // blk
  reach = jnp.where(kb < streaming.sink_blocks, num_q_tiles,
                    jnp.minimum((kb + streaming.local_blocks) * blk // block_q, num_q_tiles))
  return jnp.maximum(reach, k_start // block_q)


def dq_walk(q_start, rows: int, mode, streaming: Streaming, block_kv: int):
  """The KV tiles a dQ program of `rows` rows from `q_start` visits: ranges (lo, hi, fa, sa)
  in order, fa / sa whether the FA / SSA term applies on them (fixed per range, the bounds
  per mode at run time; a range another mode uses is empty).
    FULL    [0, causal end) FA;
    SPARSE  sink tiles, then the window up to the diagonal, SSA;
    MIX     sink tiles FA+SSA, the tiles between FA, the window FA+SSA."""
  causal_end, sink_end, win_lo = _stream_tiles(q_start, rows, streaming, block_kv)
  full, sparse, mix = mode == MODE_FULL, mode == MODE_SPARSE, mode == MODE_MIX
  return [(*_upto(full, 0, causal_end), True, False),
          (*_upto(mix, sink_end, win_lo), True, False),
          (*_upto(sparse, 0, sink_end), False, True),
          (*_upto(sparse, win_lo, causal_end), False, True),
          (*_upto(mix, 0, sink_end), True, True),
          (*_upto(mix, win_lo, causal_end), True, True)]


def dkv_walk(k_start, keys: int, mode, streaming: Streaming, block_q: int, num_q_tiles):
  """The query tiles a dK/dV program of `keys` keys from `k_start` visits (per query head):
  ranges (lo, hi, fa, sa) as `dq_walk`'s. Query tiles from the one holding the first key see
  it causally (FA); the SSA pattern sees a sink key from every later row and another key from
  the rows whose window still reaches its block."""
  lo = k_start // block_q
  reach = _stream_reach(k_start, streaming, block_q, num_q_tiles)
  full, sparse, mix = mode == MODE_FULL, mode == MODE_SPARSE, mode == MODE_MIX
  del keys
  return [(*_upto(full, lo, num_q_tiles), True, False),
          (*_upto(sparse, lo, reach), False, True),
          (*_upto(mix, lo, reach), True, True),
          (*_upto(mix, reach, num_q_tiles), True, False)]


@dataclasses.dataclass(frozen=True)
class XATerms:
  """The XAttention settings of a backward launch: the patterns of the FA and SSA terms
  (("full", "xa") under "fa-xa", ("xa", "stream") under "xa-ssa"), the XA block in tokens (a
  multiple of both kernels' program sizes) and the blocks per kept-block list."""
  pair: tuple
  block: int
  num_blocks: int


def _xa_terms_walk(mode, pair, pieces, mix, tests):
  """A walk under the XAttention settings from its parts: where the mode has one term, that
  term's pattern alone (pieces[pattern](r) -> its Ranges, r(lo, hi, **kw) a Range of that term
  made empty when the mode is another); a MIX head the range mix = (lo, hi, Range keywords)
  with both terms, flagged. Returns (ranges, flags), flags(tile) -> [tests[pattern](tile) per
  term] (None: the term applies to every tile of the range)."""
  full, sparse = mode == MODE_FULL, mode == MODE_SPARSE
  out = []
  for on, pattern, fa in ((full, pair[0], True), (sparse, pair[1], False)):
    out += pieces[pattern](lambda lo, hi, on=on, fa=fa, **kw: Range(*_upto(on, lo, hi), fa,
                                                                     not fa, **kw))
  lo, hi, kw = mix
  return (out + [Range(*_upto(mode == MODE_MIX, lo, hi), True, True, flagged=True, **kw)],
          lambda tile: [tests[pattern](tile) for pattern in pair])


def xa_dq_walk(q_start, rows: int, mode, streaming: Streaming, block_kv: int, pair, below,
               xa_block: int, kept):
  """`dq_walk` under the XAttention settings: the FA term's pattern is pair[0], the SSA
  term's pair[1]. A head of one pattern walks it alone: "full" its causal tiles, "stream"
  its sink then its window, "xa" the `below` kept blocks before its diagonal block (a listed
  range) then the diagonal block up to the causal end. A MIX head walks every causal tile
  with both terms, each tile's terms switched by its own test (flagged). Returns (ranges,
  flags): flags(tile) -> per term, whether it applies to that KV tile (None: always), with
  kept(block) whether this program's query block kept that key block."""
  per_xa = xa_block // block_kv
  causal_end, sink_end, win_lo = _stream_tiles(q_start, rows, streaming, block_kv)
  pieces = {"full": lambda r: [r(0, causal_end)],
            "stream": lambda r: [r(0, sink_end), r(win_lo, causal_end)],
            "xa": lambda r: [r(0, below * per_xa, listed=True),
                             r(q_start // xa_block * per_xa, causal_end)]}
  tests = {"full": lambda j: None, "stream": lambda j: (j < sink_end) | (j >= win_lo),
           "xa": lambda j: kept(j // per_xa)}
  return _xa_terms_walk(mode, pair, pieces, (0, causal_end, {}), tests)


def xa_dkv_walk(k_start, mode, streaming: Streaming, block_q: int, num_q_tiles, pair, above,
                xa_block: int, kept):
  """`dkv_walk` under the XAttention settings (patterns as `xa_dq_walk`): "full" the query
  tiles from the keys' own on, "stream" those up to its reach, "xa" the `above` later query
  blocks that kept this key block (a listed range) then the key block's own query tiles; a
  MIX head every query tile from its keys' own on, flagged. Returns (ranges, flags) as
  `xa_dq_walk`, flags per query tile, kept(block) whether that query block kept this
  program's key block."""
  per_xa = xa_block // block_q
  lo = k_start // block_q
  reach = _stream_reach(k_start, streaming, block_q, num_q_tiles)
  diagonal_end = jnp.minimum((k_start // xa_block + 1) * per_xa, num_q_tiles)
  pieces = {"full": lambda r: [r(lo, num_q_tiles)], "stream": lambda r: [r(lo, reach)],
            "xa": lambda r: [r(0, above * per_xa, listed=True), r(lo, diagonal_end)]}
  tests = {"full": lambda i: None, "stream": lambda i: i < reach,
           "xa": lambda i: kept(i // per_xa)}
  return _xa_terms_walk(mode, pair, pieces, (lo, num_q_tiles, {}), tests)


def xa_column_lists(keep):
  """The dK/dV kernel's kept-block lists from `common.xa_operands`'s keep [slots, nb, nb]
  int32: per key block J, the later query blocks I > J that keep it, ascending (index [slots,
  nb, nb] int32; those first), and how many (count [slots, nb] int32)."""
  nb = keep.shape[-1]
  later = jnp.swapaxes(keep != 0, 1, 2) & ~jnp.tri(nb, dtype=bool)[None]   # [slot, J, I > J]
  return block_lists(later)


_OFF = 2.0 ** 100   # added to a row's log-sum-exp: exp2(S c - lse) = 0 where a term is off


def _swizzled(dtype):
  bits = jnp.dtype(dtype).itemsize * 8
  return (plgpu.TilingTransform((8, 1024 // bits)), plgpu.SwizzleTransform(128))


def _mma(acc, lhs, rhs_ref, staging):
  """acc + lhs @ rhs on the tensor cores, lhs in registers (WGMMA layout). In interpret mode
  (`staging`, a shared-memory buffer of lhs's shape) lhs goes through shared memory and the
  product is added after."""
  if staging is None:
    def fn(acc_ref):
      plgpu.wgmma(acc_ref, lhs, rhs_ref)
    return pl.run_state(fn)(plgpu.ACC.init(acc))
  staging[...] = lhs
  plgpu.commit_smem()

  def fresh(acc_ref):
    plgpu.wgmma(acc_ref, staging, rhs_ref)
    return acc_ref[...]
  return acc + pl.run_scoped(fresh, plgpu.ACC(acc.shape, jnp.float32))


def _product(lhs_ref, rhs_ref, shape):
  """lhs @ rhs into a fresh float32 accumulator (both operands in shared memory)."""
  def fn(acc_ref):
    plgpu.wgmma(acc_ref, lhs_ref, rhs_ref)
    return acc_ref[...]
  return pl.run_scoped(fn, plgpu.ACC(shape, jnp.float32))


def _probs(x, lse_terms, oks, fa: bool, sa: bool, bcast):
  """(P_FA, P_SSA) of one tile from its scaled scores x (None for a term the range skips):
  exp2(x - lse), zero where the term's mask (`oks`: FA's, SSA's; None on tiles every pair of
  which the term sees) is false."""
  out = []
  for on, lse, ok in ((fa, lse_terms[0], oks[0]), (sa, lse_terms[1], oks[1])):
    p = None
    if on:
      p = jnp.exp2(x - bcast(lse))
      if ok is not None:
        p = jnp.where(ok, p, 0.0)
    out.append(p)
  return out


def _switched(lse_terms, on):
  """The row log-sum-exps of a flagged tile: each term's raised by `_OFF` where its test
  (`on`: a traced bool per term, None for a term every tile has) is false."""
  if on is None:
    return lse_terms
  return [lse if flag is None else lse + jnp.where(flag, 0.0, _OFF)
          for lse, flag in zip(lse_terms, on)]


def kept_list_tile(index_ref, list_at, position, per_block: int, num_blocks: int):
  """The tile at `position` of a kept-block list (row `list_at` of the flattened index):
  listed block position // per_block, its tile position % per_block."""
  entry = list_at * num_blocks + jnp.clip(position // per_block, 0, num_blocks - 1)
  return index_ref[entry] * per_block + lax.rem(position, jnp.int32(per_block))


def listed_unmasked_steps(in_lo, in_hi, first_tile, n):
  """Of a packed program's listed piece (`common.packed_plan`'s [in_lo, in_hi): the tiles
  wholly inside its rows' segment and before their first row; the piece: n steps reading
  kept blocks in ascending order, from the block holding the segment start on and all below
  the program's diagonal block, its first tile first_tile), the steps [a, z) that need no
  mask (the list chose their blocks). Only the first block's tiles can lie before in_lo, and
  none at or past in_hi when that range is not empty."""
  a = jnp.clip(in_lo - first_tile, 0, n)
  return a, jnp.where(in_hi > in_lo, n, a)


def _dscores(probs, dp, d_terms, weights, bcast):
  """(P mixed, dS) of one tile: r P_FA + (1 - r) P_SSA and r P_FA (dP - D_FA) + (1 - r) P_SSA
  (dP - D_SSA), over the terms present in `probs`; weights (r, 1 - r), scalars or per row."""
  p_mix = ds = None
  for p, delta, w in zip(probs, d_terms, weights):
    if p is None:
      continue
    wp = p * w
    term = wp * (dp - bcast(delta))
    p_mix = wp if p_mix is None else p_mix + wp
    ds = term if ds is None else ds + term
  return p_mix, ds


def _packed_masks(query, key, bounds):
  """FA's and SSA's masks of packed rows from the query's bounds (segment start, end of its
  sink, start of its window; `mosaic_gpu._row_bounds` with every row streaming): key j is
  visible to query i iff start_i <= j <= i, and to SSA also iff j < sink_end_i or j >=
  window_i. Bounds given as None are not needed (SSA's mask is None then)."""
  start, sink_end, window = bounds
  fa = (key >= start) & (key <= query)
  return fa, None if sink_end is None else fa & ((key < sink_end) | (key >= window))


def _term_masks(masks, xa: XATerms | None):
  """The two terms' masks of packed rows from `_packed_masks`'s (FA, SSA): under the
  XAttention settings an XA term takes FA's (its kept blocks are the walk's or the flag's)."""
  if xa is None:
    return masks
  return tuple(masks[1] if pattern == "stream" else masks[0] for pattern in xa.pair)


def packed_dq_walk(plan, mode):
  """The KV tiles of a dQ program over packed rows, from its `common.packed_plan` entries
  (kv_lo, sink_hi, win_lo, causal_hi, in_lo, in_hi, sparse_in_hi) and its run-time mode:
  ranges (lo, hi, fa, sa, unmasked_lo, unmasked_hi). A full tile walks [kv_lo, causal_hi)
  with FA, a streaming one its sink then its window with SSA, a tile whose rows are routed
  differently (MODE_MIX) [kv_lo, causal_hi) with both terms, every tile masked."""
  kv_lo, sink_hi, win_lo, causal_hi, in_lo, in_hi, sparse_in_hi = plan
  full, sparse, mix = mode == MODE_FULL, mode == MODE_SPARSE, mode == MODE_MIX
  w = jnp.maximum(win_lo, sink_hi)
  return [(*_upto(full, kv_lo, causal_hi), True, False, in_lo, in_hi),
          (*_upto(sparse, kv_lo, sink_hi), False, True, in_lo, sparse_in_hi),
          (*_upto(sparse, w, causal_hi), False, True, in_lo, sparse_in_hi),
          (*_upto(mix, kv_lo, causal_hi), True, True, in_lo, in_lo)]


def packed_dkv_walk(plan, mode):
  """The query tiles of a dK/dV program over packed rows (per query head), from its key
  tile's `common.packed_plan` entries (q_lo, q_hi_full, q_hi_sparse) and its run-time mode:
  ranges (lo, hi, fa, sa), every tile masked."""
  q_lo, q_hi_full, q_hi_sparse = plan
  full, sparse, mix = mode == MODE_FULL, mode == MODE_SPARSE, mode == MODE_MIX
  return [(*_upto(full, q_lo, q_hi_full), True, False),
          (*_upto(sparse, q_lo, q_hi_sparse), False, True),
          (*_upto(mix, q_lo, q_hi_sparse), True, True),
          (*_upto(mix, q_hi_sparse, q_hi_full), True, False)]


def packed_xa_dq_walk(plan, mode, q_start, pair, listed, xa_block: int, block_kv: int, kept,
                      listed_tile):
  """`packed_dq_walk` under the XAttention settings (patterns as `xa_dq_walk`): `Range`s and
  flags. An XA term alone walks positions listed = (first, end) of its query block's kept
  list (the blocks strictly below the diagonal from the one holding the segment start of the
  program's first row on; listed_tile(position) reads one), then the diagonal block from
  kv_lo; a MIX program its causal tiles from kv_lo with both terms, the XA term flagged by
  the tile's kept bit (the per-row masks do the rest: the streaming term's window, every
  row's segment). Listed tiles in [in_lo, in_hi) (wholly inside the rows' segment, before
  their first row, kept) need no mask (`listed_unmasked_steps`); the XA term's diagonal
  tiles are masked."""
  kv_lo, sink_hi, win_lo, causal_hi, in_lo, in_hi, sparse_in_hi = plan
  per_xa = xa_block // block_kv
  first, end = listed
  lo, n = first * per_xa, (end - first) * per_xa
  before, inside = listed_unmasked_steps(in_lo, in_hi, listed_tile(lo), n)
  window = dict(unmasked=(in_lo, sparse_in_hi))
  pieces = {"full": lambda r: [r(kv_lo, causal_hi, unmasked=(in_lo, in_hi))],
            "stream": lambda r: [r(kv_lo, sink_hi, **window),
                                 r(jnp.maximum(win_lo, sink_hi), causal_hi, **window)],
            "xa": lambda r: [r(lo, lo + n, listed=True, unmasked=(lo + before, lo + inside)),
                             r(jnp.maximum(q_start // xa_block * per_xa, kv_lo), causal_hi,
                               unmasked=(in_lo, in_lo))]}
  tests = {"full": lambda j: None, "stream": lambda j: None, "xa": lambda j: kept(j // per_xa)}
  return _xa_terms_walk(mode, pair, pieces, (kv_lo, causal_hi, dict(unmasked=(in_lo, in_lo))),
                        tests)


def packed_xa_dkv_walk(plan, mode, k_start, pair, above, xa_block: int, block_q: int, kept):
  """`packed_dkv_walk` under the XAttention settings: `Range`s and flags, every tile masked.
  An XA term alone walks the first `above` entries of its key block's column list (the later
  query blocks that kept it, those before its segment's end), then the key block's own query
  tiles up to the segment's end; a MIX program its query tiles [q_lo, q_hi_full) with both
  terms, the XA term flagged by the query block's kept bit."""
  q_lo, q_hi_full, q_hi_sparse = plan
  per_xa = xa_block // block_q
  diagonal_end = jnp.maximum(jnp.minimum((k_start // xa_block + 1) * per_xa, q_hi_full), q_lo)
  pieces = {"full": lambda r: [r(q_lo, q_hi_full)], "stream": lambda r: [r(q_lo, q_hi_sparse)],
            "xa": lambda r: [r(0, above * per_xa, listed=True), r(q_lo, diagonal_end)]}
  tests = {"full": lambda i: None, "stream": lambda i: None, "xa": lambda i: kept(i // per_xa)}
  return _xa_terms_walk(mode, pair, pieces, (q_lo, q_hi_full, {}), tests)


def _split(lo, hi, unmasked_lo, unmasked_hi):
  """[lo, hi) as (first, end, masked) pieces in order: masked, unmasked, masked."""
  a = jnp.clip(unmasked_lo, lo, hi)
  z = jnp.clip(unmasked_hi, a, hi)
  return [(lo, a, True), (a, z, False), (z, hi, True)]


def _dq_kernel(*refs, groups, num_kv_heads, streaming: Streaming, tiles: Tiles, scale,
               num_q_tiles, interpret, packed: bool, xa: XATerms | None = None):
  """dQ of one program: `rows` query rows of one or two query heads (as the forward).
  Unpacked rows: refs (modes [B*K], gates [B*K], q, k, v, dO, row terms, dq, scratch), under
  the XAttention settings (`xa`) with the row lists of `common.xa_operands` (index, count,
  keep; flattened) after the gates; packed: (modes [B*K*nq], the plan's seven fields [B*K*nq]
  each, q, k, v, dO, row terms with the per-row gate as a fifth, bounds [B, 3, Tp], dq,
  scratch), under the XAttention settings with (index, count, keep, each program's first
  listed position [B*K*nq]) after the plan."""
  xa_refs = None
  if packed:
    modes_ref, *plan_refs = refs[:8]
    rest = refs[8:]
    if xa is not None:
      xa_refs, rest = rest[:4], rest[4:]
    q_ref, k_ref, v_ref, do_ref, rows_ref, bounds_ref, dq_ref, scoped = rest
  elif xa is not None:
    modes_ref, gate_ref, *xa_refs, q_ref, k_ref, v_ref, do_ref, rows_ref, dq_ref, scoped = refs
  else:
    modes_ref, gate_ref, q_ref, k_ref, v_ref, do_ref, rows_ref, dq_ref, scoped = refs
  (q_smem2, do_smem2, rows_smem2, bounds_smem2, k_smem, v_smem, ds_smem2), ready, (
      k_ready, v_ready), (k_free, v_free) = scoped
  block_q, block_kv, slots = tiles.dq_block_q, tiles.dq_block_kv, tiles.backward_slots
  pair_heads = groups >= 2
  rows = _dq_rows(groups, tiles)
  head_dim = q_ref.shape[-1]
  dtype = q_ref.dtype
  n_terms = rows_ref.shape[2]

  b = lax.axis_index("b")
  hp = lax.axis_index("hp")
  qt = num_q_tiles - 1 - lax.axis_index("qt")        # heavy first (light: 3-4% slower)
  wg = lax.axis_index("wg")
  heads_per_program = _COMPUTE_WGS if pair_heads else 1
  kv_head = lax.div(hp * heads_per_program, jnp.int32(groups))
  slot_bk = b * num_kv_heads + kv_head
  q_start = qt * rows
  listed_tile = flags = None
  at = slot_bk * num_q_tiles + qt
  if xa is not None:   # the program's rows lie in query block q_start // xa.block: its row
    index_ref, count_ref, keep_ref, *first_ref = xa_refs
    list_at = slot_bk * xa.num_blocks + q_start // xa.block
    kept = lambda kb: keep_ref[list_at * xa.num_blocks + kb] != 0
    listed_tile = lambda p: kept_list_tile(index_ref, list_at, p, xa.block // block_kv,
                                           xa.num_blocks)
  if packed and xa is None:
    ranges = packed_dq_walk([ref[at] for ref in plan_refs], modes_ref[at])
  elif packed:
    ranges, flags = packed_xa_dq_walk(
        [ref[at] for ref in plan_refs], modes_ref[at], q_start, xa.pair,
        (first_ref[0][at], count_ref[list_at] - 1), xa.block, block_kv, kept, listed_tile)
  elif xa is None:
    r = gate_ref[slot_bk]
    ranges = dq_walk(q_start, rows, modes_ref[slot_bk], streaming, block_kv)
  else:
    r = gate_ref[slot_bk]
    ranges, flags = xa_dq_walk(q_start, rows, modes_ref[slot_bk], streaming, block_kv, xa.pair,
                               count_ref[list_at] - 1, xa.block, kept)
  ranges = _as_ranges(ranges)
  firsts, steps = _offsets(ranges)

  @pl.when(wg < _COMPUTE_WGS)
  def _compute():
    plgpu.set_max_registers(tiles.registers, action="increase")
    q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
    head = hp * heads_per_program + (wg if pair_heads else 0)
    row0 = q_start + (0 if pair_heads else wg * block_q)
    rows_here = pl.ds(row0, block_q)
    plgpu.copy_gmem_to_smem(q_ref.at[b, rows_here, head], q_smem, ready[0].at[wg])
    plgpu.copy_gmem_to_smem(do_ref.at[b, rows_here, head], do_smem, ready[1].at[wg])
    plgpu.copy_gmem_to_smem(rows_ref.at[b, head, :, rows_here], rows_smem2.at[wg],
                            ready[2].at[wg])
    if packed:
      plgpu.copy_gmem_to_smem(bounds_ref.at[b, :, rows_here], bounds_smem2.at[wg],
                              ready[3].at[wg])
    for barrier in ready[:4 if packed else 3]:
      plgpu.barrier_wait(barrier.at[wg])
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    terms = [plgpu.load(rows_smem2.at[wg, x], layout=row_layout) for x in range(n_terms)]
    shape = (block_q, block_kv)
    bcast = lambda v: lax.broadcast_in_dim(v, shape, [0])
    weights = (bcast(terms[4]), 1.0 - bcast(terms[4])) if packed else (r, 1.0 - r)
    if packed:
      bounds = [bcast(plgpu.load(bounds_smem2.at[wg, x], layout=row_layout))
                for x in range(3)]
    c = scale * _LOG2E
    staging = ds_smem2.at[wg] if interpret else None

    def step(j, dq, first, fa, sa, masked, flagged, listed):
      s = first + j
      slot = lax.rem(s, jnp.int32(slots))
      plgpu.barrier_wait(k_ready.at[slot])
      x = _product(q_smem, k_smem.at[slot].transpose((1, 0)), shape) * c
      oks = (None, None)
      if masked:
        row = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA) + row0
        col = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA) + (
            (listed_tile(j) if listed else j) * block_kv)
        oks = _term_masks(_packed_masks(row, col, bounds), xa) if packed else (row >= col,) * 2
      lse = _switched(terms[:2], flags(j) if flagged else None)
      probs = _probs(x, lse, oks, fa, sa, bcast)    # x is dead before dP is live
      plgpu.barrier_wait(v_ready.at[slot])
      dp = _product(do_smem, v_smem.at[slot].transpose((1, 0)), shape)
      plgpu.barrier_arrive(v_free.at[slot])
      _, ds = _dscores(probs, dp, terms[2:4], weights, bcast)
      dq = _mma(dq, ds.astype(dtype), k_smem.at[slot], staging)
      plgpu.barrier_arrive(k_free.at[slot])
      return dq

    dq = plgpu.layout_cast(jnp.full((block_q, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)
    first_masked = row0 // block_kv       # tiles from here hold keys after the first row
    for rg, first in zip(ranges, firsts):
      # Unpacked: the tiles before the diagonal need no mask (listed blocks all precede it);
      # packed: those of the plan's unmasked range (tiles wholly inside the rows' segment,
      # before them).
      split = jnp.clip(first_masked, rg.lo, rg.hi)
      pieces = ((_split(rg.lo, rg.hi, *rg.unmasked) if rg.unmasked is not None else
                 [(rg.lo, rg.hi, True)]) if packed else
                [(rg.lo, rg.hi, False)] if rg.listed else
                [(rg.lo, split, False), (split, rg.hi, True)])
      for a, z, masked in pieces:
        dq = lax.fori_loop(a, z, functools.partial(
            step, first=first - rg.lo, fa=rg.fa, sa=rg.sa, masked=masked,
            flagged=rg.flagged, listed=rg.listed), dq)
    _write_out([(q_smem, dq * scale, dq_ref.at[b, rows_here, head])])   # Q's buffer is free

  pl.when(wg == _COMPUTE_WGS)(functools.partial(
      _dq_producer, (k_ref, k_smem, k_ready), (v_ref, v_smem, v_ready), (k_free, v_free), b=b,
      kv_head=kv_head, ranges=ranges, listed_tile=listed_tile, steps=steps, tiles=tiles))


def _dq_producer(k_parts, v_parts, free, *, b, kv_head, ranges, listed_tile, steps,
                 tiles: Tiles):
  """The dQ kernel's memory warpgroup: the walk's K and V tiles (each part: the operand in
  device memory, its ring in shared memory, the ring's arrival barriers) into the ring, each
  slot refilled once both compute warpgroups released it (`_stream`)."""
  plgpu.set_max_registers(memory_registers(tiles), action="decrease")
  block_kv = tiles.dq_block_kv

  def load(s, slot):
    keys = pl.ds(_ranges_tile(s, ranges, listed_tile) * block_kv, block_kv)
    for src, smem, ready in (k_parts, v_parts):
      plgpu.copy_gmem_to_smem(src.at[b, keys, kv_head], smem.at[slot], ready.at[slot])

  _stream(load, free, steps, tiles.backward_slots)


def _write_out(results):
  """Each (shared-memory buffer, float32 value, device-memory destination): the value cast to
  the buffer's type, stored there, then copied out with the bulk copy engine."""
  for smem, value, _ in results:
    smem[...] = value.astype(smem.dtype)
  plgpu.commit_smem()
  for smem, _, gmem in results:
    plgpu.copy_smem_to_gmem(smem, gmem)
  plgpu.wait_smem_to_gmem(0)


def _stream(load, free, steps, slots: int):
  """The memory warpgroup's loop: fill the ring, then refill each slot once every consumer has
  released it, and observe the last releases so that every barrier phase is consumed."""
  for i in range(slots):
    pl.when(i < steps)(functools.partial(load, jnp.int32(i), i))

  @pl.loop(0, jnp.maximum(steps - slots, 0))
  def _(s):
    slot = lax.rem(s, jnp.int32(slots))
    for barrier in free:
      plgpu.barrier_wait(barrier.at[slot])
    load(s + slots, slot)

  @pl.loop(jnp.maximum(steps - slots, 0), steps)
  def _(s):
    slot = lax.rem(s, jnp.int32(slots))
    for barrier in free:
      plgpu.barrier_wait(barrier.at[slot])


def _dkv_kernel(*refs, groups, num_kv_heads, streaming: Streaming, tiles: Tiles,
                scale, num_q_tiles, interpret, packed: bool, xa: XATerms | None = None):
  """dK and dV of one program: 2 x block_k keys of one KV head, summed over its G query heads.
  Unpacked rows: refs (modes [B*K], gates [B*K], q, k, v, dO, row terms, dk, dv, scratch),
  under the XAttention settings (`xa`) with the column lists (`xa_column_lists`: index,
  count) and `common.xa_operands`'s keep (flattened) after the gates; packed: (modes
  [B*K*nk], the key plan's three fields [B*nk] each, q, k, v, dO, row terms with the per-row
  gate as a fifth, bounds [B, 3, Tp], dk, dv, scratch), under the XAttention settings with
  (index of the column lists, each program's listed count [B*K*nk], keep) after the plan."""
  xa_refs = None
  if packed:
    modes_ref, *plan_refs = refs[:4]
    rest = refs[4:]
    if xa is not None:
      xa_refs, rest = rest[:3], rest[3:]
    q_ref, k_ref, v_ref, do_ref, rows_ref, bounds_ref, dk_ref, dv_ref, scoped = rest
  elif xa is not None:
    (modes_ref, gate_ref, *xa_refs, q_ref, k_ref, v_ref, do_ref, rows_ref, dk_ref, dv_ref,
     scoped) = refs
  else:
    modes_ref, gate_ref, q_ref, k_ref, v_ref, do_ref, rows_ref, dk_ref, dv_ref, scoped = refs
  (k_smem2, v_smem2, q_smem, do_smem, rows_smem, bounds_smem, st_smem2), (k_ready, v_ready), (
      q_ready, do_ready, rows_ready, bounds_ready), q_free = scoped
  block_k, block_q, slots = tiles.dkv_block_k, tiles.dkv_block_q, tiles.backward_slots
  keys = _COMPUTE_WGS * block_k
  head_dim = k_ref.shape[-1]
  dtype = k_ref.dtype

  b = lax.axis_index("b")
  num_k_tiles = k_ref.shape[1] // keys
  kt, kv_head = dkv_program(lax.axis_index("p"), num_kv_heads, num_k_tiles, keys, streaming)
  k_start = kt * keys
  wg = lax.axis_index("wg")
  slot_bk = b * num_kv_heads + kv_head
  listed_tile = flags = None
  at = slot_bk * num_k_tiles + kt
  if xa is not None:   # the program's keys lie in key block k_start // xa.block: its column
    index_ref, count_ref, keep_ref = xa_refs
    key_block = k_start // xa.block
    list_at = slot_bk * xa.num_blocks + key_block
    kept = lambda qb: keep_ref[(slot_bk * xa.num_blocks + qb) * xa.num_blocks + key_block] != 0
    listed_tile = lambda p: kept_list_tile(index_ref, list_at, p, xa.block // block_q,
                                           xa.num_blocks)
  if packed:
    plan = [ref[b * num_k_tiles + kt] for ref in plan_refs]
    if xa is None:
      ranges = packed_dkv_walk(plan, modes_ref[at])
    else:   # count_ref: each program's listed entries, those before its segment's end
      ranges, flags = packed_xa_dkv_walk(plan, modes_ref[at], k_start, xa.pair, count_ref[at],
                                         xa.block, block_q, kept)
  elif xa is None:
    r = gate_ref[slot_bk]
    ranges = dkv_walk(k_start, keys, modes_ref[slot_bk], streaming, block_q, num_q_tiles)
  else:
    r = gate_ref[slot_bk]
    ranges, flags = xa_dkv_walk(k_start, modes_ref[slot_bk], streaming, block_q, num_q_tiles,
                                xa.pair, count_ref[list_at], xa.block, kept)
  ranges = _as_ranges(ranges)
  firsts, per_head = _offsets(ranges)
  steps = groups * per_head

  @pl.when(wg < _COMPUTE_WGS)
  def _compute():
    plgpu.set_max_registers(tiles.registers, action="increase")
    k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
    key0 = k_start + wg * block_k
    mine = pl.ds(key0, block_k)
    plgpu.copy_gmem_to_smem(k_ref.at[b, mine, kv_head], k_smem, k_ready.at[wg])
    plgpu.copy_gmem_to_smem(v_ref.at[b, mine, kv_head], v_smem, v_ready.at[wg])
    plgpu.barrier_wait(k_ready.at[wg])
    plgpu.barrier_wait(v_ready.at[wg])
    shape = (block_k, block_q)
    bcast = lambda v: lax.broadcast_in_dim(v, shape, [1])
    column = plgpu.Layout.WGMMA.reduce(0)
    c = scale * _LOG2E
    staging = st_smem2.at[wg] if interpret else None

    def step(i, carry, first, fa, sa, masked, flagged, listed):
      dk, dv = carry
      s = first + i
      slot = lax.rem(s, jnp.int32(slots))
      load_terms = lambda which: [plgpu.load(rows_smem.at[slot, t], layout=column)
                                  for t in which]
      plgpu.barrier_wait(q_ready.at[slot])
      x = _product(k_smem, q_smem.at[slot].transpose((1, 0)), shape) * c
      oks = (None, None)
      if masked:   # rows are keys, columns queries
        key = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA) + key0
        query = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA) + (
            (listed_tile(i) if listed else i) * block_q)
        if packed:
          plgpu.barrier_wait(bounds_ready.at[slot])
          # The sink and window bounds only where a streaming term runs (registers).
          window = sa and (xa is None or xa.pair[1] == "stream")
          bounds = [bcast(plgpu.load(bounds_smem.at[slot, x], layout=column))
                    if x == 0 or window else None for x in range(3)]
          oks = _term_masks(_packed_masks(query, key, bounds), xa)
        else:
          oks = (query >= key,) * 2
      # P from the scores first, the D terms after dP: fewer live registers at once.
      plgpu.barrier_wait(rows_ready.at[slot])
      lse = _switched(load_terms((0, 1)), flags(i) if flagged else None)
      probs = _probs(x, lse, oks, fa, sa, bcast)
      plgpu.barrier_wait(do_ready.at[slot])
      dp = _product(v_smem, do_smem.at[slot].transpose((1, 0)), shape)
      if packed:
        (gate,) = load_terms((4,))
        weights = (bcast(gate), 1.0 - bcast(gate))
      else:
        weights = (r, 1.0 - r)
      p_mix, ds = _dscores(probs, dp, load_terms((2, 3)), weights, bcast)
      dv = _mma(dv, p_mix.astype(dtype), do_smem.at[slot], staging)
      dk = _mma(dk, ds.astype(dtype), q_smem.at[slot], staging)
      plgpu.barrier_arrive(q_free.at[slot])
      return dk, dv

    zeros = plgpu.layout_cast(jnp.full((block_k, head_dim), 0.0, jnp.float32),
                              plgpu.Layout.WGMMA)
    masked_hi = (key0 + block_k + block_q - 1) // block_q   # query tiles before: diagonal

    def one_head(g, carry):
      for rg, first in zip(ranges, firsts):
        # Packed rows: every visited tile masked (segments end anywhere); unpacked: the
        # query tiles that straddle the diagonal (listed blocks all lie past it).
        split = rg.hi if packed else rg.lo if rg.listed else jnp.clip(masked_hi, rg.lo, rg.hi)
        for a, z, masked in ((rg.lo, split, True), (split, rg.hi, False)):
          carry = lax.fori_loop(a, z, functools.partial(
              step, first=g * per_head + first - rg.lo, fa=rg.fa, sa=rg.sa, masked=masked,
              flagged=rg.flagged, listed=rg.listed), carry)
      return carry

    dk, dv = lax.fori_loop(0, groups, one_head, (zeros, zeros))
    _write_out([(k_smem, dk * scale, dk_ref.at[b, mine, kv_head]),
                (v_smem, dv, dv_ref.at[b, mine, kv_head])])

  pl.when(wg == _COMPUTE_WGS)(functools.partial(
      _dkv_producer, (q_ref, q_smem, q_ready), (rows_ref, rows_smem, rows_ready),
      (bounds_ref, bounds_smem, bounds_ready) if packed else None, (do_ref, do_smem, do_ready),
      q_free, b=b, kv_head=kv_head, groups=groups, per_head=per_head, ranges=ranges,
      listed_tile=listed_tile, steps=steps, tiles=tiles))


def _dkv_producer(q_parts, rows_parts, bounds_parts, do_parts, q_free, *, b, kv_head, groups,
                  per_head, ranges, listed_tile, steps, tiles: Tiles):
  """The dK/dV kernel's memory warpgroup: for each of the KV head's G query heads in turn, the
  walk's Q tiles with their row terms, packed rows' bounds (bounds_parts; None unpacked) and
  dO tiles (each part: the operand in device memory, its ring in shared memory, the ring's
  arrival barriers) into the ring, each slot refilled once both compute warpgroups released
  it (`_stream`)."""
  plgpu.set_max_registers(memory_registers(tiles), action="decrease")
  block_q = tiles.dkv_block_q

  def load(s, slot):
    g = lax.div(s, jnp.maximum(per_head, 1))
    rows = pl.ds(_ranges_tile(s - g * per_head, ranges, listed_tile) * block_q, block_q)
    head = kv_head * groups + g
    (q_ref, q_smem, q_ready), (rows_ref, rows_smem, rows_ready) = q_parts, rows_parts
    plgpu.copy_gmem_to_smem(q_ref.at[b, rows, head], q_smem.at[slot], q_ready.at[slot])
    plgpu.copy_gmem_to_smem(rows_ref.at[b, head, :, rows], rows_smem.at[slot],
                            rows_ready.at[slot])
    if bounds_parts is not None:
      bounds_ref, bounds_smem, bounds_ready = bounds_parts
      plgpu.copy_gmem_to_smem(bounds_ref.at[b, :, rows], bounds_smem.at[slot],
                              bounds_ready.at[slot])
    do_ref, do_smem, do_ready = do_parts
    plgpu.copy_gmem_to_smem(do_ref.at[b, rows, head], do_smem.at[slot], do_ready.at[slot])

  _stream(load, (q_free,), steps, tiles.backward_slots)


def _launch(kernel, scratch, operands, *, out_type, grid, grid_names, interpret):
  """One warp-specialised launch: `kernel(*refs, scoped)` with `scratch` (the run_scoped
  allocations) over `operands`, two compute warpgroups and a memory one per program."""
  def entry(*refs):
    pl.run_scoped(lambda *scoped: kernel(*refs, scoped), *scratch, collective_axes="wg")

  return plgpu.kernel(
      entry, out_type=out_type, grid=grid, grid_names=grid_names,
      num_threads=_COMPUTE_WGS + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      **({"interpret": plgpu.InterpretGPUParams()} if interpret else {}),
  )(*operands)


def dq_call(q, k, v, do, row_terms, modes, gate, *, streaming: Streaming,
            tiles: Tiles, interpret: bool, plan=None, bounds=None, xa=None):
  """dQ [B, Tp, N, H] from padded q, k, v, dO, the row terms [B, N, 4, Tp] float32 (lse_FA,
  lse_SSA, D_FA, D_SSA) and per (batch, KV head) modes int32 and gates float32 [B * K].
  Packed rows: `plan`, the seven q_plan fields of `common.packed_plan` over programs of
  `_dq_rows` rows and KV tiles of dq_block_kv (int32 [B * K * nq] each), `modes` its q_modes
  [B * K * nq], the row terms with each row's gate as a fifth [B, N, 5, Tp], `bounds` [B, 3,
  Tp] int32 (see `_packed_masks`), `gate` unused. XAttention settings: xa = (`XATerms`, the
  row lists (index, count, keep) of `common.xa_operands`; packed rows also each program's
  first listed position [B * K * nq], `packed_xa_dq_walk`)."""
  b, tp, n, d = q.shape
  kh = k.shape[2]
  groups = n // kh
  rows = _dq_rows(groups, tiles)
  dtype = q.dtype
  swz = _swizzled(dtype)
  bq, bkv, slots = tiles.dq_block_q, tiles.dq_block_kv, tiles.backward_slots
  packed = plan is not None
  scratch = (
      (plgpu.SMEM((_COMPUTE_WGS, bq, d), dtype, transforms=swz),
       plgpu.SMEM((_COMPUTE_WGS, bq, d), dtype, transforms=swz),
       plgpu.SMEM((_COMPUTE_WGS, row_terms.shape[2], bq), jnp.float32),
       plgpu.SMEM((_COMPUTE_WGS, 3, bq), jnp.int32) if packed else None,
       plgpu.SMEM((slots, bkv, d), dtype, transforms=swz),
       plgpu.SMEM((slots, bkv, d), dtype, transforms=swz),
       plgpu.SMEM((_COMPUTE_WGS, bq, bkv), dtype, transforms=swz) if interpret else None),
      (plgpu.Barrier(num_barriers=_COMPUTE_WGS),) * 4,
      (plgpu.Barrier(num_barriers=slots),) * 2,
      (plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=slots),) * 2)
  terms, lists = xa if xa is not None else (None, ())
  kernel = functools.partial(_dq_kernel, groups=groups, num_kv_heads=kh, streaming=streaming,
                             tiles=tiles, scale=d ** -0.5, num_q_tiles=tp // rows,
                             interpret=interpret, packed=packed, xa=terms)
  lists = tuple(x.reshape(-1) for x in lists)
  operands = ((modes, *plan, *lists, q, k, v, do, row_terms, bounds) if packed else
              (modes, gate, *lists, q, k, v, do, row_terms))
  return _launch(kernel, scratch, operands, out_type=jax.ShapeDtypeStruct(q.shape, dtype),
                 grid=(n // (_COMPUTE_WGS if groups >= 2 else 1), tp // rows, b),
                 grid_names=("hp", "qt", "b"), interpret=interpret)


def dkv_call(q, k, v, do, row_terms, modes, gate, *, streaming: Streaming,
             tiles: Tiles, interpret: bool, plan=None, bounds=None, xa=None):
  """(dK, dV) [B, Tp, K, H], the G query heads of each KV head summed; operands as `dq_call`,
  packed rows' `plan` the three k_plan fields (q_lo, q_hi_full, q_hi_sparse) over key tiles
  of 2 x dkv_block_k and query tiles of dkv_block_q (int32 [B * nk] each), `modes` its
  k_modes [B * K * nk]. XAttention settings: xa = (`XATerms`, (index, count) of
  `xa_column_lists`, keep of `common.xa_operands`; packed rows: count per program [B * K *
  nk], the column entries before its segment's end, `packed_xa_dkv_walk`)."""
  b, tp, n, d = q.shape
  kh = k.shape[2]
  dtype = q.dtype
  swz = _swizzled(dtype)
  bk, bq, slots = tiles.dkv_block_k, tiles.dkv_block_q, tiles.backward_slots
  packed = plan is not None
  scratch = (
      (plgpu.SMEM((_COMPUTE_WGS, bk, d), dtype, transforms=swz),
       plgpu.SMEM((_COMPUTE_WGS, bk, d), dtype, transforms=swz),
       plgpu.SMEM((slots, bq, d), dtype, transforms=swz),
       plgpu.SMEM((slots, bq, d), dtype, transforms=swz),
       plgpu.SMEM((slots, row_terms.shape[2], bq), jnp.float32),
       plgpu.SMEM((slots, 3, bq), jnp.int32) if packed else None,
       plgpu.SMEM((_COMPUTE_WGS, bk, bq), dtype, transforms=swz) if interpret else None),
      (plgpu.Barrier(num_barriers=_COMPUTE_WGS),) * 2,
      (plgpu.Barrier(num_barriers=slots),) * 4,
      plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=slots))
  terms, lists = xa if xa is not None else (None, ())
  kernel = functools.partial(_dkv_kernel, groups=n // kh, num_kv_heads=kh, streaming=streaming,
                             tiles=tiles, scale=d ** -0.5, num_q_tiles=tp // bq,
                             interpret=interpret, packed=packed, xa=terms)
  lists = tuple(x.reshape(-1) for x in lists)
  operands = ((modes, *plan, *lists, q, k, v, do, row_terms, bounds) if packed else
              (modes, gate, *lists, q, k, v, do, row_terms))
  kv_type = jax.ShapeDtypeStruct(k.shape, dtype)
  # The first grid axis changes slowest as programs start: the programs (key tile, KV head)
  # in `common.dkv_program`'s order, every head's sink tiles first.
  return _launch(kernel, scratch, operands, out_type=(kv_type, kv_type),
                 grid=(kh * (tp // (_COMPUTE_WGS * bk)), b),
                 grid_names=("p", "b"), interpret=interpret)
