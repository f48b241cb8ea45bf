"""Fused hybrid FA/SSA attention for TPUs in Pallas (Mosaic TPU), splash-attention style.

Forward: grid (B, N, query tiles, KV steps). Each KV head's mode (sparse, full, mixed) is
prefetched into scalar memory and drives the K/V index maps: step j of a query tile fetches the
j-th tile that head needs (a streaming head: the sink tiles, then its local window); steps past
the head's last tile repeat that tile's index, so the pipeline issues no new DMA for them, and
the body skips their compute. The online-softmax state lives in VMEM scratch across the KV
steps; a mixed head keeps two (FA and SSA) and writes r * O_FA + (1 - r) * O_SSA.

Training: the forward walks every head's causal tiles and computes both O_FA and O_SSA (the
gate's gradient needs both), updating the SSA state only on the streaming tiles; it keeps O_FA
and O_FA - O_SSA (q's dtype; the difference taken in float32, `common.row_deltas`) and both
log-sum-exps for the backward, which is two kernels:
  dQ      grid (B, N, query tiles, KV steps), K/V index maps on the forward's schedule;
  dK/dV   grid (B, K, KV tiles, G x query steps), the query-side index maps on the transposed
          schedule (`q_schedule`); the G query heads of a KV head accumulate in VMEM scratch.
There a streaming head visits only its sink and window tiles (the SSA term), a full head its
causal tiles (the FA term), and a mixed head its causal tiles, with both terms on the streaming
ones and the FA term alone elsewhere.

Packed rows (segment ids, positions, a gate per row): `make_hybrid(packed=True)`, the same
three kernels driven by `common.packed_plan`'s tile ranges, scalar-prefetched, with every
visited tile masked by segment, causality and position blocks; the XAttention settings:
`make_hybrid(xa=True)` (and packed). The online softmax is `common.online_update`'s, in base e
here (`state_update`).

These kernels have not run on a TPU: they are tested in Pallas TPU interpret mode on CPU
(`interpret=True`), where they must match the reference, and their lowering to Mosaic is
checked (Mosaic's own compiler needs a TPU). Row statistics are [..., T, 1] columns (blocks of
(tile, 1)), so tiles of any multiple of 8 rows are legal. The lane-dense layout splash
attention uses, masking only the diagonal tiles (as the GPU kernel does) and tuning are left
for when a TPU can time them.

Shape letters: B batch, T tokens, N query heads, K KV heads, G = N / K, H head dim.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from elastic_jax.attention.common import (MODE_FULL, MODE_MIX, MODE_SPARSE, deprecated_alias,
                                          kernel_or_reference, modes_from_gate, online_finish,
                                          online_init, online_update, packed_plan, pad_packed,
                                          pad_to, q_tile_range, row_deltas, tile_keywords,
                                          tile_ranges, with_fused_backward, xa_operands)
from elastic_jax.attention.reference import MASK_VALUE, Streaming, split_patterns

_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b
_TN = (((0,), (0,)), ((), ()))  # a.T @ b
_SEMANTICS = ("parallel", "parallel", "parallel", "arbitrary")


@dataclasses.dataclass(frozen=True)
class Tiles:
  """The kernels' tiling: block_q query rows x block_k key rows, multiples of 8 (the TPU
  sublane count; they shrink for short inputs, and under XAttention to the XA block)."""
  block_q: int = 128
  block_k: int = 128


def kv_schedule(mode, qi, j, block_q: int, block_k: int, streaming: Streaming):
  """(KV tile to fetch at step j, number of steps with work) for query tile qi.

  Full and mixed heads walk [0, causal_end); streaming heads walk the sink tiles then the
  window. Past the last needed step the last tile repeats (no new DMA). The dQ pass uses the
  same schedule; the training forward walks every head as a full one.
  """
  sink_end, win_start, causal_end = tile_ranges(qi * block_q, block_q, block_k, streaming)
  lo2 = jnp.maximum(win_start, sink_end)
  sparse = mode == MODE_SPARSE
  n_visit = jnp.where(sparse, sink_end + causal_end - lo2, causal_end)

  def tile(step):
    return jnp.where(sparse & (step >= sink_end), lo2 + step - sink_end, step)

  return jnp.where(j < n_visit, tile(j), tile(n_visit - 1)), n_visit


def q_schedule(mode, kv_tile, step, block_q: int, block_k: int, num_q_tiles: int, groups: int,
               streaming: Streaming):
  """(query head within the group, query tile, steps with work) at `step` of the dK/dV pass.

  Each of the KV head's G query heads in turn walks the query tiles that see `kv_tile`:
  [lo, num_q_tiles) for full and mixed heads, [lo, hi_sparse) for streaming ones
  (`q_tile_range`). Past the last step with work the last (head, tile) repeats (no new DMA).
  """
  lo, hi_sparse = q_tile_range(kv_tile, block_q, block_k, num_q_tiles, streaming)
  per_head = jnp.maximum(jnp.where(mode == MODE_SPARSE, hi_sparse, num_q_tiles) - lo, 1)
  n_work = groups * per_head
  s = jnp.minimum(step, n_work - 1)
  return lax.div(s, per_head), lo + lax.rem(s, per_head), n_work


def _streaming_tile(qi, kv_tile, block_q: int, block_k: int, streaming: Streaming):
  """Whether a streaming head's query tile qi visits KV tile `kv_tile` (given it is causal)."""
  sink_end, win_start, _ = tile_ranges(qi * block_q, block_q, block_k, streaming)
  return (kv_tile < sink_end) | (kv_tile >= jnp.maximum(win_start, sink_end))


def _scores(q, k, qi, kv_tile, *, scale, block_q, block_k, seq_len, streaming: Streaming):
  """scale * q k^T of one (query tile, KV tile) in float32, its causal and streaming masks."""
  s = lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32) * scale
  q_idx = qi * block_q + lax.broadcasted_iota(jnp.int32, s.shape, 0)
  k_idx = kv_tile * block_k + lax.broadcasted_iota(jnp.int32, s.shape, 1)
  causal = (k_idx <= q_idx) & (k_idx < seq_len)
  return s, causal, causal & streaming.allows(q_idx, k_idx)


