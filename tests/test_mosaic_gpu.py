"""The Mosaic GPU inference forward against the reference: GPU interpret mode on CPU, native on
a GPU. Interpret mode runs everything but the two places the interpreter lacks (a register
operand for wgmma and run_state: there P goes through shared memory), so the schedule, the
pipeline's barriers, the masks and the softmax are the native code's; but the interpreter runs
wgmma synchronously (the overlapped schedule's waits are no-ops there), so a race between an
asynchronous product and a slot's release shows only natively. Cases run the default
schedule or others (`Tiles.overlap`, `.persistent`; `pytest -k overlap` or `-k
persistent` picks them). The code the interpreter skips is lowered for CUDA
(`test_kernels_lower_for_the_gpu`). The training kernels' tests are in
test_mosaic_gpu_training.py.

Tolerances against the float32 reference: max |diff| <= 3e-2 for bfloat16 inputs, 5e-3 for
float16 (both kernels round P to the input type before the PV product).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mosaic_tools import INTERPRET, TOL, kept_blocks, packed_row, qkv, schedule_id

from elastic_jax import hybrid_attention
from elastic_jax.attention import Streaming, mosaic_gpu
from elastic_jax.attention.mosaic_gpu import scoring as mosaic_gpu_scoring
from elastic_jax.attention.common import MODE_FULL, MODE_SPARSE
from elastic_jax.attention import reference
from elastic_jax.attention.reference import dense_hybrid_attention
from elastic_jax.attention.xattention import XAttention


@pytest.mark.parametrize("rows,block_kv", [(64, 128), (128, 128), (64, 64)])
@pytest.mark.parametrize("st", [Streaming(1, 1, 128), Streaming(2, 3, 128), Streaming(1, 2, 256)])
def test_walk_visits_exactly_the_needed_tiles_and_masks_only_the_last(rows, block_kv, st):
  """For every program and mode: the steps read distinct, increasing KV tiles, which are exactly
  the tiles holding a key some row may see (token-level mask), and every tile that holds a key
  after the program's first row comes after every tile that does not (only the last steps are
  masked)."""
  t = 1536
  pos = np.arange(t)
  for q_start in range(0, t, rows):
    r = pos[q_start:q_start + rows]
    causal = pos[None] <= r[:, None]
    window = ((pos[None] // st.block < st.sink_blocks)
              | (r[:, None] // st.block - pos[None] // st.block < st.local_blocks))
    for mode, ok in ((MODE_FULL, causal), (MODE_SPARSE, causal & window)):
      steps, sink_end, second = (int(x) for x in mosaic_gpu.walk(q_start, rows, mode, st,
                                                                   block_kv))
      tiles = [s if s < sink_end else second + s - sink_end for s in range(steps)]
      needed = sorted({int(j) // block_kv for j in np.nonzero(ok.any(0))[0]})
      assert tiles == needed, (q_start, mode)
      later = [tile for tile in tiles if (tile + 1) * block_kv - 1 > q_start]
      assert tiles[len(tiles) - len(later):] == later, (q_start, mode)


# The schedules other than the default's chain (`Tiles.chain`) take chain=False.
DEFAULT, OVERLAP = mosaic_gpu.DEFAULT_TILES, mosaic_gpu.Tiles(overlap=True, chain=False)
# Persistent programs, few enough that each takes several work items (unevenly).
PERSISTENT = mosaic_gpu.Tiles(persistent=3, chain=False)
OVERLAP_PERSISTENT = mosaic_gpu.Tiles(overlap=True, persistent=2, chain=False)
# More programs than work items (a short prompt on a big GPU): some programs have none.
OVERLAP_IDLE = mosaic_gpu.Tiles(overlap=True, persistent=8, chain=False)
# The default chains a warpgroup's two products (one turn issues both); this schedule does not.
PLAIN = mosaic_gpu.Tiles(chain=False)
# Clusters of two programs sharing each K/V tile (TMA multicast): natively only.
MULTICAST = mosaic_gpu.Tiles(multicast=True, chain=False)
# QK^T with Q in registers (interpret mode's wgmma reads shared memory only: natively only).
Q_REGISTERS = mosaic_gpu.Tiles(q_registers=True, chain=False)
NATIVE = pytest.mark.skipif(INTERPRET, reason="needs the GPU (multicast copies, wgmma from "
                                              "registers)")


@pytest.mark.parametrize("b,t,n,k,d,gates,st,dtype,tiles", [
    # G = 2: head pairs; G = 1 with T padded inside; G = 4 over a batch of two, in float16.
    (1, 512, 4, 2, 64, [[0.0, 1.0]], Streaming(1, 1, 128), jnp.bfloat16, DEFAULT),
    (1, 300, 2, 2, 128, [[1.0, 0.0]], Streaming(1, 1, 128), jnp.bfloat16, DEFAULT),
    (2, 384, 4, 1, 64, [[0.0], [1.0]], Streaming(1, 1, 128), jnp.float16, DEFAULT),
    # The other schedules (`Tiles.overlap`, `.persistent`): overlapped, G = 4 in
    # float16; persistent, G = 2 over two batch rows; both, G = 1 with padding and 6 work
    # items for 8 programs.
    (2, 384, 4, 1, 64, [[1.0], [0.0]], Streaming(1, 1, 128), jnp.float16, OVERLAP),
    (2, 384, 4, 2, 64, [[1.0, 0.0], [0.0, 1.0]], Streaming(1, 1, 128), jnp.bfloat16,
     PERSISTENT),
    (1, 300, 2, 2, 128, [[0.0, 1.0]], Streaming(1, 1, 128), jnp.bfloat16, OVERLAP_IDLE),
    # Products not chained: G = 2 over two batch rows, T padded, walks of one tile and longer.
    (2, 320, 4, 2, 64, [[1.0, 0.0], [0.0, 1.0]], Streaming(1, 1, 128), jnp.bfloat16, PLAIN),
    # Multicast, G = 4 over a batch of two with T padded (natively only).
    pytest.param(2, 700, 8, 2, 128, [[1.0, 0.0], [0.0, 1.0]], Streaming(1, 2, 128),
                 jnp.bfloat16, MULTICAST, marks=NATIVE),
    # Q in registers, G = 2 with T padded, float16 (natively only).
    pytest.param(1, 700, 4, 2, 128, [[0.0, 1.0]], Streaming(1, 2, 128), jnp.float16,
                 Q_REGISTERS, marks=NATIVE),
], ids=schedule_id)
def test_forward_matches_reference(b, t, n, k, d, gates, st, dtype, tiles):
  q, kk, v = qkv(b, t, n, k, d, dtype)
  gate = jnp.asarray(gates, jnp.float32)
  want = dense_hybrid_attention(*(x.astype(jnp.float32) for x in (q, kk, v)), gate, st)
  got = mosaic_gpu.hybrid_forward_hard(q, kk, v, gate, st, interpret=INTERPRET,
                                       tiles=tiles)
  assert got.shape == q.shape and got.dtype == dtype
  err = float(jnp.abs(got.astype(jnp.float32) - want).max())
  assert err <= TOL[dtype], err
  # The case can tell the modes apart: swapping them moves the output far beyond the tolerance.
  swapped = dense_hybrid_attention(*(x.astype(jnp.float32) for x in (q, kk, v)), 1.0 - gate, st)
  assert float(jnp.abs(got.astype(jnp.float32) - swapped).max()) > 10 * TOL[dtype]


def test_op_takes_fractional_gates_and_gradients():
  """attn_impl="mosaic_gpu": a fractional gate runs the Triton forward (chosen at run time), and
  gradients match the reference's (the Triton training kernels in interpret mode, the Mosaic
  GPU ones natively: the builders' default, `mosaic_gpu.TRAINING`)."""
  st = dict(sink_blocks=1, local_blocks=1, block=128)
  q, k, v = qkv(1, 384, 4, 2, 64, jnp.bfloat16, seed=1)
  gate = jnp.asarray([[0.5, 0.0]], jnp.float32)
  run = lambda impl, *x: hybrid_attention(*x, **st, attn_impl=impl,
                                              **({} if impl == "reference" else
                                                 {"interpret": INTERPRET}))
  up = [x.astype(jnp.float32) for x in (q, k, v)]
  got = run("mosaic_gpu", q, k, v, gate)
  err = float(jnp.abs(got.astype(jnp.float32) - run("reference", *up, gate)).max())
  assert err <= TOL[jnp.bfloat16], err

  def loss(impl, q, k, v, g):
    return jnp.sum(run(impl, q, k, v, g).astype(jnp.float32) ** 2)

  grads = jax.grad(lambda *x: loss("mosaic_gpu", *x), argnums=(0, 1, 2, 3))(q, k, v, gate)
  want = jax.grad(lambda *x: loss("reference", *x), argnums=(0, 1, 2, 3))(*up, gate)
  for g, w in zip(grads, want):
    scale = max(1.0, float(jnp.abs(w).max()))
    assert float(jnp.abs(g.astype(jnp.float32) - w).max()) <= 2e-2 * scale


