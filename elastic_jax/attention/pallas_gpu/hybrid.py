"""Fused hybrid FA/SSA attention for GPUs in Pallas (Triton backend): one launch for all heads.

Every (query tile, batch, query head) program reads its KV head's mode from a small run-time
array, so one compilation serves every routing:
  SPARSE (r = 0)  visit the sink tiles, then the local window up to the diagonal;
  FULL   (r = 1)  visit every causal tile;
  MIX    (0<r<1)  visit every causal tile, keep two online softmaxes (SSA is a subset of FA)
                  and write r * O_FA + (1 - r) * O_SSA.
A sparse head's far-away tiles are never loaded: that is where the speed-up comes from.

Under differentiation (`make_hybrid`, a custom VJP) the training forward computes O_FA and
O_SSA of every head in one walk over its causal tiles (the gate's gradient, dL/dr = sum dO .
(O_FA - O_SSA), needs both); it keeps O_FA, O_FA - O_SSA (the difference taken in float32,
`common.row_deltas`) and both base-2 log-sum-exps. The backward is two kernels,
FlashAttention-2 style, each reading the modes at run time: dQ per (query tile, head) over the
forward's tile walk, and dK/dV per (key tile, KV head) over the transposed walk
(`common.q_tile_range`), summing the G query heads of the KV head in the program (GQA). Per
tile, dS = r P_FA (dP - D_FA) + (1 - r) P_SSA (dP - D_SSA), with the FA term skipped when r = 0
and the SSA term when r = 1; nothing of size T x T is ever stored. Packed rows (segment ids
and positions) run on `make_hybrid(packed=True)`'s kernels (end of this file), the XAttention
settings on `make_hybrid(xa=True)`'s. Every walk updates its online softmax with
`common.online_update` (base 2: scores scaled by `LOG2E`). Pallas's Triton backend is
deprecated since jax 0.11 (Mosaic GPU is the path to full Hopper speed); these kernels are the
portable version and the interpret-mode test subject.

Shape letters: B batch, T tokens, N query heads, K KV heads, G = N / K, H head dim.
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

from elastic_jax.attention.common import (LOG2E, MODE_FULL, MODE_MIX, MODE_SPARSE,
                                          deprecated_alias, dkv_program, kernel_or_reference,
                                          modes_from_gate, online_finish, online_init,
                                          online_update, pad_to, packed_plan, pad_packed,
                                          q_tile_range, row_deltas, tile_keywords, tile_ranges,
                                          with_fused_backward, xa_operands)
from elastic_jax.attention.reference import Streaming, split_patterns

assert (MODE_SPARSE, MODE_FULL, MODE_MIX) == (0, 1, 2)  # the order of lax.switch below


def _kernel(modes_ref, gate_ref, *refs, scale, block_q, block_k, seq_len, num_kv_heads, groups,
            streaming: Streaming, train: bool, pair=("full", "stream"), xa_block=0):
  if "xa" in pair:
    xa_index_ref, xa_count_ref, xa_keep_ref, q_ref, k_ref, v_ref, *out_refs = refs
  else:
    q_ref, k_ref, v_ref, *out_refs = refs
  qi, b, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  slot = b * num_kv_heads + n // groups
  mode = modes_ref[slot]
  r = gate_ref[slot]
  q = q_ref[...]
  d = q.shape[-1]
  q_start = qi * block_q
  q_idx = q_start + jnp.arange(block_q)
  qk_scale = scale * LOG2E

  def scores(j):
    k = k_ref[pl.ds(j * block_k, block_k), :]
    s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * qk_scale
    k_idx = j * block_k + jnp.arange(block_k)
    causal = (k_idx[None, :] <= q_idx[:, None]) & (k_idx[None, :] < seq_len)
    return s, causal, causal & streaming.allows(q_idx[:, None], k_idx[None, :])

  update, finish = online_update, online_finish
  init = lambda: online_init(block_q, d)

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

  def both(j, c):
    full_c, sparse_c = c
    s, causal, window = scores(j)
    v = v_ref[pl.ds(j * block_k, block_k), :]
    return update(full_c, s, causal, v), update(sparse_c, s, window, v)

  def run_mix():
    full_c, sparse_c = lax.fori_loop(0, causal_end, both, (init(), init()))
    return r * finish(full_c) + (1.0 - r) * finish(sparse_c)

  if "xa" in pair:
    # XAttention heads visit the kept blocks of this query block (a compact ascending list
    # whose last entry is the diagonal block): earlier blocks whole, the diagonal masked.
    per_block = xa_block // block_k
    q_block = q_start // xa_block

    def run_xa():
      def kept(c, carry):
        jb = xa_index_ref[c]
        return visit_tiles(jb * per_block, (jb + 1) * per_block, carry)

      def visit_tiles(lo, hi, carry):
        def tile(j, c):
          k = k_ref[pl.ds(j * block_k, block_k), :]
          s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * qk_scale
          return update(c, s, None, v_ref[pl.ds(j * block_k, block_k), :])
        return lax.fori_loop(lo, hi, tile, carry)

      carry = lax.fori_loop(0, xa_count_ref[q_block] - 1, kept, init())
      return finish(visit(q_block * per_block, causal_end, carry, sparse=False))

    def xa_both(j, c):
      # Mixed gate: both pair over every causal tile; XA's tile mask from the kept row.
      hi_c, lo_c = c
      s, causal, window = scores(j)
      v = v_ref[pl.ds(j * block_k, block_k), :]
      hi_ok, lo_ok = _xa_masks(causal, window, xa_keep_ref[(j * block_k) // xa_block] != 0,
                               pair)
      return update(hi_c, s, hi_ok, v), update(lo_c, s, lo_ok, v)

    def run_xa_mix():
      hi_c, lo_c = lax.fori_loop(0, causal_end, xa_both, (init(), init()))
      return r * finish(hi_c) + (1.0 - r) * finish(lo_c)

    branches = [run_sparse if pair[1] == "stream" else run_xa,
                run_full if pair[0] == "full" else run_xa, run_xa_mix]
  else:
    branches = [run_sparse, run_full, run_mix]

  if not train:
    (o_ref,) = out_refs
    out = lax.switch(mode, branches)
    o_ref[...] = out.astype(o_ref.dtype)
    return

  # Training: every head computes O_FA and O_SSA in one walk over its causal tiles; the SSA
  # state is updated only on the tiles a streaming head visits (sink, then window).
  o_ref, o_fa_ref, o_gap_ref, lse_fa_ref, lse_sa_ref = out_refs
  lo2 = jnp.maximum(win_start, sink_end)

  def full_only(j, c):
    k = k_ref[pl.ds(j * block_k, block_k), :]
    s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * qk_scale
    return update(c[0], s, None, v_ref[pl.ds(j * block_k, block_k), :]), c[1]

  if "xa" in pair:   # the FA state holds the r = 1 pattern, the SSA state the r = 0 one
    full_c, sparse_c = lax.fori_loop(0, causal_end, xa_both, (init(), init()))
  else:
    c = lax.fori_loop(0, sink_end, both, (init(), init()))
    c = lax.fori_loop(sink_end, lo2, full_only, c)  # strictly below the diagonal: no mask
    full_c, sparse_c = lax.fori_loop(lo2, causal_end, both, c)
  o_fa, o_sa = finish(full_c), finish(sparse_c)
  o_ref[...] = (r * o_fa + (1.0 - r) * o_sa).astype(o_ref.dtype)
  o_fa_ref[...] = o_fa.astype(o_fa_ref.dtype)
  o_gap_ref[...] = (o_fa - o_sa).astype(o_gap_ref.dtype)   # the gate's (`row_deltas`)
  for (_, m, l), ref in ((full_c, lse_fa_ref), (sparse_c, lse_sa_ref)):
    ref[...] = m + jnp.log2(jnp.maximum(l, 1e-30))  # base-2 log-sum-exp of scaled scores


def _dq_kernel(modes_ref, gate_ref, *refs, scale, block_q, block_k, seq_len, num_kv_heads,
               groups, streaming: Streaming, pair=("full", "stream"), xa_block=0):
  """dQ of one (query tile, batch, query head): the forward's tile walk, per the head's mode.
  Under the XAttention settings an XA head walks its causal tiles and skips those of blocks
  it did not keep (`keep_ref`: the kept row of this query tile's block)."""
  xa = "xa" in pair
  if xa:
    keep_ref, *refs = refs
  (q_ref, k_ref, v_ref, do_ref, lse_fa_ref, lse_sa_ref, d_fa_ref, d_sa_ref, dq_ref) = refs
  qi, b, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  slot = b * num_kv_heads + n // groups
  mode = modes_ref[slot]
  r = gate_ref[slot]
  q, do = q_ref[...], do_ref[...]
  lse_fa, lse_sa = lse_fa_ref[...], lse_sa_ref[...]
  d_fa, d_sa = d_fa_ref[...], d_sa_ref[...]
  q_start = qi * block_q
  q_idx = q_start + jnp.arange(block_q)
  qk_scale = scale * LOG2E

  def tile(j, acc, fa: bool, sa: bool):
    k = k_ref[pl.ds(j * block_k, block_k), :]
    v = v_ref[pl.ds(j * block_k, block_k), :]
    s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * qk_scale
    dp = jnp.dot(do, v.T, preferred_element_type=jnp.float32)
    causal, window = _masks(q_idx, j * block_k + jnp.arange(block_k), seq_len, streaming)
    if xa:
      causal, window = _xa_masks(causal, window, kept(j), pair)
    ds = _dscores(s, dp, r, causal, window, lse_fa[:, None], lse_sa[:, None], d_fa[:, None],
                  d_sa[:, None], fa, sa)[0]
    return acc + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

  def kept(j):
    return keep_ref[(j * block_k) // xa_block] != 0

  def walk(lo, hi, acc, fa, sa):
    return lax.fori_loop(lo, hi, lambda j, a: tile(j, a, fa, sa), acc)

  def walk_kept(hi, acc, fa, sa):     # an XA head: the causal tiles of its kept blocks
    return lax.fori_loop(0, hi, lambda j, a: lax.cond(kept(j), lambda: tile(j, a, fa, sa),
                                                      lambda: a), acc)

  sink_end, win_start, causal_end = tile_ranges(q_start, block_q, block_k, streaming)
  lo2 = jnp.maximum(win_start, sink_end)
  zero = jnp.zeros(q.shape, jnp.float32)

  def run_sparse():
    return walk(lo2, causal_end, walk(0, sink_end, zero, False, True), False, True)

  def run_full():
    return walk(0, causal_end, zero, True, False)

  def run_mix():
    acc = walk(0, sink_end, zero, True, True)
    return walk(lo2, causal_end, walk(sink_end, lo2, acc, True, False), True, True)

  branches = [run_sparse, run_full, run_mix]
  if xa:
    branches = [run_sparse if pair[1] == "stream"
                else lambda: walk_kept(causal_end, zero, False, True),
                run_full if pair[0] == "full"
                else lambda: walk_kept(causal_end, zero, True, False),
                lambda: walk(0, causal_end, zero, True, True)]
  acc = lax.switch(mode, branches)
  dq_ref[...] = (acc * scale).astype(dq_ref.dtype)


def _dkv_kernel(modes_ref, gate_ref, *refs, scale, block_q, block_k, seq_len, num_q_tiles,
                num_kv_heads, groups, streaming: Streaming, pair=("full", "stream"),
                xa_block=0):
  """dK and dV of one (key tile, batch, KV head), summed over the head's G query heads (GQA:
  the K/V tile is loaded once). Query tiles walk the transposed schedule of the head's mode;
  under the XAttention settings an XA head's query tiles skip the blocks that did not keep
  this key tile's block (`keep_ref`: the slot's kept-block matrix)."""
  xa = "xa" in pair
  if xa:
    keep_ref, *refs = refs
  (q_ref, k_ref, v_ref, do_ref, lse_fa_ref, lse_sa_ref, d_fa_ref, d_sa_ref, dk_ref,
   dv_ref) = refs
  b = pl.program_id(1)
  kj, h = dkv_program(pl.program_id(0), num_kv_heads, num_q_tiles * block_q // block_k,
                      block_k, streaming)   # `_dkv_order`
  slot = b * num_kv_heads + h
  mode = modes_ref[slot]
  r = gate_ref[slot]
  k, v = k_ref[...], v_ref[...]
  k_idx = kj * block_k + jnp.arange(block_k)
  qk_scale = scale * LOG2E
  lo, hi_sparse = q_tile_range(kj, block_q, block_k, num_q_tiles, streaming)

  def tile(g, i, c, fa: bool, sa: bool):
    # Transposed scores (keys x queries) so that P^T and dS^T feed the products untransposed.
    dk, dv = c
    rows = pl.ds(i * block_q, block_q)
    q = q_ref[rows, g, :]
    do = do_ref[rows, g, :]
    s_t = jnp.dot(k, q.T, preferred_element_type=jnp.float32) * qk_scale
    dp_t = jnp.dot(v, do.T, preferred_element_type=jnp.float32)
    causal, window = _masks(i * block_q + jnp.arange(block_q), k_idx, seq_len, streaming)
    if xa:
      causal, window = _xa_masks(causal, window, kept(i), pair)
    row = lambda ref: ref[g, rows][None, :]
    ds_t, p_t = _dscores(s_t, dp_t, r, causal.T, window.T, row(lse_fa_ref), row(lse_sa_ref),
                         row(d_fa_ref), row(d_sa_ref), fa, sa)
    dv = dv + jnp.dot(p_t.astype(do.dtype), do, preferred_element_type=jnp.float32)
    dk = dk + jnp.dot(ds_t.astype(q.dtype), q, preferred_element_type=jnp.float32)
    return dk, dv

  def walk(lo_, hi_, c, fa, sa):
    for g in range(groups):
      c = lax.fori_loop(lo_, hi_, lambda i, c_, g=g: tile(g, i, c_, fa, sa), c)
    return c

  def kept(i):
    return keep_ref[(i * block_q) // xa_block, (kj * block_k) // xa_block] != 0

  def walk_kept(c, fa, sa):           # an XA head: the query tiles whose block kept this one
    for g in range(groups):
      c = lax.fori_loop(lo, num_q_tiles, lambda i, c_, g=g: lax.cond(
          kept(i), lambda: tile(g, i, c_, fa, sa), lambda: c_), c)
    return c

  zero = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
  branches = [
      lambda: walk(lo, hi_sparse, zero, False, True),
      lambda: walk(lo, num_q_tiles, zero, True, False),
      lambda: walk(hi_sparse, num_q_tiles, walk(lo, hi_sparse, zero, True, True), True, False),
  ]
  if xa:
    if pair[1] == "xa":
      branches[0] = lambda: walk_kept(zero, False, True)
    if pair[0] == "xa":
      branches[1] = lambda: walk_kept(zero, True, False)
    branches[2] = lambda: walk(lo, num_q_tiles, zero, True, True)
  dk, dv = lax.switch(mode, branches)
  dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _masks(q_idx, k_idx, seq_len, streaming: Streaming):
  """(causal, causal and SSA) for a tile of query rows x key columns."""
  causal = (k_idx[None, :] <= q_idx[:, None]) & (k_idx[None, :] < seq_len)
  return causal, causal & streaming.allows(q_idx[:, None], k_idx[None, :])


def _xa_masks(causal, window, kept, pair):
  """(mask of the r = 1 pattern, mask of the r = 0 one) under an XAttention pattern pair, from the
  causal and SSA masks of a tile and whether the tile's block was kept."""
  xa = causal & kept
  return (causal if pair[0] == "full" else xa), (window if pair[1] == "stream" else xa)


def _dscores(s, dp, r, causal, window, lse_fa, lse_sa, d_fa, d_sa, fa: bool, sa: bool):
  """(dS, P) of a tile: dS = r P_FA (dP - D_FA) + (1 - r) P_SSA (dP - D_SSA) and
  P = r P_FA + (1 - r) P_SSA, the terms a head's mode needs (`fa`, `sa`). The per-query
  terms (lse, D_FA and D_SSA) come shaped to broadcast along the tile's query axis."""
  ds = p = None
  for on, ok, lse, delta, w in ((fa, causal, lse_fa, d_fa, r), (sa, window, lse_sa, d_sa, 1 - r)):
    if not on:
      continue
    pw = jnp.where(ok, jnp.exp2(s - lse), 0.0) * w
    term = pw * (dp - delta)
    ds, p = (term, pw) if ds is None else (ds + term, p + pw)
  return ds, p


@dataclasses.dataclass(frozen=True)
class Tiles:
  """One kernel's tiling: block_q query rows x block_k key columns, Triton warps and stages."""
  block_q: int = 128
  block_k: int = 64
  num_stages: int = 3
  num_warps: int | None = None  # None: 4 for head_dim <= 64, else 8

  def fit(self, t: int) -> "Tiles":
    """Tiles shrink for short inputs but stay >= 16 rows (the smallest Triton product)."""
    cap = max(16, pl.next_power_of_2(t))
    return dataclasses.replace(self, block_q=min(self.block_q, cap),
                               block_k=min(self.block_k, cap))

  def params(self, dp: int):
    from jax.experimental.pallas import triton as plgpu
    return plgpu.CompilerParams(num_warps=self.num_warps or (4 if dp <= 64 else 8),
                                num_stages=self.num_stages)


# Defaults chosen with `benchmarks/attention.py --tiles/--train-tiles` (H = 128, bf16; the
# sweep: benchmarks/records/attention.md, "Tile tuning"). 128x128 forward tiles and three
# stages of 64x64 in training exceed shared memory.
FORWARD_TILES = Tiles(128, 64, 3)
TRAIN_FORWARD_TILES = Tiles(64, 64, 2, 4)
DQ_TILES = Tiles(128, 32, 2, 8)
DKV_TILES = Tiles(32, 128, 2, 8)


def _clamp(tiles: Tiles, xa_block: int) -> Tiles:
  """Tiles no larger than the XA block (whole tiles tile a block)."""
  return dataclasses.replace(tiles, block_q=min(tiles.block_q, xa_block),
                             block_k=min(tiles.block_k, xa_block))


def _pad_inputs(q, k, v, gate_bk, multiple: int):
  """Pads T to `multiple` and H to a power of two >= 16; flattens gate and modes to slots."""
  b, t, _, d = q.shape
  kh = k.shape[2]
  tp = t + (-t % multiple)
  dp = max(16, pl.next_power_of_2(d))
  q, k, v = (pad_to(pad_to(x, 1, tp), 3, dp) for x in (q, k, v))
  gate = gate_bk.astype(jnp.float32).reshape(-1)
  modes = modes_from_gate(gate)
  slots = pl.next_power_of_2(b * kh)
  return q, k, v, pad_to(gate, 0, slots), pad_to(modes, 0, slots)


def _forward_call(q, k, v, gate, modes, *, seq_len, scale, streaming, tiles: Tiles,
                  interpret, train, pair=("full", "stream"), xa=None, xa_block=0):
  """The forward kernel on padded inputs: O, or (O, O_FA, O_SSA, lse_FA, lse_SSA) in training.
  xa: (index [slots, nbp, nbp], count [slots, nbp], keep [slots, nbp, nbp]) int32 for the
  XAttention settings (`pair` holding "xa")."""
  b, tp, n, dp = q.shape
  kh = k.shape[2]
  bq, bk = tiles.block_q, tiles.block_k
  slots = gate.shape[0]
  groups = n // kh
  xa_specs, xa_ops = [], []
  if xa is not None:
    nbp = xa[1].shape[1]
    row = pl.BlockSpec((None, None, nbp),
                       lambda i, j, h: (j * kh + h // groups, (i * bq) // xa_block, 0))
    xa_specs = [row, pl.BlockSpec((None, nbp), lambda i, j, h: (j * kh + h // groups, 0)), row]
    xa_ops = list(xa)
  o_spec = pl.BlockSpec((None, bq, None, dp), lambda i, j, h: (j, i, h, 0))
  o_shape = jax.ShapeDtypeStruct((b, tp, n, dp), q.dtype)
  out_specs, out_shape = o_spec, o_shape
  if train:
    lse_spec = pl.BlockSpec((None, None, bq), lambda i, j, h: (j, h, i))
    lse_shape = jax.ShapeDtypeStruct((b, n, tp), jnp.float32)
    out_specs = [o_spec] * 3 + [lse_spec] * 2
    out_shape = [o_shape] * 3 + [lse_shape] * 2
  kernel = functools.partial(
      _kernel, scale=scale, block_q=bq, block_k=bk, seq_len=seq_len, num_kv_heads=kh,
      groups=groups, streaming=streaming, train=train, pair=pair, xa_block=xa_block)
  # Triton changes the grid's first axis fastest, so each head's light query tiles start
  # first, here and in dQ. Heavy first measured slower on an H100: 4-5% here, 10-14% in dQ
  # (benchmarks/README.md).
  return pl.pallas_call(
      kernel,
      grid=(tp // bq, b, n),
      in_specs=[
          pl.BlockSpec((slots,), lambda i, j, h: (0,)),
          pl.BlockSpec((slots,), lambda i, j, h: (0,)),
          *xa_specs,
          pl.BlockSpec((None, bq, None, dp), lambda i, j, h: (j, i, h, 0)),
          pl.BlockSpec((None, tp, None, dp), lambda i, j, h: (j, 0, h // (n // kh), 0)),
          pl.BlockSpec((None, tp, None, dp), lambda i, j, h: (j, 0, h // (n // kh), 0)),
      ],
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=tiles.params(dp),
      interpret=interpret,
      name="elastic_hybrid_forward_train" if train else "elastic_hybrid_forward",
  )(modes, gate, *xa_ops, q, k, v)


_TILE_KEYWORDS = ("block_q", "block_k", "num_warps", "num_stages")   # before `tiles=`


@tile_keywords(FORWARD_TILES, *_TILE_KEYWORDS)
@functools.partial(jax.jit, static_argnames=("streaming", "tiles", "interpret"))
def hybrid_forward(q, k, v, gate_bk, streaming: Streaming, *, tiles: Tiles = FORWARD_TILES,
                   interpret: bool = False):
  """The inference kernel: q [B, T, N, H], k/v [B, T, K, H], gate [B, K] -> [B, T, N, H]
  (the tiles shrink for short inputs). The former keywords block_q, block_k, num_warps and
  num_stages still set the tiles' fields (deprecated)."""
  t, d = q.shape[1], q.shape[3]
  tiles = tiles.fit(t)
  qp, kp, vp, gate, modes = _pad_inputs(q, k, v, gate_bk, math.lcm(tiles.block_q,
                                                                     tiles.block_k))
  out = _forward_call(qp, kp, vp, gate, modes, seq_len=t, scale=d ** -0.5,
                      streaming=streaming, tiles=tiles, interpret=interpret, train=False)
  return out[:, :t, :, :d]


@tile_keywords(FORWARD_TILES, *_TILE_KEYWORDS)
@functools.partial(jax.jit, static_argnames=("streaming", "patterns", "xa_block", "tiles",
                                             "interpret"))
def xa_hybrid_forward(q, k, v, gate_bk, xa_keep, streaming: Streaming, *, patterns: str,
                      xa_block: int, tiles: Tiles = FORWARD_TILES, interpret: bool = False):
  """The inference kernel under the XAttention settings ("fa-xa", "xa-ssa"): XA heads visit
  only their kept blocks (xa_keep [B, K, nb, nb] bool, blocks of xa_block tokens). The tiles
  are clamped to the XA block; the former keywords as `hybrid_forward`'s."""
  t, d = q.shape[1], q.shape[3]
  tiles = _clamp(tiles, xa_block).fit(t)
  qp, kp, vp, gate, modes = _pad_inputs(q, k, v, gate_bk, math.lcm(tiles.block_q,
                                                                     tiles.block_k))
  nbp = pl.next_power_of_2(max(xa_keep.shape[-1], -(-qp.shape[1] // xa_block)))
  xa = xa_operands(xa_keep, nbp, gate.shape[0])
  out = _forward_call(qp, kp, vp, gate, modes, seq_len=t, scale=d ** -0.5,
                      streaming=streaming, tiles=tiles, interpret=interpret, train=False,
                      pair=split_patterns(patterns), xa=xa, xa_block=xa_block)
  return out[:, :t, :, :d]


def xa_kernel_applies(xa_block: int) -> bool:
  """The XA mode needs blocks that whole tiles tile: a power of two >= 16."""
  return xa_block >= 16 and xa_block & (xa_block - 1) == 0


def _xa_parts(forward_tiles: Tiles, train_forward_tiles: Tiles, dq_tiles: Tiles,
              dkv_tiles: Tiles):
  """`parts(xa=True)`: five arrays (q, k, v, the gate, the kept blocks), four static
  arguments. The inference forward skips per head (XA heads read their kept-block lists);
  the training forward computes both patterns' outputs of every head over its causal tiles,
  and the dQ and dK/dV kernels skip an XA head's tiles of blocks it did not keep. Tiles are
  clamped to the XA block."""

  def fit_all(t, xa_block):
    all_tiles = [_clamp(x, xa_block).fit(t) for x in (train_forward_tiles, dq_tiles,
                                                      dkv_tiles)]
    return all_tiles, max(max(x.block_q, x.block_k) for x in all_tiles)

  def forward(q, k, v, gate_bk, xa_keep, streaming, patterns, xa_block, interpret):
    return xa_hybrid_forward(q, k, v, gate_bk, xa_keep, streaming, patterns=patterns,
                             xa_block=xa_block, tiles=forward_tiles, interpret=interpret)

  def forward_train(q, k, v, gate_bk, xa_keep, streaming, patterns, xa_block, interpret):
    t, d = q.shape[1], q.shape[3]
    (tiles, _, _), multiple = fit_all(t, xa_block)
    qp, kp, vp, gate, modes = _pad_inputs(q, k, v, gate_bk, multiple)
    nbp = pl.next_power_of_2(max(xa_keep.shape[-1], -(-qp.shape[1] // xa_block)))
    xa = xa_operands(xa_keep, nbp, gate.shape[0])
    o, o_fa, o_gap, lse_fa, lse_sa = _forward_call(
        qp, kp, vp, gate, modes, seq_len=t, scale=d ** -0.5, streaming=streaming, tiles=tiles,
        interpret=interpret, train=True, pair=split_patterns(patterns), xa=xa,
        xa_block=xa_block)
    cut = lambda x: x[:, :t, :, :d]
    return cut(o), (qp, kp, vp, gate, modes, gate_bk, cut(o_fa), cut(o_gap), lse_fa, lse_sa,
                    xa[2])

  def backward(streaming, patterns, xa_block, interpret, res, d_out):
    *res, keep = res
    (_, dq_t, dkv_t), _ = fit_all(d_out.shape[1], xa_block)
    grads = _backward_call(tuple(res), d_out, streaming, interpret, dq_t, dkv_t,
                           split_patterns(patterns), keep, xa_block)
    return (*grads, None)

  return forward, forward_train, backward


def _backward_call(res, d_out, streaming, interpret, dq_t: Tiles, dkv_t: Tiles,
                   pair=("full", "stream"), keep=None, xa_block: int = 0,
                   kernels=("dq", "dkv")):
  """The dQ and dK/dV kernels on the training forward's residuals: (dq, dk, dv, d_gate).
  keep: the kept-block matrices [slots, nbp, nbp] int32 under the XAttention settings.
  kernels: those to launch ("dq", "dkv"); a kernel left out gives None for its gradients
  (benchmarks/kernel_profile.py times each alone)."""
  qp, kp, vp, gate, modes, gate_bk, o_fa, o_gap, lse_fa, lse_sa = res
  b, t, n, d = d_out.shape
  tp, dp, kh = qp.shape[1], qp.shape[3], kp.shape[2]
  groups = n // kh
  d_fa, d_sa, d_gate = row_deltas(d_out, o_fa, o_gap, gate_bk)
  d_fa, d_sa = (pad_to(x, 1, tp).transpose(0, 2, 1) for x in (d_fa, d_sa))  # [B, N, Tp]
  do = pad_to(pad_to(d_out.astype(qp.dtype), 1, tp), 3, dp)
  slots = gate.shape[0]
  common = dict(scale=d ** -0.5, seq_len=t, num_kv_heads=kh, groups=groups,
                streaming=streaming, pair=pair, xa_block=xa_block)
  scalar = pl.BlockSpec((slots,), lambda i, j, h: (0,))
  operands = (modes, gate) + ((keep,) if keep is not None else ()) + (
      qp, kp, vp, do, lse_fa, lse_sa, d_fa, d_sa)

  dq = dk = dv = None
  if "dq" in kernels:
    bq, bk = dq_t.block_q, dq_t.block_k
    q_tile = pl.BlockSpec((None, bq, None, dp), lambda i, j, h: (j, i, h, 0))
    kv_all = pl.BlockSpec((None, tp, None, dp), lambda i, j, h: (j, 0, h // groups, 0))
    row_tile = pl.BlockSpec((None, None, bq), lambda i, j, h: (j, h, i))
    keep_spec = []
    if keep is not None:   # the kept row of the query tile's block
      keep_spec = [pl.BlockSpec((None, None, keep.shape[2]), lambda i, j, h: (
          j * kh + h // groups, (i * bq) // xa_block, 0))]
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, block_q=bq, block_k=bk, **common),
        grid=(tp // bq, b, n),
        in_specs=[scalar, scalar, *keep_spec, q_tile, kv_all, kv_all, q_tile] + [row_tile] * 4,
        out_specs=q_tile,
        out_shape=jax.ShapeDtypeStruct(qp.shape, qp.dtype),
        compiler_params=dq_t.params(dp),
        interpret=interpret,
        name="elastic_hybrid_dq",
    )(*operands)

  if "dkv" in kernels:
    bq, bk = dkv_t.block_q, dkv_t.block_k
    q_group = pl.BlockSpec((None, tp, groups, dp), lambda i, j, h: (j, 0, h, 0))
    kv_tile = pl.BlockSpec((None, bk, None, dp), lambda i, j, h: (j, i, h, 0))
    rows_group = pl.BlockSpec((None, groups, tp), lambda i, j, h: (j, h, 0))
    keep_spec = []
    if keep is not None:   # the slot's whole kept-block matrix (read one entry at a time)
      keep_spec = [pl.BlockSpec((None,) + keep.shape[1:], lambda i, j, h: (j * kh + h, 0, 0))]
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, block_q=bq, block_k=bk, num_q_tiles=tp // bq,
                          **common),
        grid=(kh * (tp // bk), b),
        in_specs=_dkv_order([scalar, scalar, *keep_spec, q_group, kv_tile, kv_tile,
                             q_group] + [rows_group] * 4, kh, tp // bk, bk, streaming),
        out_specs=_dkv_order([kv_tile, kv_tile], kh, tp // bk, bk, streaming),
        out_shape=[jax.ShapeDtypeStruct(kp.shape, kp.dtype)] * 2,
        compiler_params=dkv_t.params(dp),
        interpret=interpret,
        name="elastic_hybrid_dkv",
    )(*operands)
  cut = lambda x: None if x is None else x[:, :t, :, :d]
  return cut(dq), cut(dk), cut(dv), d_gate


def _plain_parts(forward_tiles: Tiles, train_forward_tiles: Tiles, dq_tiles: Tiles,
                 dkv_tiles: Tiles):
  """`parts()`: four arrays (q, k, v, the gate [B, K]), two static arguments."""

  def fit_all(t):
    all_tiles = [x.fit(t) for x in (train_forward_tiles, dq_tiles, dkv_tiles)]
    multiple = max(max(x.block_q, x.block_k) for x in all_tiles)  # powers of two
    return all_tiles, multiple

  def forward(q, k, v, gate_bk, streaming, interpret):
    return hybrid_forward(q, k, v, gate_bk, streaming, tiles=forward_tiles,
                          interpret=interpret)

  def forward_train(q, k, v, gate_bk, streaming, interpret):
    t, d = q.shape[1], q.shape[3]
    (tiles, _, _), multiple = fit_all(t)
    qp, kp, vp, gate, modes = _pad_inputs(q, k, v, gate_bk, multiple)
    o, o_fa, o_gap, lse_fa, lse_sa = _forward_call(
        qp, kp, vp, gate, modes, seq_len=t, scale=d ** -0.5, streaming=streaming, tiles=tiles,
        interpret=interpret, train=True)
    cut = lambda x: x[:, :t, :, :d]
    return cut(o), (qp, kp, vp, gate, modes, gate_bk, cut(o_fa), cut(o_gap), lse_fa, lse_sa)

  def backward(streaming, interpret, res, d_out):
    (_, dq_t, dkv_t), _ = fit_all(d_out.shape[1])
    return _backward_call(res, d_out, streaming, interpret, dq_t, dkv_t)

  return forward, forward_train, backward


# ----------------------------------------------------------------------------------------------
# Packed rows: segments and positions at run time (common.packed_plan's tile schedule)
#
# Per program the tile ranges come from the plan (kv_lo skips the tiles of earlier segments),
# the mode from the gates of the rows it serves, and every visited tile is masked by segment,
# causality and (SSA) the positions' blocks. The gate is per row ([B, K, T]): a mixed tile
# (rows of segments routed differently) keeps both online softmaxes and mixes per row.


def _packed_masks(seg_q, pos_q, q_idx, seg_k, pos_k, k_idx, streaming: Streaming,
                  pair=("full", "stream"), kept=None):
  """(r = 1, r = 0) pattern masks of a tile of query rows x key columns of packed rows: FA
  and SSA, or under an XAttention pair the tile's kept bit (`kept`, a scalar) in place of
  either."""
  full = (k_idx[None, :] <= q_idx[:, None]) & (seg_k[None, :] == seg_q[:, None])
  ssa = full & streaming.allows(pos_q[:, None], pos_k[None, :])
  if "xa" not in pair:
    return full, ssa
  xa = full & (kept != 0)
  return (xa if pair[0] == "xa" else full), (xa if pair[1] == "xa" else ssa)


def _dkv_order(specs, num_kv_heads: int, num_tiles: int, keys: int, streaming: Streaming):
  """BlockSpecs written for a grid (key tile, batch, KV head), for the dK/dV kernels' grid
  (program, batch), programs in `common.dkv_program`'s order (Triton starts programs with the
  grid's first axis changing fastest)."""
  def index_map(f):
    return lambda p, j: (lambda tile, head: f(tile, j, head))(
        *dkv_program(p, num_kv_heads, num_tiles, keys, streaming))

  return [dataclasses.replace(x, index_map=index_map(x.index_map)) for x in specs]


def _split_keep(refs, pair):
  """(kept-block row ref or None, the other refs) of a packed kernel's operands."""
  return (refs[0], refs[1:]) if "xa" in pair else (None, refs)


def _kept_at(keep_ref, first: int, xa_block: int):
  """The kept bit of the XA block holding token `first` in a program's kept row (None
  without XAttention)."""
  return None if keep_ref is None else keep_ref[first // xa_block]


def _kept_tiles_only(body, keep_ref, tile: int, xa_block: int):
  """A loop body over tiles of `tile` tokens that runs `body` only on the tiles of kept XA
  blocks. For an XA term alone the other tiles' masks are empty, so they would leave the
  carry as it is: they are skipped, products and loads included."""
  def run(j, c):
    return lax.cond(_kept_at(keep_ref, j * tile, xa_block) != 0, lambda: body(j, c),
                    lambda: c)
  return run


def _xa_alone(pair, fa: bool, sa: bool) -> bool:
  """Whether a walk that runs only the term(s) flagged runs an XA term alone."""
  return fa != sa and pair[0 if fa else 1] == "xa"


def _packed_kernel(plan_ref, modes_ref, seg_ref, pos_ref, gate_ref, *refs, scale, block_q,
                   block_k, streaming: Streaming, train: bool, pair=("full", "stream"),
                   xa_block: int = 0):
  keep_ref, (q_ref, k_ref, v_ref, *out_refs) = _split_keep(refs, pair)
  qi = pl.program_id(0)
  kv_lo, sink_hi, win_lo, causal_hi, in_lo, in_hi, sparse_in_hi = (plan_ref[x]
                                                                  for x in range(7))
  mode = modes_ref[0]
  q = q_ref[...]
  d = q.shape[-1]
  q_start = qi * block_q
  rows = pl.ds(q_start, block_q)
  seg_q, pos_q, r = seg_ref[rows], pos_ref[rows], gate_ref[rows]
  q_idx = q_start + jnp.arange(block_q)
  qk_scale = scale * LOG2E

  def tile(j):
    cols = pl.ds(j * block_k, block_k)
    s = jnp.dot(q, k_ref[cols, :].T, preferred_element_type=jnp.float32) * qk_scale
    full, ssa = _packed_masks(seg_q, pos_q, q_idx, seg_ref[cols], pos_ref[cols],
                              j * block_k + jnp.arange(block_k), streaming, pair,
                              _kept_at(keep_ref, j * block_k, xa_block))
    return s, full, ssa, v_ref[cols, :]

  def one(use_ssa):
    def body(j, c):
      s, full, ssa, v = tile(j)
      return online_update(c, s, ssa if use_ssa else full, v)
    if _xa_alone(pair, not use_ssa, use_ssa):
      return _kept_tiles_only(body, keep_ref, block_k, xa_block)
    return body

  def plain(j, c):                       # a tile wholly visible to every row: no mask
    cols = pl.ds(j * block_k, block_k)
    s = jnp.dot(q, k_ref[cols, :].T, preferred_element_type=jnp.float32) * qk_scale
    return online_update(c, s, None, v_ref[cols, :])

  def visit(lo, hi, c, use_ssa):
    """Tiles [lo, hi): masked, except those of the plan's no-mask range."""
    a = jnp.clip(in_lo, lo, hi)
    z = jnp.clip(sparse_in_hi if use_ssa else in_hi, a, hi)
    c = lax.fori_loop(lo, a, one(use_ssa), c)
    c = lax.fori_loop(a, z, plain, c)
    return lax.fori_loop(z, hi, one(use_ssa), c)

  def both(j, c):
    s, full, ssa, v = tile(j)
    return online_update(c[0], s, full, v), online_update(c[1], s, ssa, v)

  def full_only(j, c):
    s, full, _, v = tile(j)
    return online_update(c[0], s, full, v), c[1]

  lo2 = jnp.maximum(win_lo, sink_hi)
  init = lambda: online_init(block_q, d)
  if not train:
    def run_sparse():
      c = visit(kv_lo, sink_hi, init(), True)
      return online_finish(visit(lo2, causal_hi, c, True))

    def run_full():
      return online_finish(visit(kv_lo, causal_hi, init(), False))

    def run_mix():
      fa, sa = lax.fori_loop(kv_lo, causal_hi, both, (init(), init()))
      return r[:, None] * online_finish(fa) + (1.0 - r[:, None]) * online_finish(sa)

    (o_ref,) = out_refs
    o_ref[...] = lax.switch(mode, [run_sparse, run_full, run_mix]).astype(o_ref.dtype)
    return

  o_ref, o_fa_ref, o_gap_ref, lse_fa_ref, lse_sa_ref = out_refs
  c = lax.fori_loop(kv_lo, sink_hi, both, (init(), init()))
  c = lax.fori_loop(sink_hi, lo2, full_only, c)
  fa_c, sa_c = lax.fori_loop(lo2, causal_hi, both, c)
  o_fa, o_sa = online_finish(fa_c), online_finish(sa_c)
  o_ref[...] = (r[:, None] * o_fa + (1.0 - r[:, None]) * o_sa).astype(o_ref.dtype)
  o_fa_ref[...] = o_fa.astype(o_fa_ref.dtype)
  o_gap_ref[...] = (o_fa - o_sa).astype(o_gap_ref.dtype)   # the gate's (`row_deltas`)
  for (_, m, l), ref in ((fa_c, lse_fa_ref), (sa_c, lse_sa_ref)):
    ref[...] = m + jnp.log2(jnp.maximum(l, 1e-30))


def _packed_dq_kernel(plan_ref, modes_ref, seg_ref, pos_ref, gate_ref, *refs, scale, block_q,
                      block_k, streaming: Streaming, pair=("full", "stream"), xa_block: int = 0):
  """dQ of one (query tile, batch, query head) of packed rows: the forward's walk."""
  keep_ref, (q_ref, k_ref, v_ref, do_ref, lse_fa_ref, lse_sa_ref, d_fa_ref, d_sa_ref,
             dq_ref) = _split_keep(refs, pair)
  qi = pl.program_id(0)
  kv_lo, sink_hi, win_lo, causal_hi = (plan_ref[x] for x in range(4))
  mode = modes_ref[0]
  q, do = q_ref[...], do_ref[...]
  q_start = qi * block_q
  rows = pl.ds(q_start, block_q)
  seg_q, pos_q, r = seg_ref[rows], pos_ref[rows], gate_ref[rows][:, None]
  lse_fa, lse_sa = lse_fa_ref[...][:, None], lse_sa_ref[...][:, None]
  d_fa, d_sa = d_fa_ref[...][:, None], d_sa_ref[...][:, None]
  q_idx = q_start + jnp.arange(block_q)
  qk_scale = scale * LOG2E

  def walk(lo, hi, acc, fa, sa):
    def body(j, acc):
      cols = pl.ds(j * block_k, block_k)
      k, v = k_ref[cols, :], v_ref[cols, :]
      s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * qk_scale
      dp = jnp.dot(do, v.T, preferred_element_type=jnp.float32)
      full, ssa = _packed_masks(seg_q, pos_q, q_idx, seg_ref[cols], pos_ref[cols],
                                j * block_k + jnp.arange(block_k), streaming, pair,
                                _kept_at(keep_ref, j * block_k, xa_block))
      ds = _dscores(s, dp, r, full, ssa, lse_fa, lse_sa, d_fa, d_sa, fa, sa)[0]
      return acc + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)
    if _xa_alone(pair, fa, sa):
      body = _kept_tiles_only(body, keep_ref, block_k, xa_block)
    return lax.fori_loop(lo, hi, body, acc)

  lo2 = jnp.maximum(win_lo, sink_hi)
  zero = jnp.zeros(q.shape, jnp.float32)
  branches = [
      lambda: walk(lo2, causal_hi, walk(kv_lo, sink_hi, zero, False, True), False, True),
      lambda: walk(kv_lo, causal_hi, zero, True, False),
      lambda: walk(lo2, causal_hi, walk(sink_hi, lo2, walk(kv_lo, sink_hi, zero, True, True),
                                        True, False), True, True)]
  dq_ref[...] = (lax.switch(mode, branches) * scale).astype(dq_ref.dtype)


def _packed_dkv_kernel(plan_ref, modes_ref, seg_ref, pos_ref, gate_ref, *refs, scale, block_q,
                       block_k, groups, num_kv_heads, num_tiles, streaming: Streaming,
                       pair=("full", "stream"), xa_block: int = 0):
  """dK and dV of one (key tile, batch, KV head) of packed rows, over the G query heads: the
  query tiles of the plan's transposed ranges (keep_ref: the kept column of this key tile)."""
  keep_ref, (q_ref, k_ref, v_ref, do_ref, lse_fa_ref, lse_sa_ref, d_fa_ref, d_sa_ref, dk_ref,
             dv_ref) = _split_keep(refs, pair)
  kj, _ = dkv_program(pl.program_id(0), num_kv_heads, num_tiles, block_k,
                      streaming)   # `_dkv_order`
  q_lo, q_hi_full, q_hi_sparse = (plan_ref[x] for x in range(3))
  mode = modes_ref[0]
  k, v = k_ref[...], v_ref[...]
  cols = pl.ds(kj * block_k, block_k)
  seg_k, pos_k = seg_ref[cols], pos_ref[cols]
  k_idx = kj * block_k + jnp.arange(block_k)
  qk_scale = scale * LOG2E

  def walk(lo, hi, c, fa, sa):
    for g in range(groups):
      def body(i, c, g=g):
        dk, dv = c
        rows = pl.ds(i * block_q, block_q)
        q, do = q_ref[rows, g, :], do_ref[rows, g, :]
        s_t = jnp.dot(k, q.T, preferred_element_type=jnp.float32) * qk_scale
        dp_t = jnp.dot(v, do.T, preferred_element_type=jnp.float32)
        full, ssa = _packed_masks(seg_ref[rows], pos_ref[rows],
                                  i * block_q + jnp.arange(block_q), seg_k, pos_k, k_idx,
                                  streaming, pair, _kept_at(keep_ref, i * block_q, xa_block))
        row = lambda ref: ref[g, rows][None, :]
        ds_t, p_t = _dscores(s_t, dp_t, gate_ref[rows][None, :], full.T, ssa.T,
                             row(lse_fa_ref), row(lse_sa_ref), row(d_fa_ref), row(d_sa_ref),
                             fa, sa)
        dv = dv + jnp.dot(p_t.astype(do.dtype), do, preferred_element_type=jnp.float32)
        dk = dk + jnp.dot(ds_t.astype(q.dtype), q, preferred_element_type=jnp.float32)
        return dk, dv
      if _xa_alone(pair, fa, sa):
        body = _kept_tiles_only(body, keep_ref, block_q, xa_block)
      c = lax.fori_loop(lo, hi, body, c)
    return c

  zero = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
  branches = [lambda: walk(q_lo, q_hi_sparse, zero, False, True),
              lambda: walk(q_lo, q_hi_full, zero, True, False),
              lambda: walk(q_hi_sparse, q_hi_full, walk(q_lo, q_hi_sparse, zero, True, True),
                           True, False)]
  dk, dv = lax.switch(mode, branches)
  dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _packed_inputs(q, k, v, gate_btk, segment_ids, positions, multiple: int):
  """Pads T to `multiple` (the padding is one more segment, id -1) and H to a power of two
  >= 16; the gate as rows [B, K, Tp] float32."""
  t, d = q.shape[1], q.shape[3]
  tp = t + (-t % multiple)
  dp = max(16, pl.next_power_of_2(d))
  q, k, v = (pad_to(pad_to(x, 1, tp), 3, dp) for x in (q, k, v))
  seg, pos = pad_packed(segment_ids, positions, tp)
  gate = pad_to(gate_btk.astype(jnp.float32), 1, tp).transpose(0, 2, 1)
  return q, k, v, seg, pos, gate


def _packed_specs(tp: int, groups: int, by_kv_head: bool):
  """BlockSpecs of (seg, pos, gate rows) for a grid (tile, batch, head)."""
  head = (lambda h: h) if by_kv_head else (lambda h: h // groups)
  row = pl.BlockSpec((None, tp), lambda i, j, h: (j, 0))
  gate = pl.BlockSpec((None, None, tp), lambda i, j, h: (j, head(h), 0))
  return [row, row, gate]


def _keep_spec(keep, xa: "PackedXA", block: int, kh: int, groups: int, by_kv_head: bool):
  """The BlockSpec of a program's kept row (forward, dQ: keep; dK/dV: its transpose) for a
  grid (tile, batch, head) of `block`-token tiles."""
  head = (lambda h: h) if by_kv_head else (lambda h: h // groups)
  return pl.BlockSpec((None, None, keep.shape[-1]),
                      lambda i, j, h: (j * kh + head(h), (i * block) // xa.block, 0))


@dataclasses.dataclass(frozen=True)
class PackedXA:
  """The XAttention setting of a packed call: the pattern pair and the XA block."""
  pair: tuple[str, str] = ("full", "stream")
  block: int = 0


def _packed_forward_call(q, k, v, seg, pos, gate, plan, *, scale, streaming, tiles: Tiles,
                         interpret, train, xa: PackedXA = PackedXA(), keep=None):
  b, tp, n, dp = q.shape
  kh = k.shape[2]
  groups = n // kh
  bq = tiles.block_q
  keep_specs, keep_ops = (([_keep_spec(keep, xa, bq, kh, groups, False)], [keep])
                          if keep is not None else ([], []))
  o_spec = pl.BlockSpec((None, bq, None, dp), lambda i, j, h: (j, i, h, 0))
  o_shape = jax.ShapeDtypeStruct((b, tp, n, dp), q.dtype)
  out_specs, out_shape = o_spec, o_shape
  if train:
    lse_spec = pl.BlockSpec((None, None, bq), lambda i, j, h: (j, h, i))
    lse_shape = jax.ShapeDtypeStruct((b, n, tp), jnp.float32)
    out_specs, out_shape = [o_spec] * 3 + [lse_spec] * 2, [o_shape] * 3 + [lse_shape] * 2
  return pl.pallas_call(
      functools.partial(_packed_kernel, scale=scale, block_q=bq, block_k=tiles.block_k,
                        streaming=streaming, train=train, pair=xa.pair, xa_block=xa.block),
      grid=(tp // bq, b, n),
      in_specs=[pl.BlockSpec((None, None, 8), lambda i, j, h: (j, i, 0)),
                pl.BlockSpec((None, None, 1), lambda i, j, h: (j, h // groups, i)),
                *_packed_specs(tp, groups, False), *keep_specs,
                pl.BlockSpec((None, bq, None, dp), lambda i, j, h: (j, i, h, 0)),
                pl.BlockSpec((None, tp, None, dp), lambda i, j, h: (j, 0, h // groups, 0)),
                pl.BlockSpec((None, tp, None, dp), lambda i, j, h: (j, 0, h // groups, 0))],
      out_specs=out_specs, out_shape=out_shape, compiler_params=tiles.params(dp),
      interpret=interpret,
      name="elastic_packed_forward_train" if train else "elastic_packed_forward",
  )(plan["q_plan"], plan["q_modes"], seg, pos, gate, *keep_ops, q, k, v)


def _packed_backward_call(res, d_out, streaming, interpret, dq_t: Tiles, dkv_t: Tiles,
                          xa: PackedXA = PackedXA()):
  qp, kp, vp, seg, pos, gate, keep, gate_btk, o_fa, o_gap, lse_fa, lse_sa = res
  b, t, n, d = d_out.shape
  tp, dp, kh = qp.shape[1], qp.shape[3], kp.shape[2]
  groups = n // kh
  d_fa, d_sa, d_gate = row_deltas(d_out, o_fa, o_gap, gate_btk)
  d_fa, d_sa = (pad_to(x, 1, tp).transpose(0, 2, 1) for x in (d_fa, d_sa))  # [B, N, Tp]
  do = pad_to(pad_to(d_out.astype(qp.dtype), 1, tp), 3, dp)
  scale = d ** -0.5

  bq, bk = dq_t.block_q, dq_t.block_k
  plan = packed_plan(seg, pos, gate.transpose(0, 2, 1), streaming, bq, bk, xa.pair)
  with_keep = lambda block, by_kv_head, x: (
      ([_keep_spec(x, xa, block, kh, groups, by_kv_head)], [x]) if keep is not None
      else ([], []))
  keep_specs, keep_ops = with_keep(bq, False, keep)
  q_tile = pl.BlockSpec((None, bq, None, dp), lambda i, j, h: (j, i, h, 0))
  kv_all = pl.BlockSpec((None, tp, None, dp), lambda i, j, h: (j, 0, h // groups, 0))
  row_tile = pl.BlockSpec((None, None, bq), lambda i, j, h: (j, h, i))
  dq = pl.pallas_call(
      functools.partial(_packed_dq_kernel, scale=scale, block_q=bq, block_k=bk,
                        streaming=streaming, pair=xa.pair, xa_block=xa.block),
      grid=(tp // bq, b, n),
      in_specs=[pl.BlockSpec((None, None, 8), lambda i, j, h: (j, i, 0)),
                pl.BlockSpec((None, None, 1), lambda i, j, h: (j, h // groups, i)),
                *_packed_specs(tp, groups, False), *keep_specs,
                q_tile, kv_all, kv_all, q_tile] + [row_tile] * 4,
      out_specs=q_tile, out_shape=jax.ShapeDtypeStruct(qp.shape, qp.dtype),
      compiler_params=dq_t.params(dp), interpret=interpret, name="elastic_packed_dq",
  )(plan["q_plan"], plan["q_modes"], seg, pos, gate, *keep_ops, qp, kp, vp, do, lse_fa,
    lse_sa, d_fa, d_sa)

  bq, bk = dkv_t.block_q, dkv_t.block_k
  plan = packed_plan(seg, pos, gate.transpose(0, 2, 1), streaming, bq, bk, xa.pair)
  keep_specs, keep_ops = with_keep(bk, True, None if keep is None else keep.swapaxes(1, 2))
  q_group = pl.BlockSpec((None, tp, groups, dp), lambda i, j, h: (j, 0, h, 0))
  kv_tile = pl.BlockSpec((None, bk, None, dp), lambda i, j, h: (j, i, h, 0))
  rows_group = pl.BlockSpec((None, groups, tp), lambda i, j, h: (j, h, 0))
  dk, dv = pl.pallas_call(
      functools.partial(_packed_dkv_kernel, scale=scale, block_q=bq, block_k=bk,
                        groups=groups, num_kv_heads=kh, num_tiles=tp // bk,
                        streaming=streaming, pair=xa.pair, xa_block=xa.block),
      grid=(kh * (tp // bk), b),
      in_specs=_dkv_order([pl.BlockSpec((None, None, 4), lambda i, j, h: (j, i, 0)),
                           pl.BlockSpec((None, None, 1), lambda i, j, h: (j, h, i)),
                           *_packed_specs(tp, groups, True), *keep_specs,
                           q_group, kv_tile, kv_tile, q_group] + [rows_group] * 4,
                          kh, tp // bk, bk, streaming),
      out_specs=_dkv_order([kv_tile, kv_tile], kh, tp // bk, bk, streaming),
      out_shape=[jax.ShapeDtypeStruct(kp.shape, kp.dtype)] * 2,
      compiler_params=dkv_t.params(dp), interpret=interpret, name="elastic_packed_dkv",
  )(plan["k_plan"], plan["k_modes"], seg, pos, gate, *keep_ops, qp, kp, vp, do, lse_fa,
    lse_sa, d_fa, d_sa)
  cut = lambda x: x[:, :t, :, :d]
  return cut(dq), cut(dk), cut(dv), d_gate


def _packed_parts(forward_tiles: Tiles, train_forward_tiles: Tiles, dq_tiles: Tiles,
                  dkv_tiles: Tiles, xa: bool):
  """`parts(packed=True, xa=xa)`: six arrays (q, k, v, the gate [B, T, K], segment ids,
  positions; seven with the kept blocks under XAttention), two static arguments (four under
  XAttention, whose tiles are clamped to the XA block)."""

  def fit_all(t, tiles, setting: PackedXA):
    if setting.block:
      tiles = [_clamp(x, setting.block) for x in tiles]
    all_tiles = [x.fit(t) for x in tiles]
    return all_tiles, max(max(x.block_q, x.block_k) for x in all_tiles)

  def run_forward(q, k, v, gate_btk, seg_ids, positions, xa_keep, streaming, setting,
                  interpret, train):
    t, d = q.shape[1], q.shape[3]
    chosen = (train_forward_tiles, dq_tiles, dkv_tiles) if train else (forward_tiles,)
    (tiles, *_), multiple = fit_all(t, chosen, setting)
    qp, kp, vp, seg, pos, gate = _packed_inputs(q, k, v, gate_btk, seg_ids, positions,
                                                multiple)
    keep = None
    if xa_keep is not None:
      nbp = pl.next_power_of_2(max(xa_keep.shape[-1], -(-qp.shape[1] // setting.block)))
      keep = xa_operands(xa_keep, nbp, xa_keep.shape[0] * xa_keep.shape[1])[2]
    plan = packed_plan(seg, pos, gate.transpose(0, 2, 1), streaming, tiles.block_q,
                       tiles.block_k, setting.pair)
    out = _packed_forward_call(qp, kp, vp, seg, pos, gate, plan, scale=d ** -0.5,
                               streaming=streaming, tiles=tiles, interpret=interpret,
                               train=train, xa=setting, keep=keep)
    return out, (qp, kp, vp, seg, pos, gate, keep)

  def forward(q, k, v, gate_btk, seg_ids, positions, *args):
    xa_keep, streaming, setting, interpret = _packed_args(args, xa)
    out, _ = run_forward(q, k, v, gate_btk, seg_ids, positions, xa_keep, streaming, setting,
                         interpret, False)
    return out[:, :q.shape[1], :, :q.shape[3]]

  def forward_train(q, k, v, gate_btk, seg_ids, positions, *args):
    xa_keep, streaming, setting, interpret = _packed_args(args, xa)
    t, d = q.shape[1], q.shape[3]
    (o, o_fa, o_gap, lse_fa, lse_sa), inputs = run_forward(
        q, k, v, gate_btk, seg_ids, positions, xa_keep, streaming, setting, interpret, True)
    cut = lambda x: x[:, :t, :, :d]
    return cut(o), (*inputs, gate_btk, cut(o_fa), cut(o_gap), lse_fa, lse_sa, seg_ids,
                    positions, xa_keep)

  def backward(*args):
    *static, res, d_out = args
    _, streaming, setting, interpret = _packed_args((None, *static), xa)
    *res, seg_ids, positions, xa_keep = res
    (_, dq_t, dkv_t), _ = fit_all(d_out.shape[1], (train_forward_tiles, dq_tiles, dkv_tiles),
                                  setting)
    dq, dk, dv, d_gate = _packed_backward_call(tuple(res), d_out, streaming, interpret, dq_t,
                                               dkv_t, setting)
    zero_int = lambda x: np.zeros(x.shape, jax.dtypes.float0)
    grads = (dq, dk, dv, d_gate, zero_int(seg_ids), zero_int(positions))
    return grads + ((zero_int(xa_keep),) if xa else ())

  return forward, forward_train, backward


def _packed_args(args, xa: bool):
  """(xa_keep, streaming, PackedXA, interpret) from the arguments after the positions:
  (streaming, interpret) or, under XAttention, (xa_keep, streaming, patterns, xa_block,
  interpret)."""
  if not xa:
    streaming, interpret = args[-2:]
    return None, streaming, PackedXA(), interpret
  xa_keep, streaming, patterns, xa_block, interpret = args
  return xa_keep, streaming, PackedXA(split_patterns(patterns), xa_block), interpret


# ----------------------------------------------------------------------------------------------
# Builders: one per kernel kind, packed rows and the XAttention settings as arguments


def parts(forward_tiles: Tiles = FORWARD_TILES,
          train_forward_tiles: Tiles = TRAIN_FORWARD_TILES, dq_tiles: Tiles = DQ_TILES,
          dkv_tiles: Tiles = DKV_TILES, *, packed: bool = False, xa: bool = False):
  """(forward, forward_train, backward) of `make_hybrid(..., packed=packed, xa=xa)`, as
  `common.with_fused_backward` takes them; another inference forward may take `forward`'s
  place (the Mosaic GPU backend's), the residuals keeping their layout."""
  tiles = (forward_tiles, train_forward_tiles, dq_tiles, dkv_tiles)
  if packed:
    return _packed_parts(*tiles, xa)
  return (_xa_parts if xa else _plain_parts)(*tiles)


# `parts` of each kind under the names the Mosaic GPU backend calls it by (no warning).


def hybrid_parts(forward_tiles: Tiles = FORWARD_TILES,
                 train_forward_tiles: Tiles = TRAIN_FORWARD_TILES, dq_tiles: Tiles = DQ_TILES,
                 dkv_tiles: Tiles = DKV_TILES):
  """`parts(...)`: unpacked rows."""
  return parts(forward_tiles, train_forward_tiles, dq_tiles, dkv_tiles)


def xa_parts(forward_tiles: Tiles = FORWARD_TILES,
             train_forward_tiles: Tiles = TRAIN_FORWARD_TILES, dq_tiles: Tiles = DQ_TILES,
             dkv_tiles: Tiles = DKV_TILES):
  """`parts(..., xa=True)`: unpacked rows under the XAttention settings."""
  return parts(forward_tiles, train_forward_tiles, dq_tiles, dkv_tiles, xa=True)


def packed_parts(forward_tiles: Tiles = FORWARD_TILES,
                 train_forward_tiles: Tiles = TRAIN_FORWARD_TILES,
                 dq_tiles: Tiles = DQ_TILES, dkv_tiles: Tiles = DKV_TILES, xa: bool = False):
  """`parts(..., packed=True, xa=xa)`: packed rows."""
  return parts(forward_tiles, train_forward_tiles, dq_tiles, dkv_tiles, packed=True, xa=xa)


def make_hybrid(forward_tiles: Tiles = FORWARD_TILES,
                train_forward_tiles: Tiles = TRAIN_FORWARD_TILES, dq_tiles: Tiles = DQ_TILES,
                dkv_tiles: Tiles = DKV_TILES, *, packed: bool = False, xa: bool = False):
  """The differentiable kernel with these tiles (differentiable in q, k, v and the gate):

    fn(q, k, v, gate_bk, streaming, interpret)                          unpacked rows;
    fn(q, k, v, gate_bk, xa_keep, streaming, patterns, xa_block, interpret)    xa;
    fn(q, k, v, gate_btk, segment_ids, positions, streaming, interpret)        packed;
    fn(q, k, v, gate_btk, segment_ids, positions, xa_keep, streaming, patterns, xa_block,
       interpret)                                                      packed and xa.

  gate_bk [B, K]; gate_btk [B, T, K] (constant within a segment). Packed rows: segment ids
  and positions [B, T] int, positions counting from 0 at each segment's start for the
  streaming heads' tile skipping (other positions stay correct, at full cost). XAttention
  ("fa-xa", "xa-ssa"): xa_keep [B, K, nb, nb] bool, the kept blocks of `xa_block` tokens
  (`xattention.select`, with the segment ids on packed rows); an XA head of unpacked rows
  visits only its kept blocks, one of packed rows walks the full head's tiles of its segment
  and masks in the kept blocks (skipping the others' tiles where its term runs alone,
  `_kept_tiles_only`)."""
  return with_fused_backward(*parts(forward_tiles, train_forward_tiles, dq_tiles, dkv_tiles,
                                    packed=packed, xa=xa),
                             num_arrays=4 + (2 if packed else 0) + (1 if xa else 0),
                             num_static=4 if xa else 2)


make_xa_hybrid = deprecated_alias("pallas_gpu.make_xa_hybrid(...)",
                                  "pallas_gpu.make_hybrid(..., xa=True)",
                                  functools.partial(make_hybrid, xa=True))
make_packed_hybrid = deprecated_alias("pallas_gpu.make_packed_hybrid(...)",
                                      "pallas_gpu.make_hybrid(..., packed=True)",
                                      functools.partial(make_hybrid, packed=True))
make_packed_xa_hybrid = deprecated_alias("pallas_gpu.make_packed_xa_hybrid(...)",
                                         "pallas_gpu.make_hybrid(..., packed=True, xa=True)",
                                         functools.partial(make_hybrid, packed=True, xa=True))

hybrid_attention = functools.partial(kernel_or_reference, make_hybrid(),
                                     xa_kernel=make_hybrid(xa=True),
                                     xa_kernel_applies=xa_kernel_applies,
                                     packed_kernel=make_hybrid(packed=True),
                                     packed_xa_kernel=make_hybrid(packed=True, xa=True))