def _tiles(t: int, block_q: int, block_k: int):
  """Tile sizes for T tokens and the padded length, a multiple of both."""
  # Tiles shrink for short inputs but stay multiples of 8 rows (the TPU sublane count).
  block_q = min(block_q, max(8, -(-t // 8) * 8))
  block_k = min(block_k, max(8, -(-t // 8) * 8))
  return block_q, block_k, t + (-t % math.lcm(block_q, block_k))


def _heads_major(tp: int, *xs):
  """[B, T, N, H] -> [B, N, Tp, H] (zero-padded): each tile a (rows, H) matrix, as TPUs want."""
  return tuple(pad_to(x, 1, tp).transpose(0, 2, 1, 3) for x in xs)


def xa_schedule(slot, qi, j, block_q: int, block_k: int, xa_block: int, num_blocks: int,
                index_ref, count_ref):
  """(KV tile to fetch at step j, steps with work) for an XAttention head's query tile qi:
  the tiles of its kept blocks (`common.xa_operands`' flat lists, the diagonal block last and
  only up to the causal end); past the last step the last tile repeats (no new DMA)."""
  per = xa_block // block_k
  q_block = (qi * block_q) // xa_block
  causal_end = (qi * block_q + block_q + block_k - 1) // block_k
  row = slot * num_blocks + q_block
  n_visit = (count_ref[row] - 1) * per + causal_end - q_block * per
  step = jnp.minimum(j, n_visit - 1)
  return index_ref[row * num_blocks + step // per] * per + step % per, n_visit


def _head_schedule(mode, slot, qi, j, xa_refs, *, block_q, block_k, streaming, train,
                   pair, xa_block, num_blocks):
  """The KV walk of one head: `kv_schedule`, or `xa_schedule` for an XAttention head."""
  tile, n_visit = kv_schedule(MODE_FULL if train else mode, qi, j, block_q, block_k,
                              streaming)
  if "xa" not in pair or train:
    return tile, n_visit
  is_xa = _is_xa_head(mode, pair)
  xa_tile, xa_n = xa_schedule(slot, qi, j, block_q, block_k, xa_block, num_blocks,
                              *xa_refs[:2])
  return jnp.where(is_xa, xa_tile, tile), jnp.where(is_xa, xa_n, n_visit)


def _is_xa_head(mode, pair):
  """Whether a head of this run-time mode reads XAttention's kept blocks alone."""
  return (((mode == MODE_SPARSE) & (pair[1] == "xa"))
          | ((mode == MODE_FULL) & (pair[0] == "xa")))


def _pattern_masks(causal, window, lo_tile, xa_refs, slot, qi, kv_tile, *, block_q, block_k,
                   pair, xa_block, num_blocks):
  """(mask of the r = 1 pattern, mask of the r = 0 one, whether the tile belongs to the r = 0
  pattern's set) of one (query tile, KV tile): FA and SSA, or under an XAttention pattern pair the
  kept blocks in place of either (`xa_refs[2]`: the flat kept-block matrices)."""
  if "xa" not in pair:
    return causal, window, lo_tile
  kept = _kept(xa_refs, slot, qi, kv_tile, block_q=block_q, block_k=block_k,
               xa_block=xa_block, num_blocks=num_blocks)
  hi = causal if pair[0] == "full" else causal & kept
  if pair[1] == "xa":
    return hi, causal & kept, kept
  return hi, window, lo_tile


def _kept(xa_refs, slot, qi, kv_tile, *, block_q, block_k, xa_block, num_blocks):
  """Whether query tile qi's XA block kept KV tile kv_tile's block (a scalar)."""
  row = slot * num_blocks + (qi * block_q) // xa_block
  return xa_refs[2][row * num_blocks + (kv_tile * block_k) // xa_block] != 0


def _xa_prefetch(xa_keep, tp: int, xa_block: int, slots: int):
  """The kept blocks as flat scalar-prefetch operands (index, count, keep) and their block
  count per side (`common.xa_operands`)."""
  num_blocks = max(xa_keep.shape[-1], -(-tp // xa_block))
  return [x.reshape(-1) for x in xa_operands(xa_keep, num_blocks, slots)], num_blocks


def _tile_sizes(t: int, tiles: Tiles, pair, xa_block: int):
  """(block_q, block_k, padded length): `_tiles`, or under an XAttention pattern pair tiles that
  divide the XA block (no shrinking for short inputs: one block then)."""
  if "xa" not in pair:
    return _tiles(t, tiles.block_q, tiles.block_k)
  block_q, block_k = min(tiles.block_q, xa_block), min(tiles.block_k, xa_block)
  if xa_block % block_q or xa_block % block_k:
    raise ValueError(f"XA block {xa_block} is not a multiple of the tiles {block_q}, "
                     f"{block_k}")
  return block_q, block_k, t + (-t % math.lcm(block_q, block_k))


# An online-softmax state in VMEM scratch: refs (m, l, acc), m and l [rows, 1] columns, acc
# [rows, H] float32, carried across a grid's KV steps (the decode kernel's too).


def state_init(*states):
  """Resets online-softmax states (m, l, acc) held in VMEM scratch (`common.online_init`)."""
  for m_ref, l_ref, acc_ref in states:
    acc, m, l = online_init(*acc_ref.shape, column=True)
    m_ref[...], l_ref[...], acc_ref[...] = m, l, acc


def state_update(state, s, ok, v, exp=jnp.exp):
  """One KV tile of scores s (masked by ok) and values v into the state (m, l, acc):
  `common.online_update`, with scores in the base of `exp`."""
  m_ref, l_ref, acc_ref = state
  acc, m, l = online_update((acc_ref[...], m_ref[...], l_ref[...]), s, ok, v, exp=exp,
                            column=True)
  m_ref[...], l_ref[...], acc_ref[...] = m, l, acc


def state_output(state):
  """The state's output acc / l [rows, H] float32 (`common.online_finish`)."""
  m_ref, l_ref, acc_ref = state
  return online_finish((acc_ref[...], m_ref[...], l_ref[...]), column=True)


def _state_finish(out_refs, fa_state, sa_state, mode, r_mixed, train: bool):
  """Writes the mixed output (and in training both outputs and their log-sum-exps) from the
  two states; r_mixed is the gate of a mixed head (every gate in training)."""
  fa, sa = state_output(fa_state), state_output(sa_state)
  if train:
    r = r_mixed
  else:  # the skipped output's state was never updated
    r = jnp.where(mode == MODE_SPARSE, 0.0, jnp.where(mode == MODE_FULL, 1.0, r_mixed))
    fa = jnp.where(mode == MODE_SPARSE, 0.0, fa)
    sa = jnp.where(mode == MODE_FULL, 0.0, sa)
  o_ref = out_refs[0]
  o_ref[...] = (r * fa + (1.0 - r) * sa).astype(o_ref.dtype)
  if train:
    o_fa_ref, o_gap_ref, lse_ref = out_refs[1:]
    o_fa_ref[...] = fa.astype(o_fa_ref.dtype)
    o_gap_ref[...] = (fa - sa).astype(o_gap_ref.dtype)   # the gate's (`row_deltas`)
    # Rows with no visible key (padding only) get a huge log-sum-exp: exp(s - lse) = 0.
    for i, (m, l, _) in enumerate((fa_state, sa_state)):
      lse_ref[i] = jnp.where(l[...] == 0.0, -MASK_VALUE, m[...] + jnp.log(l[...]))


def _forward_kernel(modes_ref, *refs, scale, block_q, block_k, seq_len, num_kv_heads, groups,
                    kv_steps, streaming: Streaming, train: bool, pair=("full", "stream"),
                    xa_block=0, num_blocks=0):
  n_xa = 3 if "xa" in pair else 0
  xa_refs, (gate_ref, q_ref, k_ref, v_ref) = refs[:n_xa], refs[n_xa:n_xa + 4]
  refs = refs[n_xa + 4:]
  out_refs, (m_fa, l_fa, acc_fa, m_sa, l_sa, acc_sa) = refs[:-6], refs[-6:]
  b, h, qi, j = (pl.program_id(i) for i in range(4))
  slot = b * num_kv_heads + h // groups
  mode = modes_ref[slot]

  fa_state, sa_state = (m_fa, l_fa, acc_fa), (m_sa, l_sa, acc_sa)
  pl.when(j == 0)(lambda: state_init(fa_state, sa_state))

  # Training walks every head's causal tiles: all heads need both outputs.
  tile, n_visit = _head_schedule(mode, slot, qi, j, xa_refs, block_q=block_q, block_k=block_k,
                                 streaming=streaming, train=train, pair=pair,
                                 xa_block=xa_block, num_blocks=num_blocks)

  @pl.when(j < n_visit)
  def _visit():
    v = v_ref[...]
    s, causal, window = _scores(q_ref[...], k_ref[...], qi, tile, scale=scale, block_q=block_q,
                                block_k=block_k, seq_len=seq_len, streaming=streaming)

    # Under the XAttention settings the FA state holds the r = 1 pattern and the SSA state
    # the r = 0 one; an XA pattern masks the tiles its head did not keep.
    hi_ok, lo_ok, lo_tile = _pattern_masks(
        causal, window, _streaming_tile(qi, tile, block_q, block_k, streaming), xa_refs, slot,
        qi, tile, block_q=block_q, block_k=block_k, pair=pair, xa_block=xa_block,
        num_blocks=num_blocks)

    @pl.when((mode != MODE_SPARSE) | train)
    def _full():
      state_update(fa_state, s, hi_ok, v)

    # A mixed head's walk also passes tiles outside the window: SSA skips them.
    @pl.when(((mode != MODE_FULL) | train) & lo_tile)
    def _sparse():
      state_update(sa_state, s, lo_ok, v)

  pl.when(j == kv_steps - 1)(
      lambda: _state_finish(out_refs, fa_state, sa_state, mode, gate_ref[slot], train))


def _forward_call(q, k, v, gate_bk, streaming: Streaming, tiles: Tiles, interpret: bool,
                  train: bool, pair=("full", "stream"), xa_keep=None, xa_block: int = 0):
  """The forward kernel on [B, T, N, H] inputs; outputs in the padded [B, N, Tp, ...] layout.
  Under the XAttention settings (`pair` holding "xa"; inference only) the kept blocks
  xa_keep [B, K, nb, nb] are scalar-prefetched as compact lists that drive the K/V index maps
  of the XA heads, like the streaming heads' schedule."""
  b, t, n, d = q.shape
  kh = k.shape[2]
  groups = n // kh
  block_q, block_k, tp = _tile_sizes(t, tiles, pair, xa_block)
  qt, kt, vt = _heads_major(tp, q, k, v)
  gate = gate_bk.astype(jnp.float32).reshape(-1)
  modes = modes_from_gate(gate)
  nq, kv_steps = tp // block_q, tp // block_k
  num_blocks, prefetch = 0, [modes]
  if "xa" in pair:
    xa_ops, num_blocks = _xa_prefetch(xa_keep, tp, xa_block, b * kh)
    prefetch += xa_ops
  sched = dict(block_q=block_q, block_k=block_k, streaming=streaming, train=train,
               pair=pair, xa_block=xa_block, num_blocks=num_blocks)

  def kv_map(bi, hi, qi, j, modes_ref, *xa_refs):
    slot = bi * kh + hi // groups
    tile, _ = _head_schedule(modes_ref[slot], slot, qi, j, xa_refs, **sched)
    return bi, hi // groups, tile, 0

  q_map = lambda bi, hi, qi, j, *prefetched: (bi, hi, qi, 0)
  kernel = functools.partial(
      _forward_kernel, scale=d ** -0.5, block_q=block_q, block_k=block_k, seq_len=t,
      num_kv_heads=kh, groups=groups, kv_steps=kv_steps, streaming=streaming, train=train,
      pair=pair, xa_block=xa_block, num_blocks=num_blocks)
  out_specs = [pl.BlockSpec((None, None, block_q, d), q_map)]
  out_shape = [jax.ShapeDtypeStruct((b, n, tp, d), q.dtype)]
  if train:  # O_FA, O_FA - O_SSA, and the log-sum-exps [B, N, 2, Tp, 1]
    out_specs += [pl.BlockSpec((None, None, block_q, d), q_map)] * 2 + [
        pl.BlockSpec((None, None, 2, block_q, 1), lambda bi, hi, qi, j, *m: (bi, hi, 0, qi, 0))]
    out_shape += [jax.ShapeDtypeStruct((b, n, tp, d), q.dtype)] * 2 + [
        jax.ShapeDtypeStruct((b, n, 2, tp, 1), jnp.float32)]
  scratch = [pltpu.VMEM((block_q, 1), jnp.float32), pltpu.VMEM((block_q, 1), jnp.float32),
             pltpu.VMEM((block_q, d), jnp.float32)] * 2
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=len(prefetch),
          grid=(b, n, nq, kv_steps),
          in_specs=[
              pl.BlockSpec(memory_space=pltpu.SMEM),
              pl.BlockSpec((None, None, block_q, d), q_map),
              pl.BlockSpec((None, None, block_k, d), kv_map),
              pl.BlockSpec((None, None, block_k, d), kv_map),
          ],
          out_specs=out_specs,
          scratch_shapes=scratch),
      out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(dimension_semantics=_SEMANTICS),
      interpret=pltpu.InterpretParams() if interpret else False,
      name="elastic_hybrid_forward_train_tpu" if train else "elastic_hybrid_forward_tpu",
  )(*prefetch, gate, qt, kt, vt)


def _unpad(x_bnth, t):
  return x_bnth.transpose(0, 2, 1, 3)[:, :t]


# The entry points' former keywords (deprecated): block_q and block_k, now `tiles=`.
_tile_keywords = tile_keywords(Tiles(), "block_q", "block_k")


@_tile_keywords
@functools.partial(jax.jit, static_argnames=("streaming", "tiles", "interpret"))
def hybrid_forward(q, k, v, gate_bk, streaming: Streaming, *, tiles: Tiles = Tiles(),
                   interpret: bool = False):
  """The kernel: q [B, T, N, H], k/v [B, T, K, H], gate [B, K] -> [B, T, N, H] (q's dtype)."""
  out, = _forward_call(q, k, v, gate_bk, streaming, tiles, interpret, train=False)
  return _unpad(out, q.shape[1])


@_tile_keywords
@functools.partial(jax.jit, static_argnames=("streaming", "patterns", "xa_block", "tiles",
                                             "interpret"))
def xa_hybrid_forward(q, k, v, gate_bk, xa_keep, streaming: Streaming, *, patterns: str,
                      xa_block: int, tiles: Tiles = Tiles(), interpret: bool = False):
  """The inference kernel under the XAttention settings ("fa-xa", "xa-ssa"): XA heads fetch
  only the tiles of their kept blocks (xa_keep [B, K, nb, nb] bool, blocks of xa_block)."""
  out, = _forward_call(q, k, v, gate_bk, streaming, tiles, interpret, train=False,
                       pair=split_patterns(patterns), xa_keep=xa_keep,
                       xa_block=xa_block)
  return _unpad(out, q.shape[1])


def xa_kernel_applies(xa_block: int) -> bool:
  """The XA mode needs blocks that whole tiles (8-row multiples, at most 128) tile."""
  return xa_block % 8 == 0 and (xa_block <= 128 or xa_block % 128 == 0)


@_tile_keywords
@functools.partial(jax.jit, static_argnames=("streaming", "tiles", "interpret"))
def hybrid_forward_train(q, k, v, gate_bk, streaming: Streaming, *, tiles: Tiles = Tiles(),
                         interpret: bool = False):
  """`hybrid_forward`'s output and the residuals of `hybrid_backward`.

  Residuals: q, k, v, gate [B, K], O_FA and O_FA - O_SSA [B, T, N, H] (q's dtype; the
  difference taken in float32, `common.row_deltas`) and both patterns' log-sum-exps
  [B, N, 2, Tp, 1] float32 (Tp: T padded to the tiles).
  """
  t = q.shape[1]
  out, o_fa, o_gap, lse = _forward_call(q, k, v, gate_bk, streaming, tiles, interpret,
                                       train=True)
  return _unpad(out, t), (q, k, v, gate_bk, _unpad(o_fa, t), _unpad(o_gap, t), lse)


def _backward_terms(s, causal, window, dp, stats, r, use_fa: bool, use_sa: bool):
  """(P, dS / scale) of one tile from the terms in use: P = r P_FA + (1 - r) P_SSA.

  r is None for a head that is FA or SSA alone. stats: [4, rows, 1], the log-sum-exps of FA
  and SSA, then D_FA and D_SSA.
  """
  terms = []
  if use_fa:
    p = jnp.where(causal, jnp.exp(s - stats[0]), 0.0)
    terms.append((p, p * (dp - stats[2]), r))
  if use_sa:
    p = jnp.where(window, jnp.exp(s - stats[1]), 0.0)
    terms.append((p, p * (dp - stats[3]), None if r is None else 1.0 - r))
  if r is None:
    (p, ds, _), = terms
    return p, ds
  return sum(w * p for p, _, w in terms), sum(w * ds for _, ds, w in terms)


def _by_mode(mode, work, streaming_tile, body):
  """Runs body(use_fa, use_sa, mixed) in the branch the head's mode and the tile select.

  A mixed head's tiles outside the streaming set carry the FA term alone.
  """
  mixed = mode == MODE_MIX
  pl.when(work & (mode == MODE_SPARSE))(lambda: body(False, True, False))
  pl.when(work & (mode == MODE_FULL))(lambda: body(True, False, False))
  pl.when(work & mixed & ~streaming_tile)(lambda: body(True, False, True))
  pl.when(work & mixed & streaming_tile)(lambda: body(True, True, True))


def _dq_kernel(modes_ref, *refs, scale, block_q, block_k, seq_len, num_kv_heads, groups,
               kv_steps, streaming: Streaming, pair=("full", "stream"), xa_block=0,
               num_blocks=0):
  n_xa = 3 if "xa" in pair else 0
  xa_refs = refs[:n_xa]
  gate_ref, q_ref, k_ref, v_ref, do_ref, stats_ref, dq_ref, dq_acc = refs[n_xa:]
  b, h, qi, j = (pl.program_id(i) for i in range(4))
  slot = b * num_kv_heads + h // groups
  mode = modes_ref[slot]

  @pl.when(j == 0)
  def _init():
    dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)

  # The forward's walk: an XA head's kept tiles, a streaming head's sink and window, ...
  tile, n_visit = _head_schedule(mode, slot, qi, j, xa_refs, block_q=block_q, block_k=block_k,
                                 streaming=streaming, train=False, pair=pair,
                                 xa_block=xa_block, num_blocks=num_blocks)
  masks = functools.partial(_pattern_masks, xa_refs=xa_refs, slot=slot, qi=qi, kv_tile=tile,
                            block_q=block_q, block_k=block_k, pair=pair,
                            xa_block=xa_block, num_blocks=num_blocks)

  def body(use_fa, use_sa, mixed):
    k = k_ref[...]
    s, causal, window = _scores(q_ref[...], k, qi, tile, scale=scale, block_q=block_q,
                                block_k=block_k, seq_len=seq_len, streaming=streaming)
    hi_ok, lo_ok, _ = masks(causal, window, True)
    dp = lax.dot_general(do_ref[...], v_ref[...], _NT, preferred_element_type=jnp.float32)
    r = gate_ref[slot] if mixed else None
    _, ds = _backward_terms(s, hi_ok, lo_ok, dp, stats_ref[...], r, use_fa, use_sa)
    dq_acc[...] += lax.dot_general(ds.astype(k.dtype), k, _NN,
                                   preferred_element_type=jnp.float32)

  lo_tile = _streaming_tile(qi, tile, block_q, block_k, streaming)
  if pair[1] == "xa":
    lo_tile = _kept(xa_refs, slot, qi, tile, block_q=block_q, block_k=block_k,
                    xa_block=xa_block, num_blocks=num_blocks)
  _by_mode(mode, j < n_visit, lo_tile, body)

  @pl.when(j == kv_steps - 1)
  def _finish():
    dq_ref[...] = (dq_acc[...] * scale).astype(dq_ref.dtype)


def _dkv_kernel(modes_ref, *refs, scale, block_q, block_k, seq_len, num_kv_heads, groups,
                num_q_tiles, streaming: Streaming, pair=("full", "stream"), xa_block=0,
                num_blocks=0):
  n_xa = 3 if "xa" in pair else 0
  xa_refs = refs[:n_xa]
  (gate_ref, q_ref, k_ref, v_ref, do_ref, stats_ref, dk_ref, dv_ref, dk_acc,
   dv_acc) = refs[n_xa:]
  b, kh, ki, step = (pl.program_id(i) for i in range(4))
  slot = b * num_kv_heads + kh
  mode = modes_ref[slot]

  @pl.when(step == 0)
  def _init():
    dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
    dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

  # An XA head walks every causal query tile and works on those whose block kept this one.
  is_xa = _is_xa_head(mode, pair) if n_xa else False
  _, qi, n_work = q_schedule(jnp.where(is_xa, MODE_FULL, mode), ki, step, block_q, block_k,
                             num_q_tiles, groups, streaming)
  _, hi_sparse = q_tile_range(ki, block_q, block_k, num_q_tiles, streaming)
  masks = functools.partial(_pattern_masks, xa_refs=xa_refs, slot=slot, qi=qi, kv_tile=ki,
                            block_q=block_q, block_k=block_k, pair=pair,
                            xa_block=xa_block, num_blocks=num_blocks)

  def body(use_fa, use_sa, mixed):
    q, do = q_ref[...], do_ref[...]
    s, causal, window = _scores(q, k_ref[...], qi, ki, scale=scale, block_q=block_q,
                                block_k=block_k, seq_len=seq_len, streaming=streaming)
    hi_ok, lo_ok, _ = masks(causal, window, True)
    dp = lax.dot_general(do, v_ref[...], _NT, preferred_element_type=jnp.float32)
    r = gate_ref[slot] if mixed else None
    p, ds = _backward_terms(s, hi_ok, lo_ok, dp, stats_ref[...], r, use_fa, use_sa)
    dv_acc[...] += lax.dot_general(p.astype(do.dtype), do, _TN,
                                   preferred_element_type=jnp.float32)
    dk_acc[...] += lax.dot_general(ds.astype(q.dtype), q, _TN,
                                   preferred_element_type=jnp.float32)

  work, lo_tile = step < n_work, qi < hi_sparse
  if n_xa:
    kept = _kept(xa_refs, slot, qi, ki, block_q=block_q, block_k=block_k, xa_block=xa_block,
                 num_blocks=num_blocks)
    work = work & (~is_xa | kept)
    lo_tile = kept if pair[1] == "xa" else lo_tile
  _by_mode(mode, work, lo_tile, body)

  @pl.when(step == groups * num_q_tiles - 1)
  def _finish():
    dk_ref[...] = (dk_acc[...] * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


@_tile_keywords
@functools.partial(jax.jit, static_argnames=("streaming", "tiles", "interpret", "pair",
                                             "xa_block"))
def hybrid_backward(residuals, d_out, streaming: Streaming, *, tiles: Tiles = Tiles(),
                    interpret: bool = False, pair=("full", "stream"), xa_keep=None,
                    xa_block: int = 0):
  """(dq, dk, dv, d_gate) from `hybrid_forward_train`'s residuals and dO [B, T, N, H]; under
  an XAttention setting (`pair`, xa_keep [B, K, nb, nb]) XA heads visit their kept
  blocks."""
  q, k, v, gate_bk, o_fa, o_gap, lse = residuals
  b, t, n, d = q.shape
  kh = k.shape[2]
  groups = n // kh
  block_q, block_k, tp = _tile_sizes(t, tiles, pair, xa_block)
  nq, nk = tp // block_q, tp // block_k
  d_fa, d_sa, d_gate = row_deltas(d_out, o_fa, o_gap, gate_bk)
  # Padded query rows have dO = 0 and D_FA = D_SSA = 0, so they add nothing to dK and dV.
  deltas = pad_to(jnp.stack([d_fa, d_sa], axis=1), 2, tp).transpose(0, 3, 1, 2)[..., None]
  stats = jnp.concatenate([lse, deltas], axis=2)  # [B, N, 4, Tp, 1]
  qt, kt, vt, d_out_t = _heads_major(tp, q, k, v, d_out.astype(q.dtype))
  gate = gate_bk.astype(jnp.float32).reshape(-1)
  modes = modes_from_gate(gate)
  num_blocks, prefetch = 0, [modes]
  if "xa" in pair:
    xa_ops, num_blocks = _xa_prefetch(xa_keep, tp, xa_block, b * kh)
    prefetch += xa_ops
  common = dict(scale=d ** -0.5, block_q=block_q, block_k=block_k, seq_len=t,
                num_kv_heads=kh, groups=groups, streaming=streaming, pair=pair,
                xa_block=xa_block, num_blocks=num_blocks)
  sched = dict(block_q=block_q, block_k=block_k, streaming=streaming, train=False,
               pair=pair, xa_block=xa_block, num_blocks=num_blocks)
  smem = pl.BlockSpec(memory_space=pltpu.SMEM)
  params = dict(compiler_params=pltpu.CompilerParams(dimension_semantics=_SEMANTICS),
                interpret=pltpu.InterpretParams() if interpret else False)

  def kv_map(bi, hi, qi, j, modes_ref, *xa_refs):
    slot = bi * kh + hi // groups
    tile, _ = _head_schedule(modes_ref[slot], slot, qi, j, xa_refs, **sched)
    return bi, hi // groups, tile, 0

  q_map = lambda bi, hi, qi, j, *m: (bi, hi, qi, 0)
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, kv_steps=nk, **common),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=len(prefetch),
          grid=(b, n, nq, nk),
          in_specs=[
              smem,
              pl.BlockSpec((None, None, block_q, d), q_map),
              pl.BlockSpec((None, None, block_k, d), kv_map),
              pl.BlockSpec((None, None, block_k, d), kv_map),
              pl.BlockSpec((None, None, block_q, d), q_map),
              pl.BlockSpec((None, None, 4, block_q, 1),
                           lambda bi, hi, qi, j, *m: (bi, hi, 0, qi, 0)),
          ],
          out_specs=pl.BlockSpec((None, None, block_q, d), q_map),
          scratch_shapes=[pltpu.VMEM((block_q, d), jnp.float32)]),
      out_shape=jax.ShapeDtypeStruct((b, n, tp, d), q.dtype),
      name="elastic_hybrid_backward_dq_tpu", **params,
  )(*prefetch, gate, qt, kt, vt, d_out_t, stats)

  def q_side(bi, hi, kj, step, modes_ref, *xa_refs):
    mode = modes_ref[bi * kh + hi]
    if xa_refs:   # an XA head walks every causal query tile (its kernel skips the unkept)
      mode = jnp.where(_is_xa_head(mode, pair), MODE_FULL, mode)
    g, qi, _ = q_schedule(mode, kj, step, block_q, block_k, nq, groups, streaming)
    return bi, hi * groups + g, qi

  def stats_map_t(*grid_and_modes):
    bi, head, qi = q_side(*grid_and_modes)
    return bi, head, 0, qi, 0

  q_map_t = lambda *a: (*q_side(*a), 0)
  kv_map_t = lambda bi, hi, kj, step, *m: (bi, hi, kj, 0)
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, num_q_tiles=nq, **common),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=len(prefetch),
          grid=(b, kh, nk, groups * nq),
          in_specs=[
              smem,
              pl.BlockSpec((None, None, block_q, d), q_map_t),
              pl.BlockSpec((None, None, block_k, d), kv_map_t),
              pl.BlockSpec((None, None, block_k, d), kv_map_t),
              pl.BlockSpec((None, None, block_q, d), q_map_t),
              pl.BlockSpec((None, None, 4, block_q, 1), stats_map_t),
          ],
          out_specs=[pl.BlockSpec((None, None, block_k, d), kv_map_t)] * 2,
          scratch_shapes=[pltpu.VMEM((block_k, d), jnp.float32)] * 2),
      out_shape=[jax.ShapeDtypeStruct((b, kh, tp, d), k.dtype),
                 jax.ShapeDtypeStruct((b, kh, tp, d), v.dtype)],
      name="elastic_hybrid_backward_dkv_tpu", **params,
  )(*prefetch, gate, qt, kt, vt, d_out_t, stats)
  return _unpad(dq, t), _unpad(dk, t), _unpad(dv, t), d_gate


def _plain_hybrid(tiles: Tiles):
  """`make_hybrid(tiles)`: fused forward, training forward and backward."""
  return with_fused_backward(
      lambda q, k, v, g, streaming, interpret: hybrid_forward(
          q, k, v, g, streaming, interpret=interpret, tiles=tiles),
      lambda q, k, v, g, streaming, interpret: hybrid_forward_train(
          q, k, v, g, streaming, interpret=interpret, tiles=tiles),
      lambda streaming, interpret, res, d_out: hybrid_backward(
          res, d_out, streaming, interpret=interpret, tiles=tiles))


def _xa_hybrid(tiles: Tiles):
  """`make_hybrid(tiles, xa=True)`: the inference forward, and under differentiation the
  training forward (both patterns' outputs of every head) and the dQ / dK-dV kernels, XA
  heads reading their kept blocks."""

  def forward(q, k, v, gate_bk, xa_keep, streaming, patterns, xa_block, interpret):
    return xa_hybrid_forward(q, k, v, gate_bk, xa_keep, streaming, patterns=patterns,
                             xa_block=xa_block, interpret=interpret, tiles=tiles)

  def forward_train(q, k, v, gate_bk, xa_keep, streaming, patterns, xa_block, interpret):
    t = q.shape[1]
    out, o_fa, o_gap, lse = _forward_call(q, k, v, gate_bk, streaming, tiles, interpret,
                                         train=True, pair=split_patterns(patterns),
                                         xa_keep=xa_keep, xa_block=xa_block)
    return _unpad(out, t), ((q, k, v, gate_bk, _unpad(o_fa, t), _unpad(o_gap, t), lse),
                            xa_keep)

  def backward(streaming, patterns, xa_block, interpret, res, d_out):
    residuals, xa_keep = res
    grads = hybrid_backward(residuals, d_out, streaming, interpret=interpret,
                            pair=split_patterns(patterns), xa_keep=xa_keep,
                            xa_block=xa_block, tiles=tiles)
    return (*grads, None)

  return with_fused_backward(forward, forward_train, backward, num_arrays=5, num_static=4)


# ----------------------------------------------------------------------------------------------
# Packed rows: segment ids and positions at run time (`common.packed_plan`'s tile schedule,
# scalar-prefetched). The K/V (or, for dK/dV, query) index maps walk the plan's ranges, so
# tiles of other segments are never fetched; every visited tile is masked by segment,
# causality and (SSA) position blocks; the gate is per row (a tile mixing segments routed
# differently runs both states and mixes them row by row).


_NO_XA = dict(pair=("full", "stream"), xa_block=0, num_blocks=0)


def _packed_kv_schedule(plan, mode, j, train: bool):
  """(KV tile at step j, steps with work, whether the tile is a streaming one) of a query
  tile whose plan is (kv_lo, sink_hi, win_lo, causal_hi)."""
  kv_lo, sink_hi, win_lo, causal_hi = plan
  lo2 = jnp.maximum(win_lo, sink_hi)
  sparse = (mode == MODE_SPARSE) & (not train)
  n_sink = sink_hi - kv_lo
  n_visit = jnp.where(sparse, n_sink + causal_hi - lo2, causal_hi - kv_lo)
  step = jnp.minimum(j, n_visit - 1)
  tile = jnp.where(sparse & (step >= n_sink), lo2 + step - n_sink, kv_lo + step)
  return tile, n_visit, (tile < sink_hi) | (tile >= lo2)


def _packed_query_tile(qplan, qmodes, b, h, qi, j, *, num_q_tiles, num_kv_heads, groups,
                       train: bool):
  """(mode, KV tile at step j, steps with work, streaming tile) of query tile qi of head h:
  the scalar-prefetched plan read once, for the kernels and their index maps alike."""
  base = (b * num_q_tiles + qi) * 8
  mode = qmodes[(b * num_kv_heads + h // groups) * num_q_tiles + qi]
  return (mode, *_packed_kv_schedule(tuple(qplan[base + x] for x in range(4)), mode, j,
                                     train))


def _packed_key_tile(kplan, kmodes, b, h, kj, step, *, num_k_tiles, num_kv_heads, groups):
  """(mode, query head within the group, query tile, steps with work, streaming tile) at
  `step` of KV head h's key tile kj (dK/dV): the plan read once, for kernel and index maps."""
  base = (b * num_k_tiles + kj) * 4
  mode = kmodes[(b * num_kv_heads + h) * num_k_tiles + kj]
  return (mode, *_packed_q_schedule(tuple(kplan[base + x] for x in range(3)), mode, step,
                                    groups))


def _packed_q_schedule(plan, mode, step, groups: int):
  """(query head within the group, query tile, steps with work, whether the query tile sees
  the key tile as a streaming one) at `step` of the dK/dV pass; plan = (q_lo, q_hi_full,
  q_hi_sparse)."""
  q_lo, q_hi_full, q_hi_sparse = plan
  per_head = jnp.maximum(jnp.where(mode == MODE_SPARSE, q_hi_sparse, q_hi_full) - q_lo, 1)
  n_work = groups * per_head
  s = jnp.minimum(step, n_work - 1)
  qi = q_lo + lax.rem(s, per_head)
  return lax.div(s, per_head), qi, n_work, qi < q_hi_sparse


def _packed_scores(q, k, qi, kv_tile, seg_q, pos_q, seg_k, pos_k, *, scale, block_q, block_k,
                   streaming: Streaming):
  """scale * q k^T of one tile of packed rows, its full and SSA masks (seg/pos of the query
  rows as [rows, 1], of the keys as [1, cols])."""
  s = lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32) * scale
  q_idx = qi * block_q + lax.broadcasted_iota(jnp.int32, s.shape, 0)
  k_idx = kv_tile * block_k + lax.broadcasted_iota(jnp.int32, s.shape, 1)
  full = (k_idx <= q_idx) & (seg_k == seg_q)
  return s, full, full & streaming.allows(pos_q, pos_k)


def _packed_patterns(s_full_ssa, lo_tile, xa_refs, b, kv_head, qi, kv_tile, *, num_kv_heads,
                     block_q, block_k, xa):
  """`_packed_scores`' (s, full, ssa) and the tile's streaming flag under the pattern pair:
  (s, r = 1 mask, r = 0 mask, whether the tile belongs to the r = 0 pattern's set)."""
  s, full, ssa = s_full_ssa
  hi, lo, lo_tile = _pattern_masks(full, ssa, lo_tile, xa_refs, b * num_kv_heads + kv_head,
                                   qi, kv_tile, block_q=block_q, block_k=block_k, **xa)
  return s, hi, lo, lo_tile


def _packed_forward_kernel(qplan_ref, qmodes_ref, *refs, scale, block_q, block_k, num_q_tiles,
                           num_kv_heads, groups, kv_steps, streaming: Streaming, train: bool,
                           xa=None):
  xa = xa or _NO_XA
  n_xa = 3 if "xa" in xa["pair"] else 0
  xa_refs = refs[:n_xa]
  seg_q_ref, pos_q_ref, seg_k_ref, pos_k_ref, gate_ref, q_ref, k_ref, v_ref = refs[n_xa:n_xa + 8]
  refs = refs[n_xa + 8:]
  out_refs, (m_fa, l_fa, acc_fa, m_sa, l_sa, acc_sa) = refs[:-6], refs[-6:]
  b, h, qi, j = (pl.program_id(i) for i in range(4))
  mode, tile, n_visit, lo_tile = _packed_query_tile(
      qplan_ref, qmodes_ref, b, h, qi, j, num_q_tiles=num_q_tiles, num_kv_heads=num_kv_heads,
      groups=groups, train=train)

  fa_state, sa_state = (m_fa, l_fa, acc_fa), (m_sa, l_sa, acc_sa)
  pl.when(j == 0)(lambda: state_init(fa_state, sa_state))

  @pl.when(j < n_visit)
  def _visit():
    v = v_ref[...]
    s, full, ssa, lo_ok = _packed_patterns(
        _packed_scores(q_ref[...], k_ref[...], qi, tile, seg_q_ref[...], pos_q_ref[...],
                       seg_k_ref[...], pos_k_ref[...], scale=scale, block_q=block_q,
                       block_k=block_k, streaming=streaming),
        lo_tile, xa_refs, b, h // groups, qi, tile, num_kv_heads=num_kv_heads,
        block_q=block_q, block_k=block_k, xa=xa)

    pl.when((mode != MODE_SPARSE) | train)(lambda: state_update(fa_state, s, full, v))
    pl.when(((mode != MODE_FULL) | train) & lo_ok)(lambda: state_update(sa_state, s, ssa, v))

  pl.when(j == kv_steps - 1)(
      lambda: _state_finish(out_refs, fa_state, sa_state, mode, gate_ref[...], train))


def _packed_operands(q, k, v, gate_btk, segment_ids, positions, streaming, tiles: Tiles,
                     pair=("full", "stream"), xa_block: int = 0):
  """Heads-major padded q, k, v; seg/pos as query columns [B, Tp, 1] and key rows [B, 1, Tp];
  the gate as per-row columns [B, K, Tp, 1]; the plan flattened for scalar prefetch."""
  t = q.shape[1]
  block_q, block_k, tp = _tile_sizes(t, tiles, pair, xa_block)
  qt, kt, vt = _heads_major(tp, q, k, v)
  seg, pos = pad_packed(segment_ids, positions, tp)
  gate = pad_to(gate_btk.astype(jnp.float32), 1, tp)                # [B, Tp, K]
  plan = packed_plan(seg, pos, gate, streaming, block_q, block_k, pair)
  cols = dict(seg_q=seg[..., None], pos_q=pos[..., None], seg_k=seg[:, None], pos_k=pos[:, None],
              gate=gate.transpose(0, 2, 1)[..., None])
  prefetch = [plan[name].reshape(-1) for name in ("q_plan", "q_modes", "k_plan", "k_modes")]
  return (qt, kt, vt), cols, prefetch, (block_q, block_k, tp)


def _packed_specs(block_q, block_k, groups, q_tile, kv_tile, head_of):
  """BlockSpecs of (seg_q, pos_q, seg_k, pos_k, gate) for index maps giving the query tile,
  the key tile and the KV head from the grid and the prefetched plan."""
  col = lambda *a: (a[0], q_tile(*a), 0)
  row = lambda *a: (a[0], 0, kv_tile(*a))
  return [pl.BlockSpec((None, block_q, 1), col), pl.BlockSpec((None, block_q, 1), col),
          pl.BlockSpec((None, 1, block_k), row), pl.BlockSpec((None, 1, block_k), row),
          pl.BlockSpec((None, None, block_q, 1), lambda *a: (a[0], head_of(*a), q_tile(*a), 0))]


def _packed_xa(xa_keep, pair, xa_block: int, tp: int, slots: int):
  """(scalar-prefetch operands, kernel settings) of the XAttention pair (none for FA/SSA)."""
  if "xa" not in pair:
    return [], _NO_XA
  xa_ops, num_blocks = _xa_prefetch(xa_keep, tp, xa_block, slots)
  return xa_ops, dict(pair=pair, xa_block=xa_block, num_blocks=num_blocks)


def _packed_forward_call(q, k, v, gate_btk, segment_ids, positions, streaming, tiles: Tiles,
                         interpret, train, pair=("full", "stream"), xa_keep=None,
                         xa_block: int = 0):
  b, t, n, d = q.shape
  kh = k.shape[2]
  groups = n // kh
  (qt, kt, vt), cols, prefetch, (block_q, block_k, tp) = _packed_operands(
      q, k, v, gate_btk, segment_ids, positions, streaming, tiles, pair, xa_block)
  nq, nk = tp // block_q, tp // block_k
  xa_ops, xa = _packed_xa(xa_keep, pair, xa_block, tp, b * kh)

  def kv_tile(bi, hi, qi, j, qplan, qmodes, *_):
    return _packed_query_tile(qplan, qmodes, bi, hi, qi, j, num_q_tiles=nq, num_kv_heads=kh,
                              groups=groups, train=train)[1]

  q_tile = lambda bi, hi, qi, j, *_: qi
  q_map = lambda bi, hi, qi, j, *_: (bi, hi, qi, 0)
  kv_map = lambda bi, hi, qi, j, *p: (bi, hi // groups, kv_tile(bi, hi, qi, j, *p), 0)
  out_specs = [pl.BlockSpec((None, None, block_q, d), q_map)]
  out_shape = [jax.ShapeDtypeStruct((b, n, tp, d), q.dtype)]
  if train:
    out_specs += [pl.BlockSpec((None, None, block_q, d), q_map)] * 2 + [
        pl.BlockSpec((None, None, 2, block_q, 1), lambda bi, hi, qi, j, *_: (bi, hi, 0, qi, 0))]
    out_shape += [jax.ShapeDtypeStruct((b, n, tp, d), q.dtype)] * 2 + [
        jax.ShapeDtypeStruct((b, n, 2, tp, 1), jnp.float32)]
  scratch = [pltpu.VMEM((block_q, 1), jnp.float32), pltpu.VMEM((block_q, 1), jnp.float32),
             pltpu.VMEM((block_q, d), jnp.float32)] * 2
  kernel = functools.partial(
      _packed_forward_kernel, scale=d ** -0.5, block_q=block_q, block_k=block_k,
      num_q_tiles=nq, num_kv_heads=kh, groups=groups, kv_steps=nk, streaming=streaming,
      train=train, xa=xa)
  out = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2 + len(xa_ops), grid=(b, n, nq, nk),
          in_specs=_packed_specs(block_q, block_k, groups, q_tile, kv_tile,
                                 lambda bi, hi, *_: hi // groups)
          + [pl.BlockSpec((None, None, block_q, d), q_map),
             pl.BlockSpec((None, None, block_k, d), kv_map),
             pl.BlockSpec((None, None, block_k, d), kv_map)],
          out_specs=out_specs, scratch_shapes=scratch),
      out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(dimension_semantics=_SEMANTICS),
      interpret=pltpu.InterpretParams() if interpret else False,
      name="elastic_packed_forward_train_tpu" if train else "elastic_packed_forward_tpu",
  )(*prefetch[:2], *xa_ops, cols["seg_q"], cols["pos_q"], cols["seg_k"], cols["pos_k"],
    cols["gate"], qt, kt, vt)
  return out


def _packed_dq_kernel(qplan_ref, qmodes_ref, *refs, scale, block_q, block_k, num_q_tiles,
                      num_kv_heads, groups, kv_steps, streaming: Streaming, xa=None):
  xa = xa or _NO_XA
  n_xa = 3 if "xa" in xa["pair"] else 0
  xa_refs = refs[:n_xa]
  (seg_q_ref, pos_q_ref, seg_k_ref, pos_k_ref, gate_ref, q_ref, k_ref, v_ref, do_ref, stats_ref,
   dq_ref, dq_acc) = refs[n_xa:]
  b, h, qi, j = (pl.program_id(i) for i in range(4))
  mode, tile, n_visit, lo_tile = _packed_query_tile(
      qplan_ref, qmodes_ref, b, h, qi, j, num_q_tiles=num_q_tiles, num_kv_heads=num_kv_heads,
      groups=groups, train=False)

  @pl.when(j == 0)
  def _init():
    dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)

  def body(use_fa, use_sa, mixed):
    k = k_ref[...]
    s, full, ssa, _ = _packed_patterns(
        _packed_scores(q_ref[...], k, qi, tile, seg_q_ref[...], pos_q_ref[...],
                       seg_k_ref[...], pos_k_ref[...], scale=scale, block_q=block_q,
                       block_k=block_k, streaming=streaming),
        lo_tile, xa_refs, b, h // groups, qi, tile, num_kv_heads=num_kv_heads,
        block_q=block_q, block_k=block_k, xa=xa)
    dp = lax.dot_general(do_ref[...], v_ref[...], _NT, preferred_element_type=jnp.float32)
    _, ds = _backward_terms(s, full, ssa, dp, stats_ref[...], gate_ref[...] if mixed else None,
                            use_fa, use_sa)
    dq_acc[...] += lax.dot_general(ds.astype(k.dtype), k, _NN,
                                   preferred_element_type=jnp.float32)

  _by_mode(mode, j < n_visit, lo_tile, body)

  @pl.when(j == kv_steps - 1)
  def _finish():
    dq_ref[...] = (dq_acc[...] * scale).astype(dq_ref.dtype)


def _packed_dkv_kernel(qplan_ref, qmodes_ref, kplan_ref, kmodes_ref, *refs, scale, block_q,
                       block_k, num_k_tiles, num_kv_heads, groups, streaming: Streaming,
                       steps: int, xa=None):
  xa = xa or _NO_XA
  n_xa = 3 if "xa" in xa["pair"] else 0
  xa_refs = refs[:n_xa]
  (seg_q_ref, pos_q_ref, seg_k_ref, pos_k_ref, gate_ref, q_ref, k_ref, v_ref, do_ref, stats_ref,
   dk_ref, dv_ref, dk_acc, dv_acc) = refs[n_xa:]
  b, h, ki, step = (pl.program_id(i) for i in range(4))
  mode, _, qi, n_work, lo_tile = _packed_key_tile(
      kplan_ref, kmodes_ref, b, h, ki, step, num_k_tiles=num_k_tiles,
      num_kv_heads=num_kv_heads, groups=groups)

  @pl.when(step == 0)
  def _init():
    dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
    dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

  def body(use_fa, use_sa, mixed):
    q, do = q_ref[...], do_ref[...]
    s, full, ssa, _ = _packed_patterns(
        _packed_scores(q, k_ref[...], qi, ki, seg_q_ref[...], pos_q_ref[...], seg_k_ref[...],
                       pos_k_ref[...], scale=scale, block_q=block_q, block_k=block_k,
                       streaming=streaming),
        lo_tile, xa_refs, b, h, qi, ki, num_kv_heads=num_kv_heads, block_q=block_q,
        block_k=block_k, xa=xa)
    dp = lax.dot_general(do, v_ref[...], _NT, preferred_element_type=jnp.float32)
    p, ds = _backward_terms(s, full, ssa, dp, stats_ref[...], gate_ref[...] if mixed else None,
                            use_fa, use_sa)
    dv_acc[...] += lax.dot_general(p.astype(do.dtype), do, _TN,
                                   preferred_element_type=jnp.float32)
    dk_acc[...] += lax.dot_general(ds.astype(q.dtype), q, _TN,
                                   preferred_element_type=jnp.float32)

  _by_mode(mode, step < n_work, lo_tile, body)

  @pl.when(step == steps - 1)
  def _finish():
    dk_ref[...] = (dk_acc[...] * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def _packed_backward(res, d_out, streaming, tiles: Tiles, interpret, pair=("full", "stream"),
                     xa_block: int = 0):
  q, k, v, gate_btk, seg_ids, positions, xa_keep, o_fa, o_gap, lse = res
  b, t, n, d = q.shape
  kh = k.shape[2]
  groups = n // kh
  (qt, kt, vt), cols, prefetch, (block_q, block_k, tp) = _packed_operands(
      q, k, v, gate_btk, seg_ids, positions, streaming, tiles, pair, xa_block)
  nq, nk = tp // block_q, tp // block_k
  xa_ops, xa = _packed_xa(xa_keep, pair, xa_block, tp, b * kh)
  d_fa, d_sa, d_gate = row_deltas(d_out, o_fa, o_gap, gate_btk)
  deltas = pad_to(jnp.stack([d_fa, d_sa], axis=1), 2, tp).transpose(0, 3, 1, 2)[..., None]
  stats = jnp.concatenate([lse, deltas], axis=2)                 # [B, N, 4, Tp, 1]
  d_out_t, = _heads_major(tp, d_out.astype(q.dtype))
  common = dict(scale=d ** -0.5, block_q=block_q, block_k=block_k, num_kv_heads=kh,
                groups=groups, streaming=streaming, xa=xa)
  params = dict(compiler_params=pltpu.CompilerParams(dimension_semantics=_SEMANTICS),
                interpret=pltpu.InterpretParams() if interpret else False)
  operands = (cols["seg_q"], cols["pos_q"], cols["seg_k"], cols["pos_k"], cols["gate"], qt, kt,
              vt, d_out_t, stats)

  def kv_tile(bi, hi, qi, j, qplan, qmodes, *_):
    return _packed_query_tile(qplan, qmodes, bi, hi, qi, j, num_q_tiles=nq, num_kv_heads=kh,
                              groups=groups, train=False)[1]

  q_map = lambda bi, hi, qi, j, *_: (bi, hi, qi, 0)
  kv_map = lambda bi, hi, qi, j, *p: (bi, hi // groups, kv_tile(bi, hi, qi, j, *p), 0)
  dq = pl.pallas_call(
      functools.partial(_packed_dq_kernel, num_q_tiles=nq, kv_steps=nk, **common),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2 + len(xa_ops), grid=(b, n, nq, nk),
          in_specs=_packed_specs(block_q, block_k, groups, lambda bi, hi, qi, j, *_: qi,
                                 kv_tile, lambda bi, hi, *_: hi // groups)
          + [pl.BlockSpec((None, None, block_q, d), q_map),
             pl.BlockSpec((None, None, block_k, d), kv_map),
             pl.BlockSpec((None, None, block_k, d), kv_map),
             pl.BlockSpec((None, None, block_q, d), q_map),
             pl.BlockSpec((None, None, 4, block_q, 1),
                          lambda bi, hi, qi, j, *_: (bi, hi, 0, qi, 0))],
          out_specs=pl.BlockSpec((None, None, block_q, d), q_map),
          scratch_shapes=[pltpu.VMEM((block_q, d), jnp.float32)]),
      out_shape=jax.ShapeDtypeStruct((b, n, tp, d), q.dtype),
      name="elastic_packed_backward_dq_tpu", **params,
  )(*prefetch[:2], *xa_ops, *operands)

  def q_side(bi, hi, kj, step, qplan, qmodes, kplan, kmodes, *_):
    _, g, qi, _, _ = _packed_key_tile(kplan, kmodes, bi, hi, kj, step, num_k_tiles=nk,
                                      num_kv_heads=kh, groups=groups)
    return hi * groups + g, qi

  q_tile_t = lambda *a: q_side(*a)[1]
  q_map_t = lambda bi, hi, kj, step, *p: (bi, *q_side(bi, hi, kj, step, *p), 0)
  kv_map_t = lambda bi, hi, kj, step, *_: (bi, hi, kj, 0)
  stats_map_t = lambda bi, hi, kj, step, *p: (bi, q_side(bi, hi, kj, step, *p)[0], 0,
                                              q_side(bi, hi, kj, step, *p)[1], 0)
  steps = groups * nq
  dk, dv = pl.pallas_call(
      functools.partial(_packed_dkv_kernel, num_k_tiles=nk, steps=steps, **common),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=4 + len(xa_ops), grid=(b, kh, nk, steps),
          in_specs=_packed_specs(block_q, block_k, groups, q_tile_t,
                                 lambda bi, hi, kj, *_: kj, lambda bi, hi, *_: hi)
          + [pl.BlockSpec((None, None, block_q, d), q_map_t),
             pl.BlockSpec((None, None, block_k, d), kv_map_t),
             pl.BlockSpec((None, None, block_k, d), kv_map_t),
             pl.BlockSpec((None, None, block_q, d), q_map_t),
             pl.BlockSpec((None, None, 4, block_q, 1), stats_map_t)],
          out_specs=[pl.BlockSpec((None, None, block_k, d), kv_map_t)] * 2,
          scratch_shapes=[pltpu.VMEM((block_k, d), jnp.float32)] * 2),
      out_shape=[jax.ShapeDtypeStruct((b, kh, tp, d), k.dtype),
                 jax.ShapeDtypeStruct((b, kh, tp, d), v.dtype)],
      name="elastic_packed_backward_dkv_tpu", **params,
  )(*prefetch, *xa_ops, *operands)
  return _unpad(dq, t), _unpad(dk, t), _unpad(dv, t), d_gate


def _packed_hybrid(tiles: Tiles, xa: bool):
  """`make_hybrid(tiles, packed=True, xa=xa)`: the kernels of packed rows."""

  def settings(args):
    if not xa:
      return None, args[-2], ("full", "stream"), 0, args[-1]
    xa_keep, streaming, patterns, xa_block, interpret = args
    return xa_keep, streaming, split_patterns(patterns), xa_block, interpret

  def forward(q, k, v, gate_btk, seg_ids, positions, *args):
    xa_keep, streaming, pair, xa_block, interpret = settings(args)
    out = _packed_forward_call(q, k, v, gate_btk, seg_ids, positions, streaming, tiles,
                               interpret, train=False, pair=pair, xa_keep=xa_keep,
                               xa_block=xa_block)
    return _unpad(out[0], q.shape[1])

  def forward_train(q, k, v, gate_btk, seg_ids, positions, *args):
    xa_keep, streaming, pair, xa_block, interpret = settings(args)
    t = q.shape[1]
    out, o_fa, o_gap, lse = _packed_forward_call(q, k, v, gate_btk, seg_ids, positions,
                                                 streaming, tiles, interpret, train=True,
                                                 pair=pair, xa_keep=xa_keep,
                                                 xa_block=xa_block)
    return _unpad(out, t), (q, k, v, gate_btk, seg_ids, positions, xa_keep, _unpad(o_fa, t),
                            _unpad(o_gap, t), lse)

  def backward(*args):
    *static, res, d_out = args
    _, streaming, pair, xa_block, interpret = settings((None, *static))
    dq, dk, dv, d_gate = _packed_backward(res, d_out, streaming, tiles, interpret, pair,
                                          xa_block)
    zero = lambda x: np.zeros(x.shape, jax.dtypes.float0)
    return (dq, dk, dv, d_gate, zero(res[4]), zero(res[5])) + ((zero(res[6]),) if xa else ())

  return with_fused_backward(forward, forward_train, backward, num_arrays=7 if xa else 6,
                             num_static=4 if xa else 2)


# ----------------------------------------------------------------------------------------------
# The builder: one for every kernel kind, packed rows and the XAttention settings as arguments


@functools.cache
def make_hybrid(tiles: Tiles = Tiles(), *, packed: bool = False, xa: bool = False):
  """The kernels on these tiles as one differentiable function (in q, k, v and the gate):

    fn(q, k, v, gate_bk, streaming, interpret)                          unpacked rows;
    fn(q, k, v, gate_bk, xa_keep, streaming, patterns, xa_block, interpret)    xa;
    fn(q, k, v, gate_btk, segment_ids, positions, streaming, interpret)        packed;
    fn(q, k, v, gate_btk, segment_ids, positions, xa_keep, streaming, patterns, xa_block,
       interpret)                                                      packed and xa.

  gate_bk [B, K]; gate_btk [B, T, K] (constant within a segment). XAttention ("fa-xa",
  "xa-ssa"): xa_keep [B, K, nb, nb] bool, the kept blocks of `xa_block` tokens; an XA head of
  unpacked rows fetches only its kept blocks' tiles, one of packed rows visits the full head's
  tiles of its segment and masks in its kept blocks. One function per setting (cached)."""
  if packed:
    return _packed_hybrid(tiles, xa)
  return _xa_hybrid(tiles) if xa else _plain_hybrid(tiles)


fused_hybrid = deprecated_alias(
    "pallas_tpu.fused_hybrid(block_q, block_k)",
    "pallas_tpu.make_hybrid(Tiles(block_q, block_k))",
    lambda block_q=128, block_k=128: make_hybrid(Tiles(block_q, block_k)))
fused_xa_hybrid = deprecated_alias(
    "pallas_tpu.fused_xa_hybrid(block_q, block_k)",
    "pallas_tpu.make_hybrid(Tiles(block_q, block_k), xa=True)",
    lambda block_q=128, block_k=128: make_hybrid(Tiles(block_q, block_k), xa=True))
fused_packed_hybrid = deprecated_alias(
    "pallas_tpu.fused_packed_hybrid(block_q, block_k, xa)",
    "pallas_tpu.make_hybrid(Tiles(block_q, block_k), packed=True, xa=xa)",
    lambda block_q=128, block_k=128, xa=False: make_hybrid(Tiles(block_q, block_k),
                                                           packed=True, xa=xa))

hybrid_attention = functools.partial(kernel_or_reference, make_hybrid(),
                                     xa_kernel=make_hybrid(xa=True),
                                     xa_kernel_applies=xa_kernel_applies,
                                     packed_kernel=make_hybrid(packed=True),
                                     packed_xa_kernel=make_hybrid(packed=True, xa=True))
