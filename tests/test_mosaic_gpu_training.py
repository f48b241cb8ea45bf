"""The Mosaic GPU training kernels (the training forward with log-sum-exps, the dQ and dK/dV
kernels; plain and packed rows, the streaming and XAttention settings) against the float32
reference's outputs and gradients, and their walks against brute-force tile counts. GPU
interpret mode on CPU (with reads past an array's end refused), native on a GPU.
"""

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mosaic_tools import INTERPRET, TOL, kept_blocks, packed_row, qkv, schedule_id

from elastic_jax import hybrid_attention
from elastic_jax.attention import Streaming, mosaic_gpu
from elastic_jax.attention.mosaic_gpu import backward as mosaic_gpu_backward
from elastic_jax.attention.common import MODE_FULL, MODE_MIX, MODE_SPARSE
from elastic_jax.attention.reference import dense_hybrid_attention


@pytest.fixture
def strict_reads(monkeypatch):
  """In interpret mode, a bulk copy that reads past the end of a device array raises (a TMA
  would fill zeros, which can hide a walk that strays past the padded length)."""
  try:
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    task = gpu_callbacks.AsyncCopyGmemToSmemTask
    task.out_of_bounds_source_fill                                    # noqa: B018
  except (ImportError, AttributeError):   # another jax: the check is not available
    warnings.warn("strict_reads: this jax's GPU interpreter has no out-of-bounds switch; "
                  "reads past an array's end are filled, not refused")
    return
  monkeypatch.setattr(task, "out_of_bounds_source_fill", None)


@pytest.fixture
def kernel_calls(monkeypatch):
  """The names of the Mosaic training entry points called during a test, in order: the dQ
  and dK/dV launches and the packed XA training forward (a test asserts its path ran)."""
  from elastic_jax.attention.mosaic_gpu import backward as mosaic_gpu_backward
  calls = []
  for module, name in ((mosaic_gpu_backward, "dq_call"), (mosaic_gpu_backward, "dkv_call"),
                       (mosaic_gpu.hybrid, "packed_xa_forward_train")):
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name, **kw:
                        calls.append(_name) or _real(*a, **kw))
  return calls


@pytest.mark.parametrize("packed", [False, True])
def test_training_default_is_mosaic_natively_and_triton_in_interpret_mode(kernel_calls, packed):
  """The builders' default training ("auto"): the Mosaic dQ and dK/dV kernels when running
  natively (traced here, not run), the Triton kernels in interpret mode; "triton" never the
  Mosaic ones. Plain and packed rows."""
  st = Streaming(1, 1, 128)
  q, kk, v = qkv(1, 256, 4, 2, 64, jnp.bfloat16)
  if packed:
    seg, pos, gate = packed_row([100, 156], [np.asarray([1.0, 0.0]), np.asarray([0.5, 0.0])], 2)
    extra = (seg, pos)
  else:
    gate, extra = jnp.asarray([[0.5, 0.0]], jnp.float32), ()
  build = functools.partial(mosaic_gpu.make_hybrid, packed=packed)
  for training, interpret, mosaic in (("auto", False, True), ("auto", True, False),
                                      ("triton", False, False), ("mosaic", True, True)):
    fn = build(training=training)
    loss = lambda *x: jnp.sum(fn(*x, *extra, st, interpret).astype(jnp.float32))
    kernel_calls.clear()
    jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, kk, v, gate)
    assert (sorted(kernel_calls) == ["dkv_call", "dq_call"]) == mosaic, (training, interpret)


def _schedule(overlap: bool):
  """The forward's overlapped schedule, or the builders' default (chained products)."""
  return mosaic_gpu.Tiles(overlap=True, chain=False) if overlap else mosaic_gpu.DEFAULT_TILES


