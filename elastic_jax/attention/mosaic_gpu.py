"""The hybrid FA/SSA inference forward for Hopper GPUs in Pallas Mosaic GPU (wgmma, TMA).

Warp-specialised, FlashAttention-3 style: per program, one memory warpgroup streams K/V tiles
into a ring of shared-memory slots with the bulk copy engine (TMA), and two compute
warpgroups run QK^T and PV on the tensor cores (wgmma) with an online softmax in registers,
taking turns on the tensor cores (a schedule barrier) so that one's softmax overlaps the
other's matrix products.

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
(one run-time branch, `hybrid_forward`); training runs the Triton kernels (`pallas_gpu`).
Its layout constraints (`applies`): bf16 or fp16, head_dim a multiple of 64, the streaming
block a multiple of the KV tile (128) so the window's edges fall on tile edges, and G even or
1. T is padded inside. Interpret mode (`interpret=True`) runs it on a CPU.

Shape letters: B batch, T tokens, N query heads, K KV heads, G = N / K, D head dim.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from elastic_jax.attention import pallas_gpu
from elastic_jax.attention.common import (MODE_SPARSE, kernel_or_reference, modes_from_gate,
                                          pad_to, with_fused_backward)
from elastic_jax.attention.reference import Streaming

try:  # the Mosaic GPU dialect ships with jaxlib; keep the package importable without it
  from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover
  plgpu = None

_LOG2E = math.log2(math.e)
_COMPUTE_WGS = 2


@dataclasses.dataclass(frozen=True)
class MosaicTiles:
  """Rows per compute warpgroup, keys per KV tile, K/V slots in the shared-memory ring."""
  block_q: int = 64
  block_kv: int = 128
  slots: int = 2


DEFAULT_TILES = MosaicTiles()


def applies(q_shape, k_shape, dtype, streaming: Streaming,
            tiles: MosaicTiles = DEFAULT_TILES) -> bool:
  """Whether this kernel takes a call of these shapes (else the Triton kernel does)."""
  if plgpu is None:
    return False
  n, d = q_shape[2], q_shape[3]
  kh = k_shape[2]
  groups = n // kh
  rows = _rows_per_program(groups, tiles)
  return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
          and d % 64 == 0 and d <= 256 and (groups == 1 or groups % 2 == 0)
          and streaming.block % tiles.block_kv == 0 and streaming.block % rows == 0
          and tiles.block_kv % rows == 0 and tiles.block_q % 64 == 0
          and tiles.block_kv % 64 == 0 and tiles.slots >= 2)


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


def _tile_of(step, sink_end, second_start):
  return jnp.where(step < sink_end, step, second_start + step - sink_end)


def _kernel(modes_ref, q_ref, k_ref, v_ref, out_ref, scoped, *, groups, num_kv_heads,
            streaming, tiles: MosaicTiles, scale, num_q_tiles):
  (qo_smem2, k_smem, v_smem, p_smem2), ready, (k_free, v_free), turn = scoped
  k_ready, v_ready, q_ready = ready
  block_q, block_kv, slots = tiles.block_q, tiles.block_kv, tiles.slots
  pair_heads = groups >= 2
  rows = _rows_per_program(groups, tiles)
  head_dim = q_ref.shape[-1]
  dtype = q_ref.dtype

  b = lax.axis_index("b")
  hp = lax.axis_index("hp")
  # Heavy first: programs launch in grid order, and the last query tiles have the most causal
  # tiles to visit, so they start first and the short ones fill the tail.
  qt = num_q_tiles - 1 - lax.axis_index("qt")
  wg = lax.axis_index("wg")
  heads_per_program = _COMPUTE_WGS if pair_heads else 1
  kv_head = lax.div(hp * heads_per_program, jnp.int32(groups))
  mode = modes_ref[b * num_kv_heads + kv_head]
  q_start = qt * rows
  steps, sink_end, second_start = walk(q_start, rows, mode, streaming, block_kv)

  def take_turn():
    plgpu.barrier_arrive(turn)
    plgpu.barrier_wait(turn)

  @pl.when(wg < _COMPUTE_WGS)
  def _compute():
    plgpu.set_max_registers(232, action="increase")
    qo_smem = qo_smem2.at[wg]
    head = hp * heads_per_program + (wg if pair_heads else 0)
    row0 = q_start + (0 if pair_heads else wg * block_q)
    plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(row0, block_q), head], qo_smem,
                            q_ready.at[wg])
    plgpu.barrier_wait(q_ready.at[wg])
    # Steps whose tile may hold keys after this warpgroup's first row need the causal mask;
    # they are the last ones (the window always reaches the diagonal).
    masked_from = steps - ((q_start + rows + block_kv - 1) // block_kv - row0 // block_kv)

    m_i = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32),
                            plgpu.Layout.WGMMA.reduce(1))
    l_i = plgpu.layout_cast(jnp.full((block_q,), 0.0, jnp.float32),
                            plgpu.Layout.WGMMA.reduce(1))
    acc = plgpu.layout_cast(jnp.full((block_q, head_dim), 0.0, jnp.float32),
                            plgpu.Layout.WGMMA)
    plgpu.barrier_wait(k_ready.at[0])
    pl.when(wg == 1)(take_turn)

    def step(s, carry, masked: bool):
      acc, m_i, l_i = carry
      slot = lax.rem(s, jnp.int32(slots))

      def qk(acc_ref):
        plgpu.wgmma(acc_ref, qo_smem, k_smem.at[slot].transpose((1, 0)))
        take_turn()
        return acc_ref[...]

      x = pl.run_scoped(qk, plgpu.ACC((block_q, block_kv), jnp.float32))
      plgpu.barrier_arrive(k_free.at[slot])
      if masked:
        tile = _tile_of(s, sink_end, second_start)
        row = plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 0,
                                     layout=plgpu.Layout.WGMMA)
        col = plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 1,
                                     layout=plgpu.Layout.WGMMA)
        x = jnp.where(row + row0 >= col + tile * block_kv, x, -jnp.inf)
      # Base-2 softmax with the scale folded in: m is kept scaled, p = exp2(x * c - m) is an FMA.
      c = scale * _LOG2E
      m_new = jnp.maximum(m_i, x.max(axis=1) * c)
      alpha = jnp.exp2(m_i - m_new)
      p = jnp.exp2(x * c - lax.broadcast_in_dim(m_new, x.shape, [0]))
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
      l_i = l_i * alpha + p.sum(axis=1)
      p_lo = p.astype(dtype)
      acc, l_i, m_new, p_lo = lax.optimization_barrier((acc, l_i, m_new, p_lo))
      plgpu.barrier_arrive(turn)
      plgpu.barrier_wait(v_ready.at[slot])
      plgpu.barrier_wait(turn)

      def pv(acc_ref):
        if p_smem2 is None:
          plgpu.wgmma(acc_ref, p_lo, v_smem.at[slot])
        else:
          p_smem2.at[wg][...] = p_lo
          plgpu.commit_smem()
          plgpu.wgmma(acc_ref, p_smem2.at[wg], v_smem.at[slot])
        nxt = s + 1

        @pl.when(nxt < steps)
        def _():
          plgpu.barrier_wait(k_ready.at[lax.rem(nxt, jnp.int32(slots))])

      if p_smem2 is None:  # wgmma adds into the running accumulator
        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
      else:  # a fresh accumulator added after: interpret mode has no run_state
        acc = acc + pl.run_scoped(lambda ref: pv(ref) or ref[...],
                                  plgpu.ACC((block_q, head_dim), jnp.float32))
      plgpu.barrier_arrive(v_free.at[slot])
      return acc, m_new, l_i

    carry = lax.fori_loop(0, masked_from, functools.partial(step, masked=False),
                          (acc, m_i, l_i))
    acc, m_i, l_i = lax.fori_loop(masked_from, steps, functools.partial(step, masked=True),
                                  carry)
    pl.when(wg == 0)(take_turn)
    acc = acc / lax.broadcast_in_dim(l_i, acc.shape, [0])
    qo_smem[...] = acc.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[b, pl.ds(row0, block_q), head])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == _COMPUTE_WGS)
  def _memory():
    plgpu.set_max_registers(40, action="decrease")

    def load(s, slot):
      rows_kv = pl.ds(_tile_of(s, sink_end, second_start) * block_kv, block_kv)
      plgpu.copy_gmem_to_smem(k_ref.at[b, rows_kv, kv_head], k_smem.at[slot], k_ready.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[b, rows_kv, kv_head], v_smem.at[slot], v_ready.at[slot])

    for i in range(slots):
      pl.when(i < steps)(functools.partial(load, jnp.int32(i), i))

    @pl.loop(0, jnp.maximum(steps - slots, 0))
    def _(s):
      slot = lax.rem(s, jnp.int32(slots))
      plgpu.barrier_wait(k_free.at[slot])
      plgpu.barrier_wait(v_free.at[slot])
      load(s + slots, slot)

    @pl.loop(jnp.maximum(steps - slots, 0), steps)
    def _(s):  # observe the last releases too, so every barrier phase is consumed
      slot = lax.rem(s, jnp.int32(slots))
      plgpu.barrier_wait(k_free.at[slot])
      plgpu.barrier_wait(v_free.at[slot])


def _call(q, k, v, modes, *, streaming: Streaming, tiles: MosaicTiles, scale, interpret):
  b, tp, n, d = q.shape
  kh = k.shape[2]
  groups = n // kh
  rows = _rows_per_program(groups, tiles)
  heads_per_program = _COMPUTE_WGS if groups >= 2 else 1
  slots = tiles.slots
  dtype = q.dtype

  def entry(modes_ref, q_ref, k_ref, v_ref, out_ref):
    item_bits = jnp.dtype(dtype).itemsize * 8
    transforms = (plgpu.TilingTransform((8, 1024 // item_bits)), plgpu.SwizzleTransform(128))
    pl.run_scoped(
        lambda *scoped: _kernel(modes_ref, q_ref, k_ref, v_ref, out_ref, scoped,
                                groups=groups, num_kv_heads=kh, streaming=streaming,
                                tiles=tiles, scale=scale, num_q_tiles=tp // rows),
        (plgpu.SMEM((_COMPUTE_WGS, tiles.block_q, d), dtype, transforms=transforms),
         plgpu.SMEM((slots, tiles.block_kv, d), dtype, transforms=transforms),
         plgpu.SMEM((slots, tiles.block_kv, d), dtype, transforms=transforms),
         # P goes to the tensor cores from registers; interpret mode's wgmma reads only
         # shared memory, so there P takes a trip through it.
         plgpu.SMEM((_COMPUTE_WGS, tiles.block_q, tiles.block_kv), dtype,
                    transforms=transforms) if interpret else None),
        (plgpu.Barrier(num_barriers=slots), plgpu.Barrier(num_barriers=slots),
         plgpu.Barrier(num_barriers=_COMPUTE_WGS)),
        (plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=slots),) * 2,
        plgpu.Barrier(num_arrivals=_COMPUTE_WGS),
        collective_axes="wg",
    )

  kwargs = {"interpret": plgpu.InterpretGPUParams()} if interpret else {}
  return plgpu.kernel(
      entry,
      out_type=jax.ShapeDtypeStruct(q.shape, dtype),
      grid=(n // heads_per_program, tp // rows, b),
      grid_names=("hp", "qt", "b"),
      num_threads=_COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      **kwargs,
  )(modes, q, k, v)


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
  hard = jnp.all((gate_bk <= 0.0) | (gate_bk >= 1.0))
  return lax.cond(
      hard,
      lambda: hybrid_forward_hard(q, k, v, gate_bk, streaming, tiles=tiles,
                                  interpret=interpret),
      lambda: pallas_gpu.hybrid_forward(q, k, v, gate_bk, streaming, interpret=interpret))


def make_hybrid(tiles: MosaicTiles = DEFAULT_TILES):
  """`pallas_gpu.make_hybrid` with this kernel as the undifferentiated forward where it
  `applies` (training keeps the Triton kernels)."""
  triton_forward, forward_train, backward = pallas_gpu.hybrid_parts()

  def forward(q, k, v, gate_bk, streaming, interpret):
    if applies(q.shape, k.shape, q.dtype, streaming, tiles):
      return hybrid_forward(q, k, v, gate_bk, streaming, tiles=tiles, interpret=interpret)
    return triton_forward(q, k, v, gate_bk, streaming, interpret)

  return with_fused_backward(forward, forward_train, backward)


hybrid_attention = functools.partial(kernel_or_reference, make_hybrid(),
                                     xa_kernel=pallas_gpu.make_xa_hybrid(),
                                     xa_kernel_applies=pallas_gpu.xa_kernel_applies,
                                     packed_kernel=pallas_gpu.make_packed_hybrid())
