"""XAttention's block scoring for Hopper GPUs in Pallas Mosaic GPU (wgmma, TMA): the
antidiagonal scores never leave the chip.

`xattention.block_mass` forms each chunk's float32 scores in memory and reads them back for the
softmax; this kernel forms them a tile at a time in registers, at the tensor cores' rate.
Per program, one memory warpgroup streams operand tiles into a ring of shared-memory slots
with the bulk copy engine (TMA) and two compute warpgroups, two query heads of one KV head
over the same `rows` stride rows, share every key tile:
  * the (rows x cols) tile of scores q_r . k_r (`xattention`'s module docstring) is the sum
    over t < S of Q_t K_t^T, Q_t = q[i*S + S-1-t] and K_t = k[j*S + t]: S products of depth H
    into one wgmma accumulator, so the antidiagonal reshape is never materialised (the
    Triton scoring kernel's decomposition, `xattention._mass_kernel`);
  * per row, the tile's maximum m over its visible columns (causal, real, as `block_mass`
    masks them), and exp(score - m) summed per key block by a second product with a 0/1
    indicator [cols, cols / (block / S)] on the tensor cores; exp(score - m) enters it as two
    float16 halves (hi + lo, scaled by 2^14), so the sums keep about 22 bits;
  * outputs per (batch, query head): the partial block sums [ns, nb'], the tile maxima
    [nt, ns] and each row's sum over the tile [nt, ns], as the Triton kernel's; the rows'
    softmax across tiles, the sums over a query block's rows and the mean over the group
    follow in jnp, one pass over the partial sums (`xattention.masses_from_tiles`).
A program walks the column tiles on or left of its rows' diagonal (those holding a real
column), S x H / depth steps each (`Tiles.score_depth`: a step's share of head_dim);
programs start heaviest first. Padding: T up to whole tiles of stride
rows and columns; padded keys and queries are masked.

Natively its block masses agree with `block_mass`'s to float32 rounding and select the same
blocks, and it is faster than `block_mass` at 32K and 128K tokens on Hopper GPUs, so
`xattention.select(attn_impl="auto")` runs it there (`benchmarks/xattention.py`; the figures
and the tile sweep that chose the defaults: benchmarks/records/xattention.md).

Its layout constraints (`applies`): bf16 or fp16, head_dim a multiple of the step's depth,
G even (the two warpgroups' query heads share a KV head), tiles of columns whose key blocks
number a multiple of 16 (the indicator product's width), and the ring within shared memory.
Interpret mode (`interpret=True`) runs it on a CPU, where the indicator product's left operand
goes through shared memory (the interpreter's wgmma reads only shared memory); there each
warpgroup runs in a host thread that blocks at barriers, so XLA's CPU client needs threads to
spare (the tests and the benchmarks' dry runs set --xla_force_host_platform_device_count=8;
with the default thread count on two cores it can stall).

Shape letters: B batch, T tokens, N query heads, K KV heads, G = N / K, H head dim, S the
stride.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from elastic_jax.attention.mosaic_gpu.forward import SMEM_BYTES
from elastic_jax.attention.mosaic_gpu.tiles import (  # noqa: F401  (ScoringTiles: deprecated)
    DEFAULT_TILES, ScoringTiles, Tiles)
from elastic_jax.attention.reference import MASK_VALUE
from elastic_jax.attention.xattention import XAttention, masses_from_tiles, num_blocks

try:  # the Mosaic GPU dialect ships with jaxlib; keep the package importable without it
  from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover
  plgpu = None

_LOG2E = math.log2(math.e)
_COMPUTE_WGS = 2
_SUM_SCALE = 2.0 ** 14     # exp(score - m) <= 1, scaled into float16's normal range
# The most memory `xattention.select(attn_impl="auto")` gives this kernel's partial sums
# (2 GiB: up to 128K tokens with 64 query heads, about 180K with 32).
AUTO_BYTES = 2 << 30


DEFAULT_SCORING_TILES = DEFAULT_TILES   # deprecated: the one Tiles holds the scoring's fields


def _smem_bytes(itemsize: int, blocks: int, tiles: Tiles) -> int:
  align = lambda n: -(-n // 1024) * 1024   # each allocation starts on 1024 bytes
  rows, cols, depth = tiles.score_rows, tiles.score_cols, tiles.score_depth
  ring = tiles.score_slots * (align(_COMPUTE_WGS * rows * depth * itemsize)
                              + align(cols * depth * itemsize))
  return (ring + align(cols * blocks * 2) + align(_COMPUTE_WGS * rows * blocks * 4)
          + 2 * align(_COMPUTE_WGS * rows * 4) + 2304)   # + barriers, reserved


def applies(q_shape, k_shape, dtype, xa: XAttention,
            tiles: Tiles = DEFAULT_TILES) -> bool:
  """Whether `block_mass_mosaic` takes these shapes (module docstring's constraints)."""
  _, _, n, d = q_shape
  kh = k_shape[2]
  per_block = xa.block // xa.stride
  blocks = tiles.score_cols // per_block
  return (plgpu is not None and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
          and d % tiles.score_depth == 0 and tiles.score_depth % 32 == 0 and n % kh == 0
          and (n // kh) % 2 == 0 and tiles.score_rows == 64
          and tiles.score_cols % per_block == 0
          and blocks > 0 and blocks % 16 == 0 and tiles.score_cols % 64 == 0
          and _smem_bytes(jnp.dtype(dtype).itemsize, blocks, tiles) <= SMEM_BYTES)


def partial_sums_bytes(q_shape, xa: XAttention,
                       tiles: Tiles = DEFAULT_TILES) -> int:
  """Bytes of the kernel's partial block sums, float32 [B, N, ns, nb'] (they grow as T^2:
  1 GiB at 128K tokens with 32 query heads, 16 GiB at 512K)."""
  b, t, n, _ = q_shape
  ns = _stride_rows(t, xa, tiles)
  return 4 * b * n * ns * (ns // (xa.block // xa.stride))


def _stride_rows(t: int, xa: XAttention, tiles: Tiles) -> int:
  """Stride rows (and columns) after padding: whole tiles of rows and of columns."""
  per_block = xa.block // xa.stride
  unit = math.lcm(tiles.score_rows, tiles.score_cols, per_block)
  return -(-max(num_blocks(t, xa) * per_block, -(-t // xa.stride)) // unit) * unit


def _kernel(q_ref, k_ref, ind_ref, part_ref, max_ref, sum_ref, scoped, *, stride, per_block,
            real, scale, groups, tiles: Tiles, num_row_tiles):
  """One program: `rows` stride rows of two query heads of one KV head (module docstring)."""
  smem, ready, free = scoped
  q_smem, k_smem, ind_smem, part_smem, max_smem, sum_smem, e_smem = smem
  q_ready, k_ready, ind_ready = ready
  rows, cols = tiles.score_rows, tiles.score_cols
  depth, slots = tiles.score_depth, tiles.score_slots
  blocks = cols // per_block
  pieces = q_ref.shape[-1] // depth        # steps per stride offset t
  per_tile = stride * pieces               # steps per column tile
  b = lax.axis_index("b")
  hp = lax.axis_index("hp")
  # Heavy first: the last row tiles have the most column tiles to visit.
  row0 = (num_row_tiles - 1 - lax.axis_index("rt")) * rows
  wg = lax.axis_index("wg")
  kv_head = lax.div(hp * _COMPUTE_WGS, jnp.int32(groups))
  # Column tiles holding a column visible to some row of the tile (all of them up to the
  # real columns for rows past the real ones, whose sums are zero): the outputs' `written`.
  n_cols = (jnp.minimum(row0 + rows, real) + cols - 1) // cols
  steps = n_cols * per_tile
  # Tiles every one of whose columns each row sees: no mask.
  n_open = jnp.where(row0 + rows <= real, jnp.minimum((row0 + 1) // cols, real // cols), 0)
  ring = lambda s: lax.rem(s, jnp.int32(slots))

  def _compute():
    plgpu.set_max_registers(232, action="increase")
    head = hp * _COMPUTE_WGS + wg
    plgpu.barrier_wait(ind_ready)
    c2 = scale * _LOG2E

    def column_tile(c, carry, masked: bool):
      def products(acc_ref):
        def step(t, carry):
          s = c * per_tile + t
          slot = ring(s)
          plgpu.barrier_wait(k_ready.at[slot])
          plgpu.barrier_wait(q_ready.at[slot * _COMPUTE_WGS + wg])
          plgpu.wgmma(acc_ref, q_smem.at[slot, wg], k_smem.at[slot].transpose((1, 0)))
          plgpu.wgmma_wait(1)   # the step before is done: release its slot
          pl.when(t > 0)(lambda: plgpu.barrier_arrive(free.at[ring(s - 1)]))
          return carry

        lax.fori_loop(0, per_tile, step, None)
        plgpu.wgmma_wait(0)
        plgpu.barrier_arrive(free.at[ring(c * per_tile + per_tile - 1)])
        return acc_ref[...]

      x = pl.run_scoped(products, plgpu.ACC((rows, cols), jnp.float32)) * c2
      if masked:
        shape = (rows, cols)
        row = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA) + row0
        col = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA) + c * cols
        ok = (col <= row) & (col < real) & (row < real)
        x = jnp.where(ok, x, MASK_VALUE)
      m = x.max(axis=1)
      e = jnp.exp2(x - lax.broadcast_in_dim(m, x.shape, [0]))
      if masked:   # a row none of whose columns the tile shows has m = MASK_VALUE
        e = jnp.where(ok, e, 0.0)
      e = e * _SUM_SCALE
      hi = e.astype(jnp.float16)
      lo = (e - hi.astype(jnp.float32)).astype(jnp.float16)

      def block_sums(acc_ref):
        for half in (hi, lo):
          if e_smem is None:
            plgpu.wgmma(acc_ref, half, ind_smem)
          else:   # interpret mode: the operand through shared memory
            e_smem.at[wg][...] = half
            plgpu.commit_smem()
            plgpu.wgmma(acc_ref, e_smem.at[wg], ind_smem)
        return acc_ref[...]

      sums = pl.run_scoped(block_sums, plgpu.ACC((rows, blocks), jnp.float32))
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the previous tile's stores have read
      sums = sums * (1.0 / _SUM_SCALE)
      part_smem.at[wg][...] = sums
      max_smem.at[wg][...] = m * math.log(2.0)          # natural-log units, as block_mass's
      sum_smem.at[wg][...] = sums.sum(axis=1)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(part_smem.at[wg],
                              part_ref.at[b, head, pl.ds(row0, rows), pl.ds(c * blocks, blocks)])
      plgpu.copy_smem_to_gmem(max_smem.at[wg], max_ref.at[b, head, c, pl.ds(row0, rows)])
      plgpu.copy_smem_to_gmem(sum_smem.at[wg], sum_ref.at[b, head, c, pl.ds(row0, rows)])
      return carry

    lax.fori_loop(0, n_open, functools.partial(column_tile, masked=False), None)
    lax.fori_loop(n_open, n_cols, functools.partial(column_tile, masked=True), None)
    plgpu.wait_smem_to_gmem(0)

  def _memory():
    plgpu.set_max_registers(40, action="decrease")
    plgpu.copy_gmem_to_smem(ind_ref, ind_smem, ind_ready)

    def load(s, slot):
      c, r = lax.div(s, jnp.int32(per_tile)), lax.rem(s, jnp.int32(per_tile))
      t, piece = lax.div(r, jnp.int32(pieces)), lax.rem(r, jnp.int32(pieces))
      cut = pl.ds(piece * depth, depth)
      for w in range(_COMPUTE_WGS):
        plgpu.copy_gmem_to_smem(
            q_ref.at[b, pl.ds(row0, rows), stride - 1 - t, hp * _COMPUTE_WGS + w, cut],
            q_smem.at[slot, w], q_ready.at[slot * _COMPUTE_WGS + w])
      plgpu.copy_gmem_to_smem(k_ref.at[b, pl.ds(c * cols, cols), t, kv_head, cut],
                              k_smem.at[slot], k_ready.at[slot])

    for i in range(slots):
      pl.when(i < steps)(functools.partial(load, jnp.int32(i), i))

    @pl.loop(0, jnp.maximum(steps - slots, 0))
    def _(s):
      slot = ring(s)
      plgpu.barrier_wait(free.at[slot])
      load(s + slots, slot)

    @pl.loop(jnp.maximum(steps - slots, 0), steps)
    def _(s):  # observe the last releases too, so every barrier phase is consumed
      plgpu.barrier_wait(free.at[ring(s)])

  pl.when(wg < _COMPUTE_WGS)(_compute)
  pl.when(wg == _COMPUTE_WGS)(_memory)


def _transforms(minor: int, dtype):
  bits = jnp.dtype(dtype).itemsize * 8
  swizzle = plgpu.find_swizzle(minor * bits)
  return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def _call(q5, k5, ind, *, stride, per_block, real, scale, tiles: Tiles, interpret):
  """The kernel over padded inputs q5 [B, ns, S, N, H], k5 [B, ns, S, K, H] and the indicator
  [cols, blocks] float16: (part float32 [B, N, ns, nb'], tile maxima and tile sums float32
  [B, N, nt, ns])."""
  b, ns, _, n, d = q5.shape
  kh = k5.shape[3]
  rows, cols = tiles.score_rows, tiles.score_cols
  depth, slots = tiles.score_depth, tiles.score_slots
  blocks = cols // per_block
  dtype = q5.dtype

  def entry(q_ref, k_ref, ind_ref, part_ref, max_ref, sum_ref):
    def program(*scoped):
      _kernel(q_ref, k_ref, ind_ref, part_ref, max_ref, sum_ref, scoped, stride=stride,
              per_block=per_block, real=real, scale=scale, groups=n // kh, tiles=tiles,
              num_row_tiles=ns // rows)

    pl.run_scoped(
        program,
        (plgpu.SMEM((slots, _COMPUTE_WGS, rows, depth), dtype,
                    transforms=_transforms(depth, dtype)),
         plgpu.SMEM((slots, cols, depth), dtype, transforms=_transforms(depth, dtype)),
         plgpu.SMEM((cols, blocks), jnp.float16, transforms=_transforms(blocks, jnp.float16)),
         plgpu.SMEM((_COMPUTE_WGS, rows, blocks), jnp.float32,
                    transforms=_transforms(blocks, jnp.float32)),
         plgpu.SMEM((_COMPUTE_WGS, rows), jnp.float32),
         plgpu.SMEM((_COMPUTE_WGS, rows), jnp.float32),
         plgpu.SMEM((_COMPUTE_WGS, rows, cols), jnp.float16,
                    transforms=_transforms(cols, jnp.float16)) if interpret else None),
        (plgpu.Barrier(num_barriers=slots * _COMPUTE_WGS), plgpu.Barrier(num_barriers=slots),
         plgpu.Barrier()),
        plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=slots),
        collective_axes="wg",
    )

  kwargs = {"interpret": plgpu.InterpretGPUParams()} if interpret else {}
  return plgpu.kernel(
      entry,
      out_type=(jax.ShapeDtypeStruct((b, n, ns, ns // per_block), jnp.float32),
                jax.ShapeDtypeStruct((b, n, ns // cols, ns), jnp.float32),
                jax.ShapeDtypeStruct((b, n, ns // cols, ns), jnp.float32)),
      grid=(n // _COMPUTE_WGS, ns // rows, b),
      grid_names=("hp", "rt", "b"),
      num_threads=_COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      **kwargs,
  )(q5, k5, ind)


@functools.partial(jax.jit, static_argnames=("xa", "tiles", "interpret"))
def block_mass_mosaic(q_btnh: jax.Array, k_btkh: jax.Array, xa: XAttention, *,
                      tiles: Tiles = DEFAULT_TILES,
                      interpret: bool = False) -> jax.Array:
  """`xattention.block_mass` (unpacked rows) on the Mosaic GPU kernel: [B, K, nb, nb] float32.
  Raises ValueError where the kernel does not take the shapes (`applies`). Memory: the partial
  sums, float32 [B, N, T/S, nb] (1 GiB at 128K tokens with 32 query heads)."""
  if not applies(q_btnh.shape, k_btkh.shape, q_btnh.dtype, xa, tiles):
    raise ValueError(
        f"the Mosaic GPU scoring kernel does not take q {q_btnh.shape} {q_btnh.dtype}, k "
        f"{k_btkh.shape} with stride {xa.stride}, block {xa.block} and {tiles} (it needs bf16 "
        "or fp16, head_dim a multiple of the step's depth, an even number of query heads per "
        "KV head, a multiple of 16 key blocks per tile of columns, and the ring within shared "
        "memory)")
  b, t, n, d = q_btnh.shape
  kh = k_btkh.shape[2]
  s = xa.stride
  per_block = xa.block // s
  real = -(-t // s)
  ns = _stride_rows(t, xa, tiles)
  pad = lambda x: jnp.pad(x, [(0, 0), (0, ns * s - t), (0, 0), (0, 0)])
  q5 = pad(q_btnh).reshape(b, ns, s, n, d)
  k5 = pad(k_btkh).reshape(b, ns, s, kh, d)
  blocks = tiles.score_cols // per_block
  ind = (jnp.arange(tiles.score_cols)[:, None] // per_block
         == jnp.arange(blocks)[None, :]).astype(jnp.float16)
  part, tile_max, tile_sum = _call(q5, k5, ind, stride=s, per_block=per_block, real=real,
                                   scale=1.0 / (d ** 0.5 * s), tiles=tiles,
                                   interpret=interpret)
  return masses_from_tiles(part, tile_max, tile_sum, num_kv_heads=kh, rows=tiles.score_rows,
                           cols=tiles.score_cols, per_block=per_block, real=real,
                           nb=num_blocks(t, xa))