@NATIVE
@pytest.mark.parametrize("tiles,base", [
    (MULTICAST, PLAIN), (Q_REGISTERS, PLAIN),
    (mosaic_gpu.Tiles(overlap=True, q_registers=True, chain=False), OVERLAP)],
    ids=schedule_id)
def test_operand_sources_are_bit_equal_to_their_schedule(tiles, base):
  """Multicast changes where a program's K/V tiles come from, q_registers where QK^T reads Q
  from, not the arithmetic: plain rows (T padded, mixed modes), packed rows, XA heads and the
  training forward (its output and every residual) give the same schedule's outputs without
  them bit for bit."""
  st = Streaming(1, 2, 128)
  q, k, v = qkv(1, 1000, 8, 2, 128, jnp.bfloat16, seed=3)
  gate = jnp.asarray([[1.0, 0.0]], jnp.float32)

  def same(f):
    want, got = jax.tree.leaves(f(base)), jax.tree.leaves(f(tiles))
    return len(want) == len(got) and all(bool(jnp.array_equal(w, g)) for w, g in zip(want, got))

  assert same(lambda tiles: mosaic_gpu.hybrid_forward_hard(q, k, v, gate, st, tiles=tiles))
  assert same(lambda tiles: mosaic_gpu.forward_train(q, k, v, jnp.asarray([[0.5, 0.0]]), st,
                                                     tiles=tiles))
  seg = jnp.asarray([[0] * 300 + [1] * 700], jnp.int32)
  pos = jnp.asarray([list(range(300)) + list(range(700))], jnp.int32)
  rows = jnp.broadcast_to(gate[:, None], (1, 1000, 2))
  assert same(lambda tiles: mosaic_gpu.packed_forward_hard(q, k, v, rows, seg, pos, st,
                                                           tiles=tiles))
  keep = kept_blocks(1, 2, 1000, 128, seed=4)
  assert same(lambda tiles: mosaic_gpu.xa_forward_hard(q, k, v, gate, keep, st,
                                                       patterns="fa-xa", xa_block=128,
                                                       tiles=tiles))


