"""XAttention's block selection (Xu et al. 2025; docs/method.md §3): which KV blocks a head reads.

For each KV head, every query block keeps the key blocks that carry most of its attention mass,
estimated cheaply from antidiagonal sums:
  1. with stride S, q_r[i] = concat_t q[i*S + S-1-t] and k_r[j] = concat_t k[j*S + t], so that
     q_r[i] . k_r[j] sums the products along the antidiagonals of the (i, j) S x S tile;
  2. P = softmax_j(q_r k_r^T / (sqrt(H) * S)) in float32, over the stride columns j <= i
     (and, in packed rows, of the query's segment);
  3. the block mass A[I, J] sums P over the (block/S)^2 tile of query block I and key block J;
  4. block 0 and the diagonal block are always kept (in packed rows also the block where the
     query's segment starts); the rest are added in descending mass (ties: lower J first)
     while the kept mass is below threshold x the row's mass;
  5. attention is then exact token-level causal softmax over the kept blocks
     (`reference.hybrid_attention`'s "xa" pattern, the kernels' XA mode).
Grouped-query attention (decision): the unit that is kept or skipped is the KV head, as for
the routing; its block mass is the mean of its G query heads' masses (each query head's rows
sum to 1, so the mean keeps the threshold's meaning). Scores are formed per chunk of
`chunk_blocks` query blocks (rows = chunk_blocks * block/S stride rows), only on or below the
diagonal, in one pass (`block_mass`): up to `unroll_chunks` chunks each against its whole
causal prefix (memory O(rows * T/S) per head), past that in a loop of tiles of chunk_blocks x
chunk_blocks blocks (memory O(rows * (rows + nb)) per head at any T).

Shape letters: B batch, T tokens, N query heads, K KV heads, G = N / K, H head dim; I, J query
and key blocks (nb = ceil(T / block) of each).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from elastic_jax.attention.reference import MASK_VALUE



@dataclasses.dataclass(frozen=True)
class XAttention:
  """XAttention's numbers: antidiagonal stride, block size, mass threshold tau."""
  stride: int = 16
  block: int = 128
  threshold: float = 0.9
  chunk_blocks: int = 64          # query blocks per scoring chunk, key blocks per tile side
                                  # (speed and memory, not the result)
  # Up to this many chunks (16 of 64 blocks: 128K tokens) each chunk scores its causal prefix
  # in one operation of fixed shape, no device loop and no tiles: 1.5x faster than the loop
  # of tiles at 64K and 128K tokens on an H100 (benchmarks/README.md). More chunks run in
  # the loop, whose memory does not grow with the length. Speed and memory, not the result.
  unroll_chunks: int = 16

  def __post_init__(self):
    if self.stride < 1 or self.block < 1 or self.block % self.stride:
      raise ValueError(f"XAttention block ({self.block}) must be a positive multiple of its "
                       f"stride ({self.stride})")
    if not 0.0 < self.threshold <= 1.0:
      raise ValueError(f"XAttention threshold must be in (0, 1], got {self.threshold}")
    if self.chunk_blocks < 1:
      raise ValueError("XAttention chunk_blocks must be positive")
    if self.unroll_chunks < 0:
      raise ValueError("XAttention unroll_chunks must be non-negative")


