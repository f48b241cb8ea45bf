"""What the fused hybrid kernels share: run-time head modes, the tile schedules of a streaming
head (forward and transposed), the online softmax, the backward pass's row terms, the wrapper
that makes the kernels one differentiable function with the reference's signature, and the
shims that keep the builders' and entry points' former names and keywords working."""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Callable

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

from elastic_jax.attention.patterns import Mode
from elastic_jax.attention.reference import (MASK_VALUE, Streaming, check_shapes,
                                             hybrid_attention as reference_hybrid)
from elastic_jax.attention.xattention import block_lists

# The kernels' run-time modes (`patterns.Mode`) as plain ints, the constants inside the kernels.
MODE_SPARSE, MODE_FULL, MODE_MIX = int(Mode.SPARSE), int(Mode.FULL), int(Mode.MIX)
LOG2E = math.log2(math.e)   # exp(x) = exp2(x * LOG2E): base-2 kernels scale scores by it


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


def dkv_program(p, num_kv_heads: int, num_tiles: int, keys: int, streaming: Streaming):
  """Program p (int32, 0 .. num_kv_heads * num_tiles - 1) of a dK/dV launch over key tiles of
  `keys` keys -> (key tile, KV head). First, head after head, every head's tiles that hold
  sink keys (at least one): a streaming head's sink keys are seen by every later query, and a
  full head's first tiles by the most. Then head by head the rest, heaviest first. Started in
  this order, no heavy program is left to run alone at the end, and the programs running at
  once read the queries of few heads (measured against the two plain orders in
  benchmarks/README.md)."""
  first = min(max(1, -(-streaming.sink_blocks * streaming.block // keys)), num_tiles)
  early = np.int32(num_kv_heads * first)
  late = np.int32(max(num_tiles - first, 1))
  kh = np.int32(num_kv_heads)
  in_early = p < early
  rest = jnp.where(in_early, 0, p - early)
  return (jnp.where(in_early, lax.div(p, kh), first + lax.rem(rest, late)),
          jnp.where(in_early, lax.rem(p, kh), lax.div(rest, late)))


def row_deltas(d_out, o_fa, o_gap, gate):
  """Per-row terms of the backward pass and the gate's gradient.

  With O = r * O_FA + (1 - r) * O_SSA: D_FA = rowsum(dO * O_FA) and D_SSA = rowsum(dO * O_SSA),
  float32 [B, T, N]; dL/dr = D_FA - D_SSA summed over the KV head's query heads and, for a
  gate per (batch, KV head) [B, K], over the rows too; for a gate per row [B, T, K] (packed
  rows) it stays per row.

  The kernels' training forwards hand over O_FA and o_gap = O_FA - O_SSA, the difference taken
  in float32 before it is rounded: dL/dr is rowsum(dO * o_gap), and D_SSA = D_FA minus it.
  Taken from two rounded outputs instead, the difference keeps only the rounding's noise where
  the two patterns nearly agree (XA with most blocks kept), and so would the gate's gradient.
  """
  b, t, n, _ = d_out.shape
  kh = gate.shape[-1]
  up = lambda x: x.astype(jnp.float32)
  d_fa = jnp.einsum("btnd,btnd->btn", up(d_out), up(o_fa))
  d_gap = jnp.einsum("btnd,btnd->btn", up(d_out), up(o_gap))
  d_gate = d_gap.reshape(b, t, kh, n // kh).sum(axis=3)
  if gate.ndim == 2:
    d_gate = d_gate.sum(axis=1)
  return d_fa, d_fa - d_gap, d_gate.astype(gate.dtype)


def with_fused_backward(forward: Callable, forward_train: Callable, backward: Callable,
                        num_arrays: int = 4, num_static: int = 2) -> Callable:
  """A differentiable `fn(q, k, v, gate, ..., streaming, interpret)` made of kernels: the first
  `num_arrays` arguments are arrays (4: q, k, v and the gate; 6 for packed rows, with segment
  ids and positions, whose cotangents are float0 zeros; 7 with XAttention's kept blocks), the
  last `num_static` static (streaming and interpret; with XAttention also the patterns and
  the block).

  `forward(*args)` -> O serves undifferentiated calls (sparse heads skip their far tiles).
  Under differentiation `forward_train(*args)` -> (O, residuals) computes O_FA and O_SSA of
  every head in one pass (the gate's gradient needs both), and `backward(*static,
  residuals, dO)` -> the arrays' cotangents (dq, dk, dv, d_gate, ...).
  """

  @functools.partial(jax.custom_vjp,
                     nondiff_argnums=tuple(range(num_arrays, num_arrays + num_static)))
  def fn(*args):
    return forward(*args)

  fn.defvjp(forward_train, backward)

  def checked(*args):
    check_kernel_call(args, num_arrays)
    return fn(*args)

  return checked


def check_kernel_call(args, num_arrays: int) -> None:
  """One ValueError sentence for a kernel call whose arrays do not fit together: the shapes as
  `reference.check_shapes` asks them (the gate [B, K] on unpacked rows, [B, T, K] on packed
  ones: 6 or 7 arrays, with segment ids and positions; kept XA blocks with 5 or 7 arrays, the
  XA block the static argument after the patterns), q, k and v of one floating dtype, integer
  segment ids and positions."""
  q, k, v, gate = args[:4]
  packed, xa = num_arrays >= 6, num_arrays in (5, 7)
  seg, pos = args[4:6] if packed else (None, None)
  check_shapes(q, k, v, gate, seg, pos, args[num_arrays - 1] if xa else None,
               args[num_arrays + 2] if xa else 128, gate_per_token=packed)
  if not (q.dtype == k.dtype == v.dtype and jnp.issubdtype(q.dtype, jnp.floating)):
    raise ValueError(f"q, k and v must share one floating dtype, got {q.dtype}, {k.dtype} "
                     f"and {v.dtype}")
  for name, x in (("segment ids", seg), ("positions", pos)):
    if x is not None and not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"the {name} are {x.dtype}; integers expected")


def xa_operands(xa_keep, num_blocks: int, slots: int):
  """The kept XAttention blocks [B, K, nb, nb] as the kernels read them: (index, count, keep)
  int32 [slots, nbp, nbp], [slots, nbp], [slots, nbp, nbp], flattened to (batch, KV head)
  slots (padded to `slots`) and to nbp = num_blocks blocks (>= nb; padding keeps nothing).
  index lists each query block's kept blocks first, ascending (`xattention.block_lists`), the
  diagonal block last: blocks above the diagonal are dropped and the diagonal block is always
  kept (XAttention's selection keeps it; the kernels walk a list's last entry masked)."""
  b, kh, nb, _ = xa_keep.shape
  extra = num_blocks - nb
  xa_keep = (xa_keep & jnp.tri(nb, dtype=bool)[None, None]) | jnp.eye(nb, dtype=bool)[None, None]
  keep = jnp.pad(xa_keep, ((0, 0), (0, 0), (0, extra), (0, extra))).reshape(
      b * kh, 1, num_blocks, num_blocks)
  index, count = block_lists(keep)
  return tuple(pad_to(x[:, 0].astype(jnp.int32), 0, slots) for x in (index, count, keep))


def kernel_or_reference(kernel: Callable, q_btnh, k_btkh, v_btkh, gate_btk,
                        streaming: Streaming, segment_ids_bt=None, positions_bt=None, *,
                        interpret: bool = False, xa_kernel: Callable | None = None,
                        xa_kernel_applies: Callable[[int], bool] = lambda block: False,
                        packed_kernel: Callable | None = None,
                        packed_xa_kernel: Callable | None = None, **reference_kwargs):
  """`reference.hybrid_attention`'s signature, on `kernel` where it applies.

  `kernel` takes one gate per (batch, KV head) over unpacked rows; packed segments or custom
  positions go to `packed_kernel(q, k, v, gate_btk, segment_ids, positions, streaming,
  interpret)` where the backend has one (missing segment ids: one segment per row; missing
  positions: 0 .. T-1 along the row, as in the reference), else to the reference. The XAttention
  settings ("patterns" and "xa_keep" in the keyword arguments) run on `xa_kernel` (packed rows:
  `packed_xa_kernel(q, k, v, gate_btk, segment_ids, positions, xa_keep, streaming, patterns,
  xa_block, interpret)`) where the backend has one and `xa_kernel_applies` to the block size,
  else on the reference.
  """
  if gate_btk is None:
    gate_btk = jnp.zeros(k_btkh.shape[:3], jnp.float32)
  patterns = reference_kwargs.get("patterns", "fa-ssa")
  xa_block = reference_kwargs.get("xa_block", 128)
  packed = segment_ids_bt is not None or positions_bt is not None
  xa_ok = patterns == "fa-ssa" or xa_kernel_applies(xa_block)
  chosen = (packed_kernel if patterns == "fa-ssa" else packed_xa_kernel) if packed else (
      kernel if patterns == "fa-ssa" else xa_kernel)
  if chosen is None or not xa_ok:
    return reference_hybrid(q_btnh, k_btkh, v_btkh, gate_btk, streaming, segment_ids_bt,
                            positions_bt, **reference_kwargs)
  xa_args = () if patterns == "fa-ssa" else (reference_kwargs["xa_keep"],)
  xa_static = () if patterns == "fa-ssa" else (patterns, xa_block)
  if packed:
    b, t = q_btnh.shape[:2]
    if segment_ids_bt is None:
      segment_ids_bt = jnp.ones((b, t), jnp.int32)
    if positions_bt is None:   # the reference's default: 0 .. T-1 along the row
      positions_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    return chosen(q_btnh, k_btkh, v_btkh, gate_btk, segment_ids_bt, positions_bt, *xa_args,
                  streaming, *xa_static, interpret)
  return chosen(q_btnh, k_btkh, v_btkh, gate_btk[:, 0, :], *xa_args, streaming, *xa_static,
                interpret)


# ----------------------------------------------------------------------------------------------
# Packed rows: the tile schedule of segments


def segment_bounds(segment_ids_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(start, end) int32 [B, T]: the first index and one past the last of the run of equal
  segment ids holding each token (segments are contiguous runs)."""
  b, t = segment_ids_bt.shape
  idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  first = jnp.concatenate([jnp.ones((b, 1), bool),
                           segment_ids_bt[:, 1:] != segment_ids_bt[:, :-1]], axis=1)
  last = jnp.concatenate([segment_ids_bt[:, 1:] != segment_ids_bt[:, :-1],
                          jnp.ones((b, 1), bool)], axis=1)
  start = jax.lax.cummax(jnp.where(first, idx, 0), axis=1)
  end = jax.lax.cummin(jnp.where(last, idx + 1, t), axis=1, reverse=True)
  return start, end


def _mode_of_range(count0, count1, lo, hi):
  """Mode of rows [lo, hi) from prefix counts of r == 0 and r == 1 ([..., T + 1])."""
  n = hi - lo
  zeros = jnp.take_along_axis(count0, hi, -1) - jnp.take_along_axis(count0, lo, -1)
  ones = jnp.take_along_axis(count1, hi, -1) - jnp.take_along_axis(count1, lo, -1)
  return jnp.where(zeros == n, MODE_SPARSE, jnp.where(ones == n, MODE_FULL, MODE_MIX)).astype(
      jnp.int32)


def packed_plan(segment_ids_bt, positions_bt, gate_btk, streaming: Streaming, block_q: int,
                block_k: int, pair: tuple[str, str] = ("full", "stream")):
  """The tile schedule of packed rows (T a multiple of both tiles; pad rows as a segment).

  Returns a dict of int32 arrays:
    q_plan [B, nq, 8]: per query tile, the key tiles it visits: [kv_lo, causal_hi) for a full
      head; [kv_lo, sink_hi) then [win_lo, causal_hi) for a streaming one. kv_lo is the tile
      holding the segment start of the tile's first row: tiles of earlier segments are
      skipped, not masked. Rows of later segments in the tile start inside it, so their sink
      and window lie in [win_lo, causal_hi). Then [in_lo, in_hi) and [in_lo, sparse_in_hi):
      the visited tiles that need no mask, for a full and a streaming head; the last entry
      is 0.
    k_plan [B, nk, 4]: per key tile, the query tiles that see it (the transpose, for dK/dV):
      [q_lo, q_hi_full) full heads, [q_lo, q_hi_sparse) streaming ones (a sink key is seen
      to its segment's end, another one as far as the window reaches); the last entry is 0.
    q_modes [B, K, nq], k_modes [B, K, nk]: each tile's run-time mode from the gates of the
      query rows it serves (MODE_MIX when they differ).
  Streaming ranges assume positions that count 0, 1, ... from each segment's start; a tile
  of any segment whose positions do not gets the full range, masked (correct, not fast).
  Every visited tile is masked by segment, causality and (streaming) positions in the kernel,
  so a schedule only has to be a superset of the tiles that hold visible keys.
  pair: the pattern pair (`reference.split_patterns`); an XAttention pattern visits the full
  head's ranges (the kept blocks are masked in) and has no unmasked tiles: with ("full",
  "xa") a streaming head's ranges become the full one's.
  """
  b, t = segment_ids_bt.shape
  if t % block_q or t % block_k:
    raise ValueError(f"packed_plan: T = {t} must be a multiple of the tiles {block_q}, "
                     f"{block_k}")
  nq, nk = t // block_q, t // block_k
  idx = jnp.arange(t, dtype=jnp.int32)
  start, end = segment_bounds(segment_ids_bt)
  pos = positions_bt.astype(jnp.int32)
  bad = (pos != idx[None] - start).astype(jnp.int32)
  bad_prefix = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), jnp.cumsum(bad, axis=1)], axis=1)
  seg_bad = (jnp.take_along_axis(bad_prefix, end, 1)
             - jnp.take_along_axis(bad_prefix, start, 1)) > 0            # [B, T]
  blk, sink_tok = streaming.block, streaming.sink_blocks * streaming.block

  # Query tiles.
  first = jnp.arange(nq, dtype=jnp.int32) * block_q
  s0 = start[:, first]                                                   # [B, nq]
  e0 = end[:, first]
  causal_hi = jnp.broadcast_to(-(-(first + block_q) // block_k), (b, nq)).astype(jnp.int32)
  kv_lo = s0 // block_k
  sink_hi = jnp.minimum(-(-jnp.minimum(s0 + sink_tok, e0) // block_k), causal_hi)
  sink_hi = kv_lo if sink_tok == 0 else jnp.maximum(sink_hi, kv_lo)
  p0 = first[None] - s0
  win_lo = (s0 + jnp.maximum(p0 // blk - streaming.local_blocks + 1, 0) * blk) // block_k
  tile_bad = seg_bad.reshape(b, nq, block_q).any(-1)
  sink_hi = jnp.where(tile_bad, kv_lo, sink_hi)
  win_lo = jnp.where(tile_bad, kv_lo, jnp.maximum(win_lo, kv_lo))
  # Tiles that need no mask: wholly inside the segment, before the query tile, when the query
  # tile holds one segment: [in_lo, in_hi) for a full head. A streaming head's visited tiles
  # there need none either when SSA blocks, counted from the segment's start, hold whole tiles
  # and the query tile lies in one block (the segment starts on a tile boundary).
  single = start[:, first + block_q - 1] == s0
  in_lo = -(-s0 // block_k)
  in_hi = jnp.where(single, jnp.maximum(first[None] // block_k, in_lo), in_lo)
  grid_ok = blk % block_q == 0 and blk % block_k == 0 and sink_tok % block_k == 0
  sparse_in_hi = jnp.where(single & ~tile_bad & (s0 % max(block_q, block_k) == 0) & grid_ok,
                           in_hi, in_lo)
  if pair[0] == "xa":
    in_hi = in_lo
  if pair[1] == "xa":
    sink_hi, sparse_in_hi = causal_hi, in_lo
  q_plan = jnp.stack([kv_lo, sink_hi, win_lo, causal_hi, in_lo, in_hi, sparse_in_hi,
                      jnp.zeros_like(kv_lo)], axis=-1).astype(jnp.int32)

  # Key tiles (transposed): reach = one past the last query index that may see a key.
  reach_full = end
  window_end = start + (pos // blk + streaming.local_blocks) * blk
  reach_sparse = jnp.where((pos < sink_tok) | seg_bad, end, jnp.minimum(window_end, end))
  key_first = jnp.arange(nk, dtype=jnp.int32) * block_k
  q_lo = jnp.broadcast_to(key_first // block_q, (b, nk)).astype(jnp.int32)
  tile_max = lambda x: x.reshape(b, nk, block_k).max(-1)
  q_hi_full = jnp.maximum(-(-tile_max(reach_full) // block_q), q_lo)
  q_hi_sparse = jnp.clip(-(-tile_max(reach_sparse) // block_q), q_lo, q_hi_full)
  if pair[1] == "xa":
    q_hi_sparse = q_hi_full
  k_plan = jnp.stack([q_lo, q_hi_full, q_hi_sparse, jnp.zeros_like(q_lo)], axis=-1).astype(
      jnp.int32)

  # Modes from the gates of the rows each tile serves.
  g = gate_btk.astype(jnp.float32).transpose(0, 2, 1)                    # [B, K, T]
  pre = lambda m: jnp.concatenate([jnp.zeros(m.shape[:2] + (1,), jnp.int32),
                                   jnp.cumsum(m.astype(jnp.int32), -1)], -1)
  c0, c1 = pre(g <= 0.0), pre(g >= 1.0)
  kh = g.shape[1]
  rows = lambda x: jnp.broadcast_to(x[:, None], (b, kh) + x.shape[1:])
  q_modes = _mode_of_range(c0, c1, rows(jnp.broadcast_to(first, (b, nq))),
                           rows(jnp.broadcast_to(first + block_q, (b, nq))))
  k_modes = _mode_of_range(c0, c1, rows(q_lo * block_q), rows(q_hi_full * block_q))
  return {"q_plan": q_plan, "k_plan": k_plan, "q_modes": q_modes, "k_modes": k_modes}


def pad_packed(segment_ids_bt, positions_bt, tp: int):
  """Segment ids and positions padded to Tp tokens: the padding is one more segment (id -1)
  counting its own positions, so it costs its own tiles and no real row sees it."""
  t = segment_ids_bt.shape[1]
  extra = tp - t
  seg = jnp.pad(segment_ids_bt.astype(jnp.int32), ((0, 0), (0, extra)), constant_values=-1)
  pos = jnp.pad(positions_bt.astype(jnp.int32), ((0, 0), (0, extra)))
  if extra:
    pos = pos.at[:, t:].set(jnp.arange(extra, dtype=jnp.int32)[None])
  return seg, pos


def largest_block(n: int, cap: int) -> int:
  """The largest power-of-two block <= cap dividing n (16 at least)."""
  b = cap
  while b > 16 and n % b:
    b //= 2
  return b


# ----------------------------------------------------------------------------------------------
# The online softmax, one key tile at a time (the Pallas kernels' forward walks and decode)
#
# A state is (acc, m, l): the unnormalised output [rows, H] float32, the running maximum of the
# scores and the running sum of their exponentials. m and l are [rows] vectors, or [rows, 1]
# columns (`column`; the TPU kernels keep them so in VMEM). `exp` is the exponential the scores
# are in: exp2 for scores scaled by LOG2E (the GPU kernels, decode on a TPU), exp for the TPU
# hybrid kernels'.


def online_init(rows: int, width: int, *, column: bool = False):
  """An empty state (acc, m, l): acc zeros [rows, width], m MASK_VALUE, l zeros."""
  stats = (rows, 1) if column else (rows,)
  return (jnp.zeros((rows, width), jnp.float32), jnp.full(stats, MASK_VALUE, jnp.float32),
          jnp.zeros(stats, jnp.float32))


def online_update(carry, s, ok, v, *, exp: Callable = jnp.exp2, column: bool = False,
                  product: Callable | None = None):
  """One key tile into the state `carry`: scores s [rows, cols] float32, ok the entries that
  count (a mask broadcasting against s; None: all of them), values v [cols, H].

  product(p, v) -> [rows, H] float32 weighs the values by the tile's probabilities p; by
  default the matrix product of p in v's dtype with v, float32 accumulation. A single key
  (cols = 1, which a matrix unit does not take) passes an elementwise product instead.
  """
  acc, m, l = carry
  if ok is not None:
    s = jnp.where(ok, s, MASK_VALUE)
  m_new = jnp.maximum(m, s.max(axis=-1, keepdims=column))
  p = exp(s - (m_new if column else m_new[:, None]))
  if ok is not None:
    p = jnp.where(ok, p, 0.0)
  corr = exp(m - m_new)
  pv = (jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32) if product is None
        else product(p, v))
  return (acc * (corr if column else corr[:, None]) + pv, m_new,
          l * corr + p.sum(axis=-1, keepdims=column))


def online_finish(carry, *, column: bool = False):
  """The state's output acc / l [rows, H] float32 (rows that saw no key: 0)."""
  acc, _, l = carry
  l = jnp.where(l == 0.0, 1.0, l)
  return acc / (l if column else l[:, None])


# ----------------------------------------------------------------------------------------------
# Former names and keywords, kept working with a DeprecationWarning


def deprecated_alias(old_call: str, new_call: str, fn: Callable) -> Callable:
  """`fn` under its former name: each call warns (DeprecationWarning) that `old_call` is now
  `new_call`, then returns fn's result. The name is old_call's, up to "(" and after the last
  "."."""
  name = old_call.partition("(")[0].rpartition(".")[2]

  def call(*args, **kwargs):
    warnings.warn(f"{old_call} is deprecated; use {new_call}", DeprecationWarning,
                  stacklevel=2)
    return fn(*args, **kwargs)

  call.__name__ = call.__qualname__ = name
  call.__doc__ = f"Deprecated: `{new_call}`."
  return call


def tile_keywords(default_tiles, *same: str, **renamed: str) -> Callable:
  """A decorator for an entry point that takes `tiles=` (a frozen dataclass, `default_tiles`
  when not given) and once took bare tile sizes: the former keywords still work, with a
  DeprecationWarning naming the `tiles=` they make. `same`: keywords named as the tiles'
  fields; `renamed`: keyword -> the field it sets."""
  fields = {**{key: key for key in same}, **renamed}

  def wrap(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
      old = {key: kwargs.pop(key) for key in fields if key in kwargs}
      if old:
        tiles = dataclasses.replace(kwargs.get("tiles", default_tiles),
                                    **{fields[key]: x for key, x in old.items()})
        warnings.warn(f"{fn.__name__}({', '.join(f'{key}=' for key in old)}...) is "
                      f"deprecated; use {fn.__name__}(..., tiles={tiles!r})",
                      DeprecationWarning, stacklevel=2)
        kwargs["tiles"] = tiles
      return fn(*args, **kwargs)

    return call

  return wrap