def test_applies_only_where_its_layout_holds():
  st = Streaming(1, 16, 128)
  assert mosaic_gpu.applies((1, 1000, 32, 128), (1, 1000, 8, 128), jnp.bfloat16, st)
  assert mosaic_gpu.applies((1, 1000, 8, 64), (1, 1000, 8, 64), jnp.float16, st)
  assert not mosaic_gpu.applies((1, 1000, 32, 128), (1, 1000, 8, 128), jnp.float32, st)
  assert not mosaic_gpu.applies((1, 1000, 32, 96), (1, 1000, 8, 96), jnp.bfloat16, st)
  assert not mosaic_gpu.applies((1, 1000, 24, 128), (1, 1000, 8, 128), jnp.bfloat16, st)  # G=3
  assert not mosaic_gpu.applies((1, 1000, 32, 128), (1, 1000, 8, 128), jnp.bfloat16,
                                Streaming(1, 16, 64))
  with pytest.raises(ValueError, match="does not take"):
    mosaic_gpu.hybrid_forward_hard(*qkv(1, 128, 2, 2, 32, jnp.bfloat16),
                                   jnp.ones((1, 2)), st, interpret=True)
  with pytest.raises(ValueError, match="training kernels 'cuda' are unknown"):
    mosaic_gpu.make_hybrid(training="cuda")
  assert mosaic_gpu.trains((1, 1000, 32, 128), (1, 1000, 8, 128), jnp.bfloat16, st)
  assert not mosaic_gpu.trains((1, 1000, 32, 128), (1, 1000, 8, 128), jnp.bfloat16,
                               Streaming(1, 16, 64))
  # head_dim 192: the tiles would not fit in a Hopper block's shared memory.
  assert not mosaic_gpu.applies((1, 1000, 32, 192), (1, 1000, 8, 192), jnp.bfloat16, st)
  # Multicast pairs two programs of one KV head: G a multiple of 4, one program per item.
  assert mosaic_gpu.applies((1, 1000, 32, 128), (1, 1000, 8, 128), jnp.bfloat16, st, MULTICAST)
  assert not mosaic_gpu.applies((1, 1000, 16, 128), (1, 1000, 8, 128), jnp.bfloat16, st,
                                MULTICAST)
  assert not mosaic_gpu.applies((1, 1000, 32, 128), (1, 1000, 8, 128), jnp.bfloat16, st,
                                mosaic_gpu.Tiles(multicast=True, persistent=132, chain=False))
  # A trace collects one program's events in shared memory: not across persistent items.
  assert mosaic_gpu.applies((1, 1000, 32, 128), (1, 1000, 8, 128), jnp.bfloat16, st,
                            mosaic_gpu.Tiles(trace="traces", chain=False))
  assert not mosaic_gpu.applies((1, 1000, 32, 128), (1, 1000, 8, 128), jnp.bfloat16, st,
                                mosaic_gpu.Tiles(trace="traces", persistent=132, chain=False))
  for other in (dict(overlap=True), dict(persistent=132), dict(trace="traces")):
    # the chain is a schedule of its own (the default's), not a modifier of these
    assert not mosaic_gpu.applies((1, 1000, 32, 128), (1, 1000, 8, 128), jnp.bfloat16, st,
                                  mosaic_gpu.Tiles(chain=True, **other))
  with pytest.raises(ValueError, match="natively only"):
    mosaic_gpu.hybrid_forward_hard(*qkv(1, 128, 8, 2, 64, jnp.bfloat16), jnp.ones((1, 2)), st,
                                   tiles=MULTICAST, interpret=True)