@pytest.mark.parametrize("b,t,n,k,d,gates,st,overlap,slots", [
    # G = 2: a mixed and a streaming head; the forward's overlapped schedule.
    (1, 300, 4, 2, 64, [[0.3, 0.0]], Streaming(1, 1, 128), True, 2),
    # G = 1 (two row tiles a dQ program), head_dim 128, a sink of two blocks: a full and a
    # mixed head; the backward kernels' rings of three slots (FlashAttention-3's register
    # split too, natively).
    (1, 400, 2, 2, 128, [[1.0, 0.6]], Streaming(2, 1, 128), False, 3),
], ids=schedule_id)
def test_mosaic_training_kernels_match_reference_gradients(kernel_calls, strict_reads, b, t, n,
                                                           k, d, gates, st, overlap, slots):
  """make_hybrid(training="mosaic"): the training forward (every head's O_FA and O_SSA with
  their log-sum-exps) and the dQ and dK/dV kernels against the float32 reference's output and
  gradients, gate included (relative error of each; the gate's where O_FA and O_XA nearly
  agree: test_xattention.py). Under jax.disable_jit each kernel runs
  as its own computation (Pallas's GPU interpreter keeps global state; natively they run
  inside the caller's jit)."""
  q, kk, v = qkv(b, t, n, k, d, jnp.bfloat16, seed=t)
  gate = jnp.asarray(gates, jnp.float32)
  d_out = jax.random.normal(jax.random.key(t + 1), q.shape, jnp.float32).astype(jnp.bfloat16)
  tiles = dataclasses.replace(_schedule(overlap), backward_slots=slots,
                              registers=232 if slots == 2 else 240)
  fn = mosaic_gpu.make_hybrid(tiles, training="mosaic")
  with jax.disable_jit():
    out, vjp = jax.vjp(lambda *x: fn(*x, st, INTERPRET), q, kk, v, gate)
    grads = vjp(d_out)
  assert kernel_calls == ["dq_call", "dkv_call"]   # the Mosaic path ran, not the Triton one
  up = [x.astype(jnp.float32) for x in (q, kk, v)]
  ref = lambda g, *x: dense_hybrid_attention(*x, g, st)
  want, ref_vjp = jax.vjp(lambda *x: ref(x[3], *x[:3]), *up, gate)
  assert float(jnp.abs(out.astype(jnp.float32) - want).max()) <= TOL[jnp.bfloat16]
  for name, got, w in zip(("dq", "dk", "dv", "d_gate"), grads, ref_vjp(d_out.astype(jnp.float32))):
    err = float(jnp.linalg.norm(got.astype(jnp.float32) - w) / jnp.linalg.norm(w))
    assert err <= 1e-2, (name, err)
  # The case tells the modes apart: the reference's dq with the gates swapped is far off.
  _, swapped_vjp = jax.vjp(lambda *x: ref(1.0 - gate, *x), *up)
  swapped = swapped_vjp(d_out.astype(jnp.float32))[0]
  assert float(jnp.abs(grads[0].astype(jnp.float32) - swapped).max()) > 0.1
  # The native path traces under jit (kernels for the GPU, not run here).
  loss = lambda *x: jnp.sum(fn(*x, st, False).astype(jnp.float32))
  jax.make_jaxpr(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))))(q, kk, v, gate)


def test_backward_tiles_past_the_kernels_limits_are_refused():
  """`applies` takes rings of 2 to 4 slots (shared memory: 133 KiB, 34 more a slot, against
  227) and compute warpgroups of 176 to 240 registers in steps of 8, more than the 168 the
  kernels launch with (the memory warpgroup keeps 504 minus twice that, at least 24)."""
  tiles = mosaic_gpu.Tiles
  st = Streaming(1, 16, 128)
  ok = [(2, 232), (4, 240), (3, 176)]
  refused = [(5, 232), (1, 232), (2, 248), (2, 236), (2, 168)]
  for slots, registers in ok + refused:
    got = mosaic_gpu_backward.applies(4, st, tiles(backward_slots=slots, registers=registers))
    assert got == ((slots, registers) in ok), (slots, registers)
  assert mosaic_gpu_backward.memory_registers(tiles(registers=240)) == 24
  assert mosaic_gpu_backward.memory_registers(tiles()) == 40