def num_blocks(t: int, xa: XAttention) -> int:
  return -(-t // xa.block)


@functools.partial(jax.jit, static_argnames=("xa",))
def block_mass(q_btnh: jax.Array, k_btkh: jax.Array, xa: XAttention,
               segment_ids_bt: jax.Array | None = None) -> jax.Array:
  """Antidiagonal block masses A [B, K, nb, nb] float32 (zero above the diagonal).

  The stride rows are cut into chunks of at most `chunk_blocks` query blocks (as even as
  they divide) and the stride columns into tiles of as many key blocks; a chunk scores only
  the tiles on or left of its diagonal (n(n+1)/2 of n^2 tiles for n chunks), in one pass:
  each tile's probabilities are summed per key block relative to the tile's own row maxima,
  and once the chunk's tiles are done the rows' softmax is assembled from those partial sums
  (weights exp(tile max - row max), exact, no second product). Memory per head:
  O(rows x (rows + nb)) for rows = chunk_blocks * block/S. The chunks and their tiles run in
  loops. Up to `unroll_chunks` chunks (the default) there is no device loop and no tiles:
  each chunk forms its whole causal prefix of stride columns in one product, of fixed shape,
  and its rows' softmax directly; memory per head O(rows x ns), ns = T/S (the last chunk's
  float32 scores at 128K tokens: 16 MiB a query head). Both forms give the same masses."""
  b, t, n, d = q_btnh.shape
  kh = k_btkh.shape[2]
  g = n // kh
  s, blk = xa.stride, xa.block
  nb = num_blocks(t, xa)
  per_blk = blk // s                       # stride rows per block
  n_chunks = -(-nb // xa.chunk_blocks)
  chunk = -(-nb // n_chunks)               # balanced: the padding stays under one chunk
  rows = chunk * per_blk                   # stride rows of a chunk, stride columns of a tile
  tp = n_chunks * chunk * blk              # whole chunks: every chunk has the same shape
  ns = tp // s                             # stride rows
  real = -(-t // s)                        # stride rows holding at least one real token
  pad = lambda x: jnp.pad(x, [(0, 0), (0, tp - t)] + [(0, 0)] * (x.ndim - 2))
  # q_r: [B, K, G, ns, S*H] with the S tokens of each stride row in reverse order.
  q_r = pad(q_btnh).reshape(b, ns, s, kh, g, d)[:, :, ::-1]
  q_r = q_r.transpose(0, 3, 4, 1, 2, 5).reshape(b, kh, g, ns, s * d)
  k_r = pad(k_btkh).reshape(b, ns, s, kh, d).transpose(0, 3, 1, 2, 4).reshape(b, kh, ns, s * d)
  if segment_ids_bt is None:
    seg_s = jnp.zeros((b, ns), jnp.int32)
  else:
    seg_s = pad(segment_ids_bt)[:, ::s]    # a stride row's segment: that of its first token
  scale = 1.0 / (d ** 0.5 * s)
  # Half-precision q and k: their products are exact in float32, so the tensor cores' default
  # (float32 accumulation) gives the scores at full speed; float32 inputs ask for HIGHEST, not
  # the GPU default (TF32 operands).
  half = jnp.dtype(q_btnh.dtype).itemsize == 2
  precision = jax.lax.Precision.DEFAULT if half else jax.lax.Precision.HIGHEST
  cut = lambda x, start, axis: jax.lax.dynamic_slice_in_dim(x, start, rows, axis=axis)

  unrolled = n_chunks <= xa.unroll_chunks

  def block_sums(q_c, k_c, i, j, seg_i, seg_j):
    """Stride rows i against columns j: per row the maximum of its visible scores and
    exp(score - that maximum) summed per key block, [B, K, G, R, |j| / per_blk]."""
    scores = jnp.einsum("bkgrx,bkcx->bkgrc", q_c, k_c, precision=precision,
                        preferred_element_type=jnp.float32) * scale
    ok = ((j[None, None, :] <= i[None, :, None]) & (j < real)[None, None, :]
          & (i < real)[None, :, None] & (seg_i[:, :, None] == seg_j[:, None, :]))
    scores = jnp.where(ok[:, None, None], scores, MASK_VALUE)           # [B, K, G, R, C]
    m = scores.max(axis=-1)
    e = jnp.exp(scores - m[..., None]) * ok[:, None, None]
    return e.reshape(*e.shape[:-1], j.shape[0] // per_blk, per_blk).sum(-1), m

  def group_mean(part):                    # [B, K, G, rows, nb''] -> [B, K, chunk, nb']
    p = _row_normalised(part).reshape(b, kh, g, chunk, per_blk, part.shape[-1])
    p = p.sum(4).mean(2)                   # each block's rows summed, the group's mean
    return jnp.pad(p, [(0, 0)] * 3 + [(0, n_chunks * chunk - p.shape[-1])])

  def prefix_chunk(r: int):                # unrolled: chunk r against its causal prefix
    now, before = slice(r * rows, (r + 1) * rows), slice(0, (r + 1) * rows)
    part, _ = block_sums(q_r[:, :, :, now], k_r[:, :, before], r * rows + jnp.arange(rows),
                         jnp.arange((r + 1) * rows), seg_s[:, now], seg_s[:, before])
    return group_mean(part)

  def one_chunk(r):                        # in the device loop: tiles of the chunk's row
    i = r * rows + jnp.arange(rows)
    q_c, seg_i = cut(q_r, r * rows, 3), cut(seg_s, r * rows, 1)

    def tile(c, carry):                    # the (r, c) tile, c <= r
      part, tile_max = carry
      e, m = block_sums(q_c, cut(k_r, c * rows, 2), i, c * rows + jnp.arange(rows), seg_i,
                        cut(seg_s, c * rows, 1))
      part = jax.lax.dynamic_update_slice_in_dim(part, e[..., None, :], c, axis=4)
      return part, jax.lax.dynamic_update_slice_in_dim(tile_max, m[..., None], c, axis=4)

    # Tiles right of the diagonal keep zero partial sums and the mask value as maximum.
    carry = (jnp.zeros((b, kh, g, rows, n_chunks, chunk), jnp.float32),
             jnp.full((b, kh, g, rows, n_chunks), MASK_VALUE, jnp.float32))
    return group_mean(_weighted_tiles(*jax.lax.fori_loop(0, r + 1, tile, carry)))

  if unrolled:                             # [n_chunks, B, K, chunk, nb']
    out = jnp.stack([prefix_chunk(r) for r in range(n_chunks)])
  else:
    out = jax.lax.map(one_chunk, jnp.arange(n_chunks))
  out = out.transpose(1, 2, 0, 3, 4).reshape(b, kh, n_chunks * chunk, n_chunks * chunk)
  return out[:, :, :nb, :nb]


def _weighted_tiles(part, tile_max):
  """Partial block sums of several tiles, each relative to its rows' own maxima, [..., nt,
  blocks] with tile_max [..., nt], on one scale: exp(tile max - row max) x part, [...,
  nt * blocks]. Tiles never reached hold zero sums (their maxima are then irrelevant)."""
  weight = jnp.exp(tile_max - tile_max.max(axis=-1, keepdims=True))
  return (part * weight[..., None]).reshape(*part.shape[:-2], -1)


def _row_normalised(part):
  """Block sums on one scale per row -> the row's probability mass per block (rows with no
  visible column stay zero)."""
  total = part.sum(axis=-1, keepdims=True)
  return part / jnp.where(total > 0, total, 1.0)


def forced_blocks(t: int, xa: XAttention, segment_ids_bt: jax.Array | None = None,
                  batch: int = 1) -> jax.Array:
  """Blocks kept whatever their mass, [B, nb, nb] bool: block 0 and the diagonal; in packed
  rows also, for each query block, the blocks where its tokens' segments start."""
  nb = num_blocks(t, xa)
  i = jnp.arange(nb)
  forced = (i[None, :] == 0) | (i[None, :] == i[:, None])
  forced = jnp.broadcast_to(forced[None], (batch, nb, nb))
  if segment_ids_bt is None:
    return forced
  seg = segment_ids_bt
  tok = jnp.arange(t)
  starts = jnp.concatenate([jnp.ones((seg.shape[0], 1), bool), seg[:, 1:] != seg[:, :-1]], 1)
  start_pos = jax.lax.cummax(jnp.where(starts, tok[None], 0), axis=1)      # [B, T]
  rows = jnp.broadcast_to(tok[None] // xa.block, seg.shape)
  bidx = jnp.broadcast_to(jnp.arange(seg.shape[0])[:, None], seg.shape)
  return forced.at[bidx, rows, start_pos // xa.block].set(True)


def select_blocks(mass_bkij: jax.Array, threshold: float,
                  forced_bij: jax.Array | None = None) -> jax.Array:
  """Kept blocks [B, K, nb, nb] bool from the block masses (steps 4 of the module docstring):
  the forced blocks, then the others in descending mass while kept < threshold x row mass."""
  nb = mass_bkij.shape[-1]
  i = jnp.arange(nb)
  causal = (i[None, :] <= i[:, None])[None, None]
  if forced_bij is None:
    forced_bij = ((i[None, :] == 0) | (i[None, :] == i[:, None]))[None]
  forced = forced_bij[:, None] & causal
  mass = jnp.where(causal, mass_bkij, 0.0)
  row = mass.sum(-1, keepdims=True)
  base = jnp.where(forced, mass, 0.0).sum(-1, keepdims=True)
  cand = jnp.where(causal & ~forced, mass, -1.0)          # -1: not a candidate
  # The candidates in descending mass are taken as a prefix; its length k and its last value
  # come from the sorted masses alone (no argsort, no scatter back through the permutation).
  ranked = -jnp.sort(-cand, axis=-1)
  gained = jnp.maximum(ranked, 0.0)
  before = jnp.cumsum(gained, axis=-1) - gained           # kept mass before each candidate
  k = ((ranked >= 0.0) & (base + before < threshold * row)).sum(-1, keepdims=True)
  last = jnp.take_along_axis(ranked, jnp.maximum(k - 1, 0), axis=-1)
  # Taken: every candidate heavier than the last one, and of those tied with it the k - (the
  # heavier ones) with the lowest J (ties: lower J first).
  heavier = cand > last
  tied = cand == last
  slots = k - heavier.sum(-1, keepdims=True)
  taken = (k > 0) & (heavier | (tied & (jnp.cumsum(tied, axis=-1) <= slots)))
  return forced | taken


# The XAttention scoring kernels by implementation name, registered by `registry` from the
# backends' records (`backend.XAScorer`); "reference" is `block_mass` here.
SCORERS: dict = {}


def register_scorer(name: str, scorer) -> None:
  """Make `select(..., attn_impl=name)` run `scorer` (a `backend.XAScorer`)."""
  SCORERS[name] = scorer


def select(q_btnh, k_btkh, xa: XAttention, segment_ids_bt=None, attn_impl: str = "reference"
           ) -> jax.Array:
  """Scoring then selection: kept blocks [B, K, nb, nb] bool (no gradient flows through).

  attn_impl: "reference" (plain jnp, `block_mass`); a backend's name, its scoring kernel where
  it takes the call (`mosaic_gpu`: the Mosaic GPU kernel, unpacked rows in its layout;
  `pallas_gpu`: the Triton kernel, unpacked rows), interpret mode off a GPU, else the
  reference; "auto": the kernel the backends prefer on this machine (the Mosaic GPU kernel on
  a Hopper GPU while its partial sums, which grow as T^2, stay within
  `mosaic_gpu.scoring.AUTO_BYTES`), else the plain-jnp scoring, whose memory past 128K tokens
  does not grow with the length. All select the same blocks up to float32 ties at the
  threshold; their times side by side: `benchmarks/xattention.py` and its records
  (benchmarks/records/xattention.md).
  """
  if attn_impl not in ("reference", "auto") and attn_impl not in SCORERS:
    raise ValueError(f"XAttention scoring implementation '{attn_impl}' is unknown (known: "
                     f"{', '.join(['reference', 'auto', *SCORERS])})")
  q_btnh, k_btkh = jax.lax.stop_gradient(q_btnh), jax.lax.stop_gradient(k_btkh)
  on_gpu = jax.default_backend() == "gpu"
  packed = segment_ids_bt is not None

  def takes(scorer):
    return scorer.takes(q_btnh.shape, k_btkh.shape, q_btnh.dtype, xa, packed)

  if attn_impl == "auto":
    attn_impl = next((name for name, s in SCORERS.items()
                      if on_gpu and takes(s) and s.preferred(q_btnh.shape, xa)), "reference")
  scorer = SCORERS.get(attn_impl)
  if scorer is not None and takes(scorer):
    mass = scorer.block_mass(q_btnh, k_btkh, xa, interpret=not on_gpu)
  else:
    mass = block_mass(q_btnh, k_btkh, xa, segment_ids_bt)
  forced = forced_blocks(q_btnh.shape[1], xa, segment_ids_bt, q_btnh.shape[0])
  return select_blocks(mass, xa.threshold, forced)


def block_lists(keep_bkij: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Compact lists of the kept blocks: (index [B, K, nb, nb] int32, the kept blocks of row I
  first in ascending order; count [B, K, nb] int32). The transposed mask gives, per key block,
  the query blocks that read it (the backward's walk)."""
  nb = keep_bkij.shape[-1]
  j = jnp.arange(nb, dtype=jnp.int32)
  index = jnp.argsort(jnp.where(keep_bkij, j, nb + j), axis=-1).astype(jnp.int32)
  return index, keep_bkij.sum(-1).astype(jnp.int32)


def kept_fraction(keep_bkij: jax.Array, lengths_b: jax.Array, block: int) -> jax.Array:
  """Fraction of the causal (query, key) pairs that the kept blocks attend, [B, K], for rows
  of `lengths_b` real tokens (token-causal within the diagonal block)."""
  nb = keep_bkij.shape[-1]
  i = jnp.arange(nb)
  n = lengths_b.astype(jnp.float32)[:, None]                               # [B, 1]
  rows = jnp.clip(n - i[None] * block, 0.0, float(block))                  # real rows per block
  below = (keep_bkij & (i[None, :] < i[:, None])[None, None]).astype(jnp.float32)
  # A kept block J < I is whole: all of its keys precede every row of block I.
  attended = (jnp.einsum("bkij,bi->bk", below, rows) * block
              + (rows * (rows + 1) / 2).sum(-1)[:, None])
  total = n * (n + 1) / 2
  return attended / jnp.maximum(total, 1.0)


# ----------------------------------------------------------------------------------------------
# The scoring as a Pallas kernel (Triton backend on GPUs; `interpret=True` on CPU).


def _mass_kernel(q_ref, k_ref, part_ref, max_ref, sum_ref, *, stride, rows, cols, per_block,
                 real, scale):
  """Partial block masses of one (batch, query head, chunk of `rows` stride rows), in one walk
  over the stride columns up to the chunk's causal end: per tile, each row's maximum over the
  tile (max_ref's row of that tile), the row's exp(score - that maximum) summed per key
  block (part_ref's columns of the tile's blocks, an indicator product) and over the tile
  (sum_ref's row). `block_mass_pallas` weighs the tiles by their maxima and normalises the
  rows after the kernel, as `block_mass` does per chunk (exact, no second product). q_r . k_r
  is formed as the sum over t of Q_t K_t^T with Q_t = q[i*S + S-1-t] and K_t = k[j*S + t], so
  the antidiagonal reshape is never materialised."""
  from jax.experimental import pallas as pl
  chunk = pl.program_id(2)
  i = chunk * rows + jnp.arange(rows)
  n_tiles = (jnp.minimum((chunk + 1) * rows, real) + cols - 1) // cols
  per_tile = cols // per_block
  # Indicator: stride column c -> its key block.
  col_blk = (jax.lax.broadcasted_iota(jnp.int32, (cols, per_tile), 0) // per_block
             == jax.lax.broadcasted_iota(jnp.int32, (cols, per_tile), 1)).astype(jnp.float32)

  def tile(c, carry):
    def antidiagonal(t, s):      # one (Q_t, K_t) pair live at a time (shared memory)
      q_t = q_ref[:, stride - 1 - t, :]
      k_t = k_ref[pl.ds(c * cols, cols), t, :]
      return s + jnp.dot(q_t, k_t.T, preferred_element_type=jnp.float32)

    s = jax.lax.fori_loop(0, stride, antidiagonal, jnp.zeros((rows, cols), jnp.float32))
    j = c * cols + jnp.arange(cols)
    ok = (j[None, :] <= i[:, None]) & (j[None, :] < real) & (i[:, None] < real)
    s = jnp.where(ok, s * scale, MASK_VALUE)
    m = s.max(axis=1)
    e = jnp.where(ok, jnp.exp(s - m[:, None]), 0.0)
    sums = jnp.dot(e, col_blk, precision=jax.lax.Precision.HIGHEST,
                   preferred_element_type=jnp.float32)
    part_ref[:, pl.ds(c * per_tile, per_tile)] = sums
    max_ref[pl.ds(c, 1), :] = m[None, :]
    sum_ref[pl.ds(c, 1), :] = sums.sum(axis=1)[None, :]
    return carry

  jax.lax.fori_loop(0, n_tiles, tile, None)


@functools.partial(jax.jit, static_argnames=("xa", "interpret", "backend"))
def block_mass_pallas(q_btnh: jax.Array, k_btkh: jax.Array, xa: XAttention,
                      interpret: bool = False, backend: str = "gpu") -> jax.Array:
  """`block_mass` (unpacked rows) as a Pallas kernel: [B, K, nb, nb] float32.

  Grid (batch, query head, chunks of stride rows); each program reads its KV head's keys in
  tiles and writes each row's per-tile maxima and partial block sums (`_mass_kernel`, one
  product per tile); the rows' softmax, the sums over a query block's rows and the mean over
  the group follow in jnp. Memory: those partial sums, float32 [B, N, T/S, nb] (1 GiB at
  128K tokens with 32 query heads; `block_mass` bounds its own per chunk). Rows per program:
  16 query blocks (at least 16 rows, so the indicator product has 16-row operands); columns
  per tile likewise 16 key blocks' stride columns. backend "gpu" (Triton; `interpret=True`
  on CPU) or "tpu" (Pallas TPU interpret mode only: its strided loads are not laid out for
  Mosaic, nor tuned on a TPU)."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plgpu
  from jax.experimental.pallas import tpu as pltpu
  if backend not in ("gpu", "tpu") or (backend == "tpu" and not interpret):
    raise ValueError(f"the scoring kernel runs on backend 'gpu', or 'tpu' in interpret mode; "
                     f"got {backend!r} with interpret={interpret}")
  if backend == "gpu":
    backend_kw = dict(compiler_params=plgpu.CompilerParams(num_warps=8, num_stages=2),
                      interpret=interpret)
  else:
    backend_kw = dict(interpret=pltpu.InterpretParams())
  b, t, n, d = q_btnh.shape
  kh = k_btkh.shape[2]
  g = n // kh
  s = xa.stride
  per_block = xa.block // s
  nb = num_blocks(t, xa)
  rows = cols = 16 * per_block
  ns = -(-(nb * per_block) // rows) * rows
  real = -(-t // s)
  dp = max(16, pl.next_power_of_2(d))
  pad = lambda x: jnp.pad(x, [(0, 0), (0, ns * s - t), (0, 0), (0, dp - d)])
  q5 = pad(q_btnh).reshape(b, ns, s, n, dp)
  k5 = pad(k_btkh).reshape(b, ns, s, kh, dp)
  nbo, nt = ns // per_block, ns // cols          # blocks and tiles a side
  kernel = functools.partial(_mass_kernel, stride=s, rows=rows, cols=cols,
                             per_block=per_block, real=real, scale=1.0 / (d ** 0.5 * s))
  part, tile_max, tile_sum = pl.pallas_call(
      kernel,
      grid=(b, n, ns // rows),
      in_specs=[pl.BlockSpec((None, rows, s, None, dp), lambda i, h, c: (i, c, 0, h, 0)),
                pl.BlockSpec((None, ns, s, None, dp), lambda i, h, c: (i, 0, 0, h // g, 0))],
      out_specs=[pl.BlockSpec((None, None, rows, nbo), lambda i, h, c: (i, h, c, 0)),
                 pl.BlockSpec((None, None, nt, rows), lambda i, h, c: (i, h, 0, c)),
                 pl.BlockSpec((None, None, nt, rows), lambda i, h, c: (i, h, 0, c))],
      out_shape=[jax.ShapeDtypeStruct((b, n, ns, nbo), jnp.float32),
                 jax.ShapeDtypeStruct((b, n, nt, ns), jnp.float32),
                 jax.ShapeDtypeStruct((b, n, nt, ns), jnp.float32)],
      name="xattention_block_mass",
      **backend_kw,
  )(q5, k5)
  return masses_from_tiles(part, tile_max, tile_sum, num_kv_heads=kh, rows=rows, cols=cols,
                           per_block=per_block, real=real, nb=nb)


def masses_from_tiles(part: jax.Array, tile_max: jax.Array, tile_sum: jax.Array, *,
                      num_kv_heads: int, rows: int, cols: int, per_block: int, real: int,
                      nb: int) -> jax.Array:
  """A scoring kernel's outputs -> block masses [B, K, nb, nb] float32 (zero above the
  diagonal). part [B, N, ns, nb'] float32: per stride row, exp(score - the tile's maximum)
  summed per key block; tile_max [B, N, nt, ns]: each row's maximum per tile of `cols` stride
  columns (natural-log units); tile_sum [B, N, nt, ns]: the row's part summed over the tile.
  A kernel program covers `rows` stride rows and writes the tiles that start before min(its
  rows' end, real), i.e. hold a column one of its rows may see (the rest of the outputs is
  never written, and ignored here). The rows' normalisers come from the small per-tile
  arrays, so the partial sums are read once: each row's tile is weighed by exp(tile max - row
  max) / (the row's total x G), and the weighted sums are added over a query block's rows and
  the group's heads."""
  b, n, ns, nbo = part.shape
  nt = tile_max.shape[2]
  kh = num_kv_heads
  g = n // kh
  row_end = jnp.minimum((jnp.arange(ns) // rows + 1) * rows, real)
  written = jnp.arange(nt)[None, :] * cols < row_end[:, None]              # [ns, nt]
  tile_max = jnp.where(written, jnp.swapaxes(tile_max, 2, 3), MASK_VALUE)  # [B, N, ns, nt]
  tile_sum = jnp.where(written, jnp.swapaxes(tile_sum, 2, 3), 0.0)
  weight = jnp.exp(tile_max - tile_max.max(axis=-1, keepdims=True))
  total = (weight * tile_sum).sum(axis=-1, keepdims=True)
  coef = weight / (jnp.where(total > 0, total, 1.0) * g)   # rows with no visible column: 0
  blocks = cols // per_block
  part = jnp.where(written[..., None], part.reshape(b, n, ns, nt, blocks), 0.0)
  mass = (part.reshape(b, kh, g, nbo, per_block, nt, blocks)
          * coef.reshape(b, kh, g, nbo, per_block, nt, 1)).sum((2, 4)).reshape(b, kh, nbo, nbo)
  causal = jnp.tril(jnp.ones((nbo, nbo), bool))[None, None]
  return jnp.where(causal, mass, 0.0)[:, :, :nb, :nb]