def test_former_tile_classes_and_backward_tiles_warn_and_give_the_one_tiles(monkeypatch):
  """The former classes (`MosaicTiles`, whose chain defaulted to False, `BackwardTiles`,
  `ScoringTiles`) and an entry point's `backward_tiles=` (by keyword, or where it was the
  positional argument after the last one) still work for one release: each warns
  (DeprecationWarning) and gives the equal `Tiles`, backward_tiles' fields merged into tiles."""
  mg = mosaic_gpu
  with pytest.warns(DeprecationWarning, match="MosaicTiles"):
    assert mg.MosaicTiles(overlap=True) == OVERLAP
  with pytest.warns(DeprecationWarning, match="MosaicTiles"):
    assert mg.forward.MosaicTiles(64, 128, 3, chain=True) == mg.Tiles(slots=3)
  with pytest.warns(DeprecationWarning, match="BackwardTiles"):
    backward = mg.backward.BackwardTiles(dq_block_kv=128, slots=3, registers=240)
  assert backward == mg.Tiles(dq_block_kv=128, backward_slots=3, registers=240)
  with pytest.warns(DeprecationWarning, match="ScoringTiles"):
    scoring = mosaic_gpu_scoring.ScoringTiles(64, 128, 32, 4)
  assert scoring == mg.Tiles(score_rows=64, score_cols=128, score_depth=32, score_slots=4)
  assert (mg.DEFAULT_BACKWARD_TILES == mosaic_gpu_scoring.DEFAULT_SCORING_TILES
          == mg.DEFAULT_TILES == mg.Tiles())
  built = []
  monkeypatch.setattr(mg.hybrid, "_build_plain", lambda *args: built.append(args))
  for args, kw in (((OVERLAP, "mosaic"), dict(backward_tiles=backward)),
                   ((OVERLAP, "mosaic", backward), {})):
    with pytest.warns(DeprecationWarning, match="backward_tiles"):
      mg.make_hybrid(*args, **kw)
  merged = mg.Tiles(overlap=True, chain=False, dq_block_kv=128, backward_slots=3, registers=240)
  assert built == [(merged, "mosaic")] * 2
  shapes = ((1, 1000, 32, 128), (1, 1000, 8, 128), jnp.bfloat16, Streaming(1, 16, 128))
  assert mg.trains(*shapes)
  refused = mg.Tiles(backward_slots=5)   # rings of 2 to 4 slots
  with pytest.warns(DeprecationWarning, match="backward_tiles"):
    assert not mg.trains(*shapes, backward_tiles=refused)
  with pytest.warns(DeprecationWarning, match="backward_tiles"):
    assert not mg.trains(*shapes, mg.DEFAULT_TILES, refused)