@pytest.mark.parametrize("st", [Streaming(1, 1, 128), Streaming(2, 3, 128), Streaming(1, 2, 256)])
def test_backward_walks_visit_each_needed_tile_once_with_its_terms(st):
  """The dQ walk (per query program) and the dK/dV walk (per key program, transposed): for every
  program and mode the ranges visit distinct tiles, exactly those holding a (query, key) pair
  that one of the head's terms needs (token-level masks), and each with exactly the terms that
  need it (FA for full and mixed heads, SSA for streaming and mixed ones)."""
  from elastic_jax.attention.mosaic_gpu import backward as mb
  t = 1536
  pos = np.arange(t)
  causal = pos[None] <= pos[:, None]
  window = causal & ((pos[None] // st.block < st.sink_blocks)
                     | (pos[:, None] // st.block - pos[None] // st.block < st.local_blocks))
  terms_of = {MODE_FULL: (True, False), MODE_SPARSE: (False, True), MODE_MIX: (True, True)}

  def check(ranges, needed_fa, needed_sa, mode, where):
    seen = {}
    for lo, hi, fa, sa in ranges:
      for tile in range(int(lo), int(hi)):
        assert tile not in seen, (where, mode, tile)
        seen[tile] = (fa, sa)
    want_fa, want_sa = terms_of[mode]
    want = {tile: (want_fa and tile in needed_fa, want_sa and tile in needed_sa)
            for tile in needed_fa | needed_sa}
    want = {tile: flags for tile, flags in want.items() if any(flags)}
    assert seen == want, (where, mode)

  for rows in (64, 128):
    for q_start in range(0, t, rows):
      r = slice(q_start, q_start + rows)
      tiles = lambda ok: {int(j) // 64 for j in np.nonzero(ok[r].any(0))[0]}
      for mode in terms_of:
        check(mb.dq_walk(q_start, rows, mode, st, 64), tiles(causal), tiles(window), mode,
              ("dq", q_start, rows))
  keys, block_q = 128, 64
  for k_start in range(0, t, keys):
    kr = slice(k_start, k_start + keys)
    tiles = lambda ok: {int(i) // block_q for i in np.nonzero(ok[:, kr].any(1))[0]}
    for mode in terms_of:
      check(mb.dkv_walk(k_start, keys, mode, st, block_q, t // block_q), tiles(causal),
            tiles(window), mode, ("dkv", k_start))


@pytest.mark.parametrize("pair,xa_block", [(("full", "xa"), 128), (("xa", "stream"), 256)])
def test_xa_backward_walks_visit_each_needed_tile_once_with_its_terms(pair, xa_block):
  """Under the XAttention settings, the dQ walk (per query program) and the dK/dV walk (per key
  program): listed ranges expanded through the kernels' kept-block lists (a query block's row,
  a key block's column) and flagged ranges through their per-tile tests, every program and
  mode visits distinct tiles, exactly those holding a pair one of its terms needs (token-level
  masks of random kept blocks, some above the diagonal), each with exactly those terms."""
  from elastic_jax.attention.mosaic_gpu import backward as mb
  from elastic_jax.attention.common import xa_operands
  st, t, tile = Streaming(1, 2, 128), 1536, 64
  nb = t // xa_block
  keep_in = kept_blocks(1, 1, t, xa_block, seed=xa_block)
  index, count, keep = (np.asarray(x) for x in xa_operands(keep_in, nb, 1))
  col_index, col_count = (np.asarray(x) for x in mb.xa_column_lists(jnp.asarray(keep)))
  pos = np.arange(t)
  causal = pos[None] <= pos[:, None]
  masks = {"full": causal,
           "stream": causal & ((pos[None] // st.block < st.sink_blocks)
                               | (pos[:, None] // st.block - pos[None] // st.block
                                  < st.local_blocks)),
           "xa": causal & keep[0][pos[:, None] // xa_block, pos[None] // xa_block].astype(bool)}
  terms_of = {MODE_FULL: (True, False), MODE_SPARSE: (False, True), MODE_MIX: (True, True)}

  def check(walk, listed, per_xa, needed, mode, where, own):
    ranges, flags = walk
    seen = {}
    for rg in ranges:
      for p in range(int(rg.lo), int(rg.hi)):
        tile = int(listed[p // per_xa]) * per_xa + p % per_xa if rg.listed else p
        if rg.listed:   # whole blocks off the diagonal one: run unmasked
          assert (tile // per_xa < own) if where[0] == "dq" else (tile // per_xa > own), where
        on = [None, None] if not rg.flagged else flags(tile)
        terms = tuple(bool(want and (flag is None or flag))
                      for want, flag in zip((rg.fa, rg.sa), on))
        assert tile not in seen, (where, mode, tile)
        if any(terms):
          seen[tile] = terms
    want = {}
    for x, (term_on, tiles) in enumerate(zip(terms_of[mode], needed)):
      for tile_ in tiles if term_on else ():
        want.setdefault(tile_, [False, False])[x] = True
    assert seen == {k: tuple(v) for k, v in want.items()}, (where, mode)

  for rows in (64, 128):
    for q_start in range(0, t, rows):
      r = slice(q_start, q_start + rows)
      qb = q_start // xa_block
      needed = [{int(j) // tile for j in np.nonzero(masks[p][r].any(0))[0]} for p in pair]
      for mode in terms_of:
        walk = mb.xa_dq_walk(q_start, rows, mode, st, tile, pair, int(count[0, qb]) - 1,
                             xa_block, lambda kb, qb=qb: bool(keep[0, qb, kb]))
        check(walk, index[0, qb], xa_block // tile, needed, mode, ("dq", q_start, rows), qb)
  for k_start in range(0, t, 128):
    kr = slice(k_start, k_start + 128)
    kb = k_start // xa_block
    needed = [{int(i) // tile for i in np.nonzero(masks[p][:, kr].any(1))[0]} for p in pair]
    for mode in terms_of:
      walk = mb.xa_dkv_walk(k_start, mode, st, tile, t // tile, pair, int(col_count[0, kb]),
                            xa_block, lambda qb, kb=kb: bool(keep[0, qb, kb]))
      check(walk, col_index[0, kb], xa_block // tile, needed, mode, ("dkv", k_start), kb)


@pytest.mark.parametrize("b,t,n,k,d,patterns,gates,xa_block", [
    # G = 2: a mixed, an XA-only and a full head under "fa-xa".
    (1, 300, 6, 3, 64, "fa-xa", [[0.4, 0.0, 1.0]], 128),
    # G = 1 (two row tiles a dQ program), head_dim 128, blocks of 256 (the last one partial):
    # mixed, XA-only and streaming-only heads over two rows under "xa-ssa".
    (2, 300, 2, 2, 128, "xa-ssa", [[0.5, 1.0], [0.0, 0.3]], 256),
])
def test_mosaic_training_kernels_under_xattention(kernel_calls, strict_reads, b, t, n, k, d,
                                                  patterns, gates, xa_block):
  """make_hybrid(xa=True, training="mosaic"): the training forward (the XA term's launch walking
  the kept blocks) and the dQ and dK/dV kernels (rows and columns of the kept-block lists,
  mixed heads' tiles switched per tile) against the float32 reference's output and gradients on
  the same random kept blocks; the reference that keeps every block must be far off (the lists
  matter). Run eagerly as the other training tests; the Mosaic kernels must have run."""
  calls = kernel_calls
  st = Streaming(1, 1, 128)
  q, kk, v = qkv(b, t, n, k, d, jnp.bfloat16, seed=t)
  keep = kept_blocks(b, k, t, xa_block, seed=t + 3)
  gate = jnp.asarray(gates, jnp.float32)
  d_out = jax.random.normal(jax.random.key(t + 1), q.shape, jnp.float32).astype(jnp.bfloat16)
  fn = mosaic_gpu.make_hybrid(training="mosaic", xa=True)
  with jax.disable_jit():
    out, vjp = jax.vjp(lambda *x: fn(*x, keep, st, patterns, xa_block, INTERPRET), q, kk, v,
                       gate)
    grads = vjp(d_out)
  assert sorted(calls) == ["dkv_call", "dq_call"]
  up = [x.astype(jnp.float32) for x in (q, kk, v)]
  ref = lambda kept, *x: dense_hybrid_attention(*x[:3], x[3], st, patterns=patterns,
                                                xa_keep=kept, xa_block=xa_block)
  want, ref_vjp = jax.vjp(lambda *x: ref(keep, *x), *up, gate)
  assert float(jnp.abs(out.astype(jnp.float32) - want).max()) <= TOL[jnp.bfloat16]
  errs = []
  for got, w in zip(grads, ref_vjp(d_out.astype(jnp.float32))):
    errs.append(float(jnp.linalg.norm(got.astype(jnp.float32) - w) / jnp.linalg.norm(w)))
  assert all(e <= 1e-2 for e in errs), errs          # NaN fails too
  _, every_vjp = jax.vjp(lambda *x: ref(jnp.ones_like(keep), *x), *up, gate)
  every = every_vjp(d_out.astype(jnp.float32))
  assert min(float(jnp.linalg.norm(g.astype(jnp.float32) - w) / jnp.linalg.norm(w))
             for g, w in zip(grads[:3], every[:3])) > 10 * max(errs)
  loss = lambda *x: jnp.sum(fn(*x, keep, st, patterns, xa_block, False).astype(jnp.float32))
  jax.make_jaxpr(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))))(q, kk, v, gate)


def test_mosaic_training_kernels_on_packed_rows(kernel_calls, strict_reads):
  """make_hybrid(packed=True, training="mosaic") on a packed row (segment ids and positions):
  each row's gate mixes its head's two outputs. Segments of 128, 384, 40 and 50 tokens (padded to
  640): tiles whose rows are full, streaming or routed differently; segments starting on a
  tile edge (the plan's unmasked tiles); a long mixed segment whose keys past the sink reach
  only their window's rows (the dK/dV walk stops there, the FA term goes on). Output and
  gradients (the gate's per row) against the float32 reference, run eagerly as the unpacked
  test; the Mosaic dQ and dK/dV kernels must have run. Traced under jit (not run), both
  run-time branches must leave residuals of one layout."""
  calls = kernel_calls
  st = Streaming(1, 1, 128)
  gates = ((0.6, 0.0), (1.0, 0.3), (1.0, 0.0), (0.0, 0.0))
  seg, pos, gate = packed_row([128, 384, 40, 50], [np.asarray(c) for c in gates], 2)
  q, kk, v = qkv(1, seg.shape[1], 2, 2, 64, jnp.bfloat16, seed=11)
  d_out = jax.random.normal(jax.random.key(12), q.shape, jnp.float32).astype(jnp.bfloat16)
  fn = mosaic_gpu.make_hybrid(training="mosaic", packed=True)
  with jax.disable_jit():
    out, vjp = jax.vjp(lambda *x: fn(*x, seg, pos, st, INTERPRET), q, kk, v, gate)
    grads = vjp(d_out)
  assert sorted(calls) == ["dkv_call", "dq_call"]
  up = [x.astype(jnp.float32) for x in (q, kk, v)]
  ref = lambda *x: hybrid_attention(*x, sink_blocks=1, local_blocks=1, block=128,
                                    segment_ids=seg, positions=pos)
  want, ref_vjp = jax.vjp(ref, *up, gate)
  assert float(jnp.abs(out.astype(jnp.float32) - want).max()) <= TOL[jnp.bfloat16]
  for name, got, w in zip(("dq", "dk", "dv", "d_gate"), grads[:4],
                          ref_vjp(d_out.astype(jnp.float32))):
    err = float(jnp.linalg.norm(got.astype(jnp.float32) - w) / jnp.linalg.norm(w))
    assert err <= 1e-2, (name, err)
  loss = lambda *x: jnp.sum(fn(*x, seg, pos, st, False).astype(jnp.float32))
  jax.make_jaxpr(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))))(q, kk, v, gate)


@pytest.mark.parametrize("patterns,n,k,rows,xa_block,overlap", [
    # G = 2, one row: a long segment mixed on one head (dK/dV lists cut at its end) and XA
    # on the other (dQ programs whose listed blocks need no mask), full and XA-only segments,
    # segments starting inside a block (the dQ lists start past earlier segments').
    ("fa-xa", 4, 2, [([128, 300, 40, 150], ((0.6, 0.0), (0.0, 0.3), (0.0, 1.0), (0.0, 0.0)))],
     128, False),
    # G = 1, two rows, blocks of 256 (two forward tiles, two dK/dV programs a block):
    # XA-only, streaming-only and mixed rows under "xa-ssa" (segments longer than the sink
    # and window, where the patterns differ); the forward's overlapped schedule.
    ("xa-ssa", 2, 2, [([300, 140, 60], ((0.4, 1.0), (1.0, 0.0), (0.0, 0.7))),
                      ([260, 5, 235], ((1.0, 0.5), (0.0, 0.0), (0.3, 1.0)))], 256, True),
], ids=schedule_id)
def test_mosaic_training_kernels_on_packed_rows_under_xattention(kernel_calls, strict_reads,
                                                                 patterns, n, k, rows,
                                                                 xa_block, overlap):
  """make_hybrid(packed=True, xa=True, training="mosaic"): packed rows under the XAttention
  settings with random kept blocks plus those the selection forces (block 0 and each segment's
  first block, so lists hold other segments' blocks that the walks must skip or mask). Output
  and gradients against the float32 reference; the complementary kept blocks must be far off; the
  Mosaic training forward, dQ and dK/dV kernels must have run; traced under jit, both run-time
  branches must leave residuals of one layout. The Mosaic path takes these lengths (whole XA
  blocks once rounded up to 128) and not T = 300 with blocks of 256."""
  from elastic_jax.attention.xattention import XAttention, forced_blocks
  calls = kernel_calls
  st = Streaming(1, 1, 128)
  built = [packed_row(lengths, [np.asarray(c) for c in gates], k) for lengths, gates in rows]
  seg, pos, gate = (jnp.concatenate(x) for x in zip(*built))
  b, t = seg.shape
  q, kk, v = qkv(b, t, n, k, 64, jnp.bfloat16, seed=t)
  shapes = ((b, t, n, 64), (b, t, k, 64), jnp.bfloat16, st)
  assert mosaic_gpu._packed_xa_trains(*shapes, xa_block, mosaic_gpu.DEFAULT_TILES)
  assert not mosaic_gpu._packed_xa_trains((b, 300, n, 64), (b, 300, k, 64), jnp.bfloat16, st,
                                          256, mosaic_gpu.DEFAULT_TILES)
  keep = kept_blocks(b, k, t, xa_block, seed=5) | forced_blocks(
      t, XAttention(block=xa_block), seg, b)[:, None]
  d_out = jax.random.normal(jax.random.key(7), q.shape, jnp.float32).astype(jnp.bfloat16)
  fn = mosaic_gpu.make_hybrid(_schedule(overlap), training="mosaic", packed=True, xa=True)
  with jax.disable_jit():
    out, vjp = jax.vjp(lambda *x: fn(*x, seg, pos, keep, st, patterns, xa_block, INTERPRET),
                       q, kk, v, gate)
    grads = vjp(d_out)
  assert sorted(calls) == ["dkv_call", "dq_call", "packed_xa_forward_train"]
  up = [x.astype(jnp.float32) for x in (q, kk, v)]
  ref = lambda kept, *x: hybrid_attention(*x, sink_blocks=1, local_blocks=1, block=128,
                                          segment_ids=seg, positions=pos, patterns=patterns,
                                          xa_keep=kept, xa_block=xa_block)
  want, ref_vjp = jax.vjp(lambda *x: ref(keep, *x), *up, gate)
  assert float(jnp.abs(out.astype(jnp.float32) - want).max()) <= TOL[jnp.bfloat16]
  errs = [float(jnp.linalg.norm(g.astype(jnp.float32) - w) / jnp.linalg.norm(w))
          for g, w in zip(grads[:4], ref_vjp(d_out.astype(jnp.float32)))]
  assert all(e <= 1e-2 for e in errs), errs          # NaN fails too
  # The complementary kept blocks (the diagonal kept) must be far off: the lists matter.
  other = ~keep | jnp.eye(keep.shape[-1], dtype=bool)[None, None]
  _, other_vjp = jax.vjp(lambda *x: ref(other, *x), *up, gate)
  assert min(float(jnp.linalg.norm(g.astype(jnp.float32) - w) / jnp.linalg.norm(w))
             for g, w in zip(grads[:3], other_vjp(d_out.astype(jnp.float32))[:3])) > 5 * max(errs)
  loss = lambda *x: jnp.sum(fn(*x, seg, pos, keep, st, patterns, xa_block, False).astype(
      jnp.float32))
  jax.make_jaxpr(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))))(q, kk, v, gate)


@pytest.mark.parametrize("pair,xa_block,t", [(("full", "xa"), 128, 640),
                                             (("xa", "stream"), 256, 768)])
def test_packed_xa_walks_cover_the_needed_tiles_and_skip_other_segments(pair, xa_block, t):
  """The packed forward's XA walk (`packed_xa_walk`, every row XA) and the packed dQ and dK/dV
  walks under the XAttention settings, expanded through the kept-
  block lists as the kernels read them (`packed_xa_list_spans`): for every program and mode,
  distinct tiles; every tile holding a (query, key) pair a term needs (token-level masks:
  segment, causality, the streaming window by positions, the kept blocks) visited with that
  term; the XA term only on kept blocks; no block before the one holding the segment start
  of a dQ program's first row, no query block past the one holding the end of a dK/dV
  program's key segment (the lists' spans skip other segments' blocks that the selection
  forces, block 0 among them)."""
  from elastic_jax.attention.mosaic_gpu import backward as mb
  from elastic_jax.attention.common import packed_plan
  from elastic_jax.attention.xattention import XAttention, forced_blocks
  st, tile, bt = Streaming(1, 1, 128), 64, mosaic_gpu.Tiles()
  seg, pos, gate = packed_row([128, 300, 40, 150], [np.zeros(1)] * 4, 1)
  seg = jnp.pad(seg, ((0, 0), (0, t - seg.shape[1])), constant_values=-1)
  pos = jnp.pad(pos, ((0, 0), (0, t - pos.shape[1])))
  gate = jnp.zeros((1, t, 1), jnp.float32)
  xa_keep = kept_blocks(1, 1, t, xa_block, seed=3) | forced_blocks(
      t, XAttention(block=xa_block), seg)[:, None]
  lists = mosaic_gpu._packed_xa_lists(xa_keep, t, xa_block)
  index, count, keep = (np.asarray(x) for x in lists)
  col_index = np.asarray(mb.xa_column_lists(jnp.asarray(keep))[0])
  q_plan = packed_plan(seg, pos, gate, st, 64, tile)["q_plan"][:, None]            # G = 2
  k_plan = packed_plan(seg, pos, gate, st, tile, 128)["k_plan"]
  first, later = (np.asarray(x) for x in mosaic_gpu.packed_xa_list_spans(
      jnp.asarray(keep), q_plan, k_plan, xa_block, bt, 2))
  segs, p = np.asarray(seg[0]), np.asarray(pos[0])
  idx = np.arange(t)
  same = (segs[:, None] == segs[None]) & (idx[None] <= idx[:, None]) & (segs[:, None] >= 0)
  kept_tok = keep[0][idx[:, None] // xa_block, idx[None] // xa_block].astype(bool)
  masks = {"full": same, "xa": same & kept_tok,
           "stream": same & ((p[None] // st.block < st.sink_blocks)
                             | (p[:, None] // st.block - p[None] // st.block < st.local_blocks))}
  per = xa_block // tile
  terms_of = {MODE_FULL: (True, False), MODE_SPARSE: (False, True), MODE_MIX: (True, True)}

  def expand(walk, listed, rows=None):
    """The walk's tiles and their terms; with rows (a dQ program's), every tile of a range's
    unmasked part must show all its keys to every real row under each of its terms."""
    ranges, flags = walk
    seen = {}
    for rg in ranges:
      lo, hi = int(rg.lo), int(rg.hi)
      u_lo, u_hi = (lo, lo) if rg.unmasked is None else (int(u) for u in rg.unmasked)
      for x in range(lo, hi):
        tile_ = int(listed[x // per]) * per + x % per if rg.listed else x
        on = flags(tile_) if rg.flagged else (None, None)
        terms = tuple(bool(w and (f is None or f)) for w, f in zip((rg.fa, rg.sa), on))
        assert tile_ not in seen, tile_
        seen[tile_] = terms
        if rows is not None and u_lo <= x < u_hi:
          real = segs[rows] >= 0
          for pattern, term in zip(pair, (rg.fa, rg.sa)):
            keys = slice(tile_ * tile, (tile_ + 1) * tile)
            assert not term or masks[pattern][rows][real][:, keys].all(), (rows, x, pattern)
    return seen

  def check(seen, needed, mode, kept_tile, lo, hi, where):
    # Listed blocks are walked whole: bounds at block granularity.
    assert all(lo // per <= x // per < -(-hi // per) for x in seen), (where, mode, sorted(seen))
    for term, (on, tiles) in enumerate(zip(terms_of[mode], needed)):
      for x in tiles if on else ():
        assert seen.get(x, (False, False))[term], (where, mode, term, x)
      if pair[term] == "xa":   # the XA term only where the block is kept
        assert all(kept_tile(x) for x, terms in seen.items() if terms[term]), (where, mode)

  # The forward's XA launch: programs of 64 rows, KV tiles of 128; the listed piece's steps
  # that run unmasked (`listed_unmasked_steps` of the walk's unmasked tile range) must each
  # show every one of their keys to every row.
  f_plan = jnp.broadcast_to(packed_plan(seg, pos, gate, st, 64, 128)["q_plan"][:, None],
                            (1, 1, t // 64, 8))
  steps, lo, n1, second, in_lo, in_hi = (np.asarray(x)[0, 0] for x in mosaic_gpu.packed_xa_walk(
      f_plan, lists, 64, 128, xa_block))
  fper = xa_block // 128
  unmasked = 0
  for qt in range(t // 64):
    qb = qt * 64 // xa_block
    got = [int(index[0, qb, (lo[qt] + x) // fper]) * fper + (lo[qt] + x) % fper if x < n1[qt]
           else int(second[qt]) + x - int(n1[qt]) for x in range(int(steps[qt]))]
    rows = masks["xa"][qt * 64:(qt + 1) * 64]
    needed = {int(j) // 128 for j in np.nonzero(rows.any(0))[0]}
    kv_lo = int(f_plan[0, 0, qt, 0])
    assert len(set(got)) == len(got) and needed <= set(got), ("forward", qt)
    assert all(keep[0, qb, x // fper] and kv_lo // fper <= x // fper for x in got), ("fwd", qt)
    u_lo, u_hi = (int(u) for u in mb.listed_unmasked_steps(in_lo[qt], in_hi[qt],
                                                           got[0] if got else 0, n1[qt]))
    assert 0 <= u_lo <= u_hi <= n1[qt], ("fwd", qt)
    real = segs[qt * 64:(qt + 1) * 64] >= 0     # the padding's rows are never read
    for x in range(u_lo, u_hi):
      assert rows[real][:, got[x] * 128:(got[x] + 1) * 128].all(), ("fwd unmasked", qt, x)
    unmasked += u_hi - u_lo
  assert unmasked > 0   # the case has interior kept blocks
  dq_unmasked = 0
  for qt in range(t // 64):
    q_start = qt * 64
    rows = slice(q_start, q_start + 64)
    qb = q_start // xa_block
    plan = [int(v) for v in np.asarray(q_plan[0, 0, qt, :7])]
    needed = [{int(j) // tile for j in np.nonzero(masks[pt][rows].any(0))[0]} for pt in pair]
    for mode in terms_of:
      walk = mb.packed_xa_dq_walk(plan, mode, q_start, pair, (int(first[0, 0, qt]),
                                  int(count[0, qb]) - 1), xa_block, tile,
                                  lambda kb, qb=qb: bool(keep[0, qb, kb]),
                                  lambda p, qb=qb: int(index[0, qb, p // per]) * per + p % per)
      check(expand(walk, index[0, qb], rows), needed, mode,
            lambda x, qb=qb: keep[0, qb, x // per], plan[0], plan[3], ("dq", q_start))
      dq_unmasked += sum(int(rg.unmasked[1]) - int(rg.unmasked[0]) for rg in walk[0]
                         if rg.listed and rg.unmasked is not None and rg.hi > rg.lo)
  assert dq_unmasked > 0   # listed dQ steps that run unmasked
  for kt in range(t // 128):
    k_start = kt * 128
    kr = slice(k_start, k_start + 128)
    kb = k_start // xa_block
    plan = [int(v) for v in np.asarray(k_plan[0, kt, :3])]
    needed = [{int(i) // tile for i in np.nonzero(masks[pt][:, kr].any(1))[0]} for pt in pair]
    for mode in terms_of:
      walk = mb.packed_xa_dkv_walk(plan, mode, k_start, pair, int(later[0, 0, kt]), xa_block,
                                   tile, lambda qb, kb=kb: bool(keep[0, qb, kb]))
      check(expand(walk, col_index[0, kb]), needed, mode,
            lambda x, kb=kb: keep[0, x // per, kb], plan[0], plan[1], ("dkv", k_start))


def test_packed_training_falls_back_where_positions_do_not_count_up():
  """Positions that jump inside a segment: the Mosaic training path does not apply (its masks
  assume positions counting up), so the run-time branch takes the Triton kernels, whose
  gradients still match the reference."""
  st = Streaming(1, 1, 128)
  seg, pos, gate = packed_row([40, 500], [np.asarray(c) for c in ((1.0, 0.0), (0.4, 0.0))], 2)
  pos = pos.at[0, 400:].add(-150)          # a jump back inside the second segment
  q, kk, v = qkv(1, seg.shape[1], 2, 2, 64, jnp.bfloat16, seed=13)
  cot = jax.random.normal(jax.random.key(14), q.shape, jnp.float32)
  fn = mosaic_gpu.make_hybrid(training="mosaic", packed=True)
  with jax.disable_jit():
    assert not bool(mosaic_gpu.positions_count_up(seg, pos))
    grads = jax.grad(lambda *x: jnp.sum(fn(*x, seg, pos, st, INTERPRET).astype(jnp.float32)
                                        * cot), argnums=(0, 3))(q, kk, v, gate)
  up = [x.astype(jnp.float32) for x in (q, kk, v)]
  want = jax.grad(lambda *x: jnp.sum(hybrid_attention(
      *x, sink_blocks=1, local_blocks=1, block=128, segment_ids=seg, positions=pos) * cot),
                  argnums=(0, 3))(*up, gate)
  for got, w in zip(grads, want):
    assert float(jnp.linalg.norm(got.astype(jnp.float32) - w) / jnp.linalg.norm(w)) <= 1e-2