@pytest.mark.parametrize("n,k,d,lengths,st,tiles", [
    # G = 2, head_dim 128: rows of later segments whose first tiles hold none of their keys
    # (the masked-tile softmax must cancel exactly), T padded inside.
    (4, 2, 128, [37, 300, 250, 180, 101], Streaming(1, 1, 128), DEFAULT),
    # G = 1: two row tiles a program; overlapped and persistent.
    (2, 2, 64, [200, 3, 190, 119], Streaming(2, 1, 128), OVERLAP_PERSISTENT),
], ids=schedule_id)
def test_packed_forward_matches_reference(n, k, d, lengths, st, tiles):
  """Packed rows on the Mosaic GPU forward: segments of odd lengths, gates per (segment, KV
  head) in every full/streaming combination (tiles whose rows are routed differently)."""
  combos = [(0.0, 0.0), (1.0, 0.0), (0.0, 1.0), (1.0, 1.0), (1.0, 0.0)]
  seg, pos, gate = packed_row(lengths, [np.asarray(c[:k]) for c in combos], k)
  q, kk, v = qkv(1, seg.shape[1], n, k, d, jnp.bfloat16, seed=d)
  assert bool(mosaic_gpu.packed_rows_apply(seg, pos, gate))
  got = mosaic_gpu.packed_forward_hard(q, kk, v, gate, seg, pos, st, interpret=INTERPRET,
                                       tiles=tiles)
  up = [x.astype(jnp.float32) for x in (q, kk, v)]
  want = hybrid_attention(*up, gate, sink_blocks=st.sink_blocks, local_blocks=st.local_blocks,
                          block=st.block, segment_ids=seg, positions=pos)
  err = float(jnp.abs(got.astype(jnp.float32) - want).max())
  assert err <= TOL[jnp.bfloat16], err


@pytest.mark.parametrize("patterns,n,k,rows,shifted,tiles", [
    # G = 2, one row: an XA segment over three blocks ending inside a program that a full
    # segment shares (there its XA rows' kept blocks are masked in), segments of one pattern
    # per head, programs of XA rows only.
    ("fa-xa", 4, 2, [([128, 300, 40, 150], ((1.0, 0.0), (0.0, 1.0), (1.0, 0.0), (1.0, 1.0)))],
     None, DEFAULT),
    # G = 1 (128 rows a program), two rows, through the op's builder (hard gates: this kernel
    # at run time): XA and streaming rows sharing programs both ways, and a segment whose
    # positions start at 300, past the sink (its streaming rows must keep their window); the
    # overlapped schedule.
    ("xa-ssa", 2, 2, [([300, 140, 60], ((0.0, 1.0), (1.0, 0.0), (0.0, 0.0))),
                      ([260, 5, 235], ((1.0, 1.0), (0.0, 0.0), (0.0, 1.0)))], (1, 265, 300),
     OVERLAP),
], ids=schedule_id)
def test_packed_xa_forward_matches_reference(monkeypatch, patterns, n, k, rows, shifted,
                                             tiles):
  """Packed rows under the XAttention settings in one launch, each row on its gate's pattern
  (`packed_xa_forward_hard`), against the float32 reference on the same kept blocks: random,
  complementary between neighbouring (row, KV head) pairs (a kernel that read another
  head's or row's blocks would differ), plus those the selection forces; blocks of 128.
  The complementary kept blocks and the swapped gates must be far off. shifted: (row, first
  token, offset) of positions that start past 0."""
  from elastic_jax.attention.xattention import XAttention, forced_blocks
  st, xa_block = Streaming(1, 1, 128), 128
  built = [packed_row(lengths, [np.asarray(c) for c in gates], k) for lengths, gates in rows]
  seg, pos, gate = (jnp.concatenate(x) for x in zip(*built))
  if shifted:
    row, first, offset = shifted
    pos = pos.at[row, first:].add(offset)
  b, t = seg.shape
  q, kk, v = qkv(b, t, n, k, 64, jnp.bfloat16, seed=t)
  drawn = kept_blocks(1, 1, t, xa_block, seed=5)
  parity = (jnp.arange(b)[:, None] + jnp.arange(k)[None]) % 2 == 1
  keep = jnp.where(parity[..., None, None], ~drawn, drawn) | forced_blocks(
      t, XAttention(block=xa_block), seg, b)[:, None]
  if len(rows) == 1:
    got = mosaic_gpu.packed_xa_forward_hard(q, kk, v, gate, seg, pos, keep, st,
                                            patterns=patterns, xa_block=xa_block, tiles=tiles,
                                            interpret=INTERPRET)
  else:   # eagerly, so that the run-time choice runs one branch: this kernel's
    ran = []
    real = mosaic_gpu.packed_xa_forward_hard
    monkeypatch.setattr(mosaic_gpu.hybrid, "packed_xa_forward_hard",
                        lambda *a, **kw: ran.append(1) or real(*a, **kw))
    fn = mosaic_gpu.make_hybrid(tiles, packed=True, xa=True)
    with jax.disable_jit():
      got = fn(q, kk, v, gate, seg, pos, keep, st, patterns, xa_block, INTERPRET)
    assert ran
  up = [x.astype(jnp.float32) for x in (q, kk, v)]
  # The reference itself: the public op refuses positions that do not start at 0.
  ref = lambda kept, g: reference.hybrid_attention(*up, g, st, seg, pos, patterns=patterns,
                                                   xa_keep=kept, xa_block=xa_block)
  diff = lambda want: float(jnp.abs(got.astype(jnp.float32) - want).max())
  assert diff(ref(keep, gate)) <= TOL[jnp.bfloat16]
  other = ~keep | jnp.eye(keep.shape[-1], dtype=bool)[None, None]
  assert diff(ref(other, gate)) > 10 * TOL[jnp.bfloat16]
  assert diff(ref(keep, 1.0 - gate)) > 10 * TOL[jnp.bfloat16]


def test_packed_rows_apply_only_to_hard_gates_and_counting_positions():
  seg, pos, gate = packed_row([5, 7], [np.ones(2), np.zeros(2)], 2)
  assert bool(mosaic_gpu.packed_rows_apply(seg, pos, gate))
  assert bool(mosaic_gpu.packed_rows_apply(seg, pos + 3, gate))       # an offset is fine
  assert not bool(mosaic_gpu.packed_rows_apply(seg, pos, gate.at[0, 0, 0].set(0.5)))
  assert not bool(mosaic_gpu.packed_rows_apply(seg, pos.at[0, 6].set(0), gate))
  assert not bool(mosaic_gpu.packed_rows_apply(seg, pos - 1, gate))   # negative positions


@pytest.mark.parametrize("b,t,n,k,xa_block,patterns,gates,tiles", [
    # G = 1 (128 rows a program), 2 tiles a block
    (1, 700, 2, 2, 256, "fa-xa", [[0.0, 1.0]], DEFAULT),
    # G = 4, head pairs, padded T; the overlapped schedule
    (2, 400, 4, 1, 128, "xa-ssa", [[1.0], [0.0]], OVERLAP),
], ids=schedule_id)
def test_xa_heads_walk_their_kept_blocks(b, t, n, k, xa_block, patterns, gates, tiles):
  """XAttention heads in the Mosaic GPU forward: the heads of XA's mode visit their kept
  blocks' tiles (read from the block lists at run time), the others their full or streaming
  tiles; against the float32 reference on the same kept blocks."""
  st = Streaming(1, 1, 256)
  q, kk, v = qkv(b, t, n, k, 64, jnp.bfloat16, seed=t)
  keep = kept_blocks(b, k, t, xa_block, seed=t)
  gate = jnp.asarray(gates, jnp.float32)
  got = mosaic_gpu.xa_forward_hard(q, kk, v, gate, keep, st, patterns=patterns,
                                   xa_block=xa_block, interpret=INTERPRET,
                                   tiles=tiles)
  up = [x.astype(jnp.float32) for x in (q, kk, v)]
  ref = lambda g: dense_hybrid_attention(*up, g, st, patterns=patterns, xa_keep=keep,
                                         xa_block=xa_block)
  err = float(jnp.abs(got.astype(jnp.float32) - ref(gate)).max())
  assert err <= TOL[jnp.bfloat16], err
  assert float(jnp.abs(got.astype(jnp.float32) - ref(1.0 - gate)).max()) > 10 * TOL[jnp.bfloat16]


def test_xa_op_takes_hard_and_fractional_gates():
  """attn_impl="mosaic_gpu" under "fa-xa": hard gates run the Mosaic kernel, a fractional one
  the Triton kernel (one compilation, chosen at run time); both match the reference. Blocks
  of 64 tokens, which the Mosaic kernel does not take, run on the Triton kernel."""
  st = dict(sink_blocks=1, local_blocks=1, block=128)
  q, k, v = qkv(1, 384, 4, 2, 64, jnp.bfloat16, seed=5)
  up = [x.astype(jnp.float32) for x in (q, k, v)]
  for xa_block in (128, 64):
    keep = kept_blocks(1, 2, 384, xa_block, seed=xa_block)
    assert mosaic_gpu.xa_applies(q.shape, k.shape, q.dtype, Streaming(**st), xa_block) == (
        xa_block == 128)
    for gate in ([[1.0, 0.0]], [[0.5, 0.0]]):
      gate = jnp.asarray(gate, jnp.float32)
      kw = dict(**st, patterns="fa-xa", xa_keep=keep, xa_block=xa_block)
      got = hybrid_attention(q, k, v, gate, attn_impl="mosaic_gpu", interpret=INTERPRET, **kw)
      want = hybrid_attention(*up, gate, attn_impl="reference", **kw)
      err = float(jnp.abs(got.astype(jnp.float32) - want).max())
      assert err <= TOL[jnp.bfloat16], (xa_block, gate, err)
  with pytest.raises(ValueError, match="xa_keep has shape"):
    mosaic_gpu.xa_forward_hard(q, k, v, gate, keep, Streaming(**st), patterns="fa-xa",
                               xa_block=128, interpret=True)


def test_kernels_lower_for_the_gpu():
  """Every Mosaic GPU kernel, in its schedules, lowers to its Mosaic GPU module here on the
  CPU (`jax.export` for platform "cuda": the Pallas-to-Mosaic-GPU lowering of the native-only
  code the interpreter skips: P and Q in registers for wgmma, `run_state` accumulators, the
  overlapped schedule's asynchronous waits; compiling to PTX needs the GPU's toolchain).
  The plain forward in every schedule; the other forward kernels in the default and the
  overlapped persistent ones (which run the overlapped schedule's code); the training
  forward, and the dQ and dK/dV kernels behind it on packed rows under XAttention; the XA
  scoring kernel."""
  st, xb = Streaming(1, 2, 128), 256
  s = jax.ShapeDtypeStruct
  b, t, n, kh, d = 1, 1024, 4, 2, 128
  q, k = s((b, t, n, d), jnp.bfloat16), s((b, t, kh, d), jnp.bfloat16)
  gate, gate_rows = s((b, kh), jnp.float32), s((b, t, kh), jnp.float32)
  keep, seg = s((b, kh, t // xb, t // xb), jnp.bool_), s((b, t), jnp.int32)
  xa = dict(patterns="fa-xa", xa_block=xb)
  mg = mosaic_gpu
  cases = []
  for tiles in (DEFAULT, PLAIN, OVERLAP, PERSISTENT, OVERLAP_PERSISTENT, Q_REGISTERS):
    cases.append((lambda q, k, v, g, tiles=tiles: mg.hybrid_forward_hard(q, k, v, g, st,
                                                                         tiles=tiles),
                  (q, k, k, gate), 1))
  for tiles in (DEFAULT, OVERLAP_PERSISTENT):   # every code path of the schedules
    cases += [
        (lambda q, k, v, g, kp, tiles=tiles: mg.xa_forward_hard(q, k, v, g, kp, st, tiles=tiles,
                                                                **xa), (q, k, k, gate, keep), 1),
        (lambda q, k, v, g, sg, tiles=tiles: mg.packed_forward_hard(q, k, v, g, sg, sg, st,
                                                                   tiles=tiles),
         (q, k, k, gate_rows, seg), 1),
        (lambda q, k, v, g, sg, kp, tiles=tiles: mg.packed_xa_forward_hard(
            q, k, v, g, sg, sg, kp, st, tiles=tiles, **xa), (q, k, k, gate_rows, seg, keep), 1),
        (lambda q, k, v, g, tiles=tiles: mg.forward_train(q, k, v, g, st, tiles=tiles),
         (q, k, k, gate), 2)]
  cases += [   # the dQ and dK/dV kernels in their most general use: packed rows, XA lists
      (lambda q, k, v, g, sg, kp, do: mg.packed_xa_backward(
          mg.packed_xa_forward_train(q, k, v, g, sg, sg, kp, st, **xa)[1], do, st, **xa),
       (q, k, k, gate_rows, seg, keep, q), 4)]
  cases.append((lambda q, k: mosaic_gpu_scoring.block_mass_mosaic(q, k, XAttention()), (q, k), 1))
  q8 = s((b, t, 2 * n, d), jnp.bfloat16)   # multicast: G = 4; with Q in registers
  for tiles in (MULTICAST, mosaic_gpu.Tiles(multicast=True, overlap=True, q_registers=True,
                                            chain=False)):
    cases.append((lambda q, k, v, g, tiles=tiles: mg.hybrid_forward_hard(q, k, v, g, st,
                                                                         tiles=tiles),
                  (q8, k, k, gate), 1))
  for fn, args, launches in cases:
    module = jax.export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()
    assert module.count("mosaic_gpu_v2") == launches
