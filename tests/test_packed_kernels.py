"""Packed rows through the fused kernels: the tile schedule (`common.packed_plan`) and the
kernels against the reference, with several segments of odd lengths in one row, padding on
both sides and gates per (segment, KV head). Interpret mode on CPU, native on a GPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elastic_jax.attention import Streaming
from elastic_jax.attention.common import packed_plan, segment_bounds
from elastic_jax.attention.pallas_gpu import Tiles, make_hybrid
from elastic_jax.attention.reference import hybrid_attention as reference

INTERPRET = jax.default_backend() != "gpu"
F32_TOL = 2e-5 if INTERPRET else 2e-2
def _has_cpu() -> bool:
  try:
    return bool(jax.devices("cpu"))
  except RuntimeError:
    return False


# Pallas TPU's interpret mode runs on a CPU device (absent where JAX_PLATFORMS names only a GPU).
needs_cpu = pytest.mark.skipif(not _has_cpu(), reason="TPU interpret mode needs a CPU device")


def _on_cpu():
  """Where the TPU kernels' cases run, kernel and reference alike: the CPU device, also on a
  GPU host (whose float32 products would leave the tight tolerances of these cases)."""
  return jax.default_device(jax.devices("cpu")[0])


_jit = functools.partial(
    jax.jit, compiler_options={"xla_backend_optimization_level": 0} if INTERPRET else None)


def _row(lengths, ids=None):
  """(segment ids, positions) of one row made of runs of these lengths."""
  ids = ids if ids is not None else list(range(1, len(lengths) + 1))
  seg = np.concatenate([[i] * n for i, n in zip(ids, lengths)])
  pos = np.concatenate([np.arange(n) for n in lengths])
  return seg.astype(np.int32), pos.astype(np.int32)


def _needed(seg, pos, st: Streaming, block_q, block_k, sparse: bool):
  """Per query tile, the key tiles holding a key some row may see (token-level mask)."""
  t = len(seg)
  idx = np.arange(t)
  ok = (idx[None] <= idx[:, None]) & (seg[None] == seg[:, None])
  if sparse:
    ok &= np.asarray(st.allows(pos[:, None], pos[None]))
  return [{int(j) // block_k for j in np.nonzero(ok[i:i + block_q].any(0))[0]}
          for i in range(0, t, block_q)]


LAYOUTS = [
    [37, 101, 64, 90],          # four segments, none aligned with a tile
    [5, 200, 3, 48],            # tiny ones between
    [256],                      # one segment: the unpacked schedule
]


@pytest.mark.parametrize("lengths", LAYOUTS)
@pytest.mark.parametrize("block_q,block_k,st", [(16, 16, Streaming(1, 2, 16)),
                                                (32, 16, Streaming(2, 1, 32)),
                                                (16, 64, Streaming(0, 3, 16)),
                                                (32, 32, Streaming(1, 1, 64))])
def test_plan_visits_the_tiles_of_each_segment(lengths, block_q, block_k, st):
  """Forward: every tile holding a visible key is visited; a tile wholly before the segment of
  the query tile's first row never is; a query tile inside one segment visits exactly the
  tiles its rows need. dK/dV: each key tile's query range is the transpose."""
  seg, pos = _row(lengths)
  t = len(seg)
  pad = -t % max(block_q, block_k)
  seg = np.concatenate([seg, np.full(pad, -1, np.int32)]).astype(np.int32)
  pos = np.concatenate([pos, np.arange(pad)]).astype(np.int32)
  t = len(seg)
  gate = np.zeros((1, t, 1), np.float32)
  plan = jax.tree.map(np.asarray, packed_plan(jnp.asarray(seg[None]), jnp.asarray(pos[None]),
                                              jnp.asarray(gate), st, block_q, block_k))
  start = np.asarray(segment_bounds(jnp.asarray(seg[None]))[0][0])
  full_need = _needed(seg, pos, st, block_q, block_k, False)
  sparse_need = _needed(seg, pos, st, block_q, block_k, True)
  visits_full, visits_sparse = [], []
  idx = np.arange(t)
  ok_full = (idx[None] <= idx[:, None]) & (seg[None] == seg[:, None])
  ok_sparse = ok_full & np.asarray(st.allows(pos[:, None], pos[None]))
  for i, (kv_lo, sink_hi, win_lo, causal_hi, in_lo, in_hi, sp_hi, _) in enumerate(
      plan["q_plan"][0]):
    full = set(range(kv_lo, causal_hi))
    sparse = set(range(kv_lo, sink_hi)) | set(range(max(win_lo, sink_hi), causal_hi))
    visits_full.append(full)
    visits_sparse.append(sparse)
    assert full_need[i] <= full and sparse_need[i] <= sparse, i
    # The tiles run without a mask are wholly visible to every row of the query tile.
    rows = slice(i * block_q, (i + 1) * block_q)
    for j in range(in_lo, in_hi):
      assert ok_full[rows, j * block_k:(j + 1) * block_k].all(), (i, j)
    for j in set(range(in_lo, sp_hi)) & sparse:
      assert ok_sparse[rows, j * block_k:(j + 1) * block_k].all(), (i, j)
    first = i * block_q
    assert min(full) == start[first] // block_k        # earlier segments' tiles: skipped
    rows = seg[first:first + block_q]
    if (rows == rows[0]).all():
      assert full == full_need[i], i
      assert sparse == sparse_need[i], (i, sparse - sparse_need[i])
  for j, (q_lo, q_hi_full, q_hi_sparse, _) in enumerate(plan["k_plan"][0]):
    full = {i for i, v in enumerate(visits_full) if j in v}
    sparse = {i for i, v in enumerate(visits_sparse) if j in v}
    assert full <= set(range(q_lo, q_hi_full)), j
    assert sparse <= set(range(q_lo, q_hi_sparse)), j
    need = {i for i, v in enumerate(full_need) if j in v}
    assert set(range(q_lo, q_hi_full)) - need <= {q_hi_full - 1}, j   # at most the edge


def test_plan_modes_follow_the_gates_of_the_rows_served():
  seg, pos = _row([40, 40, 48])
  gate = np.zeros((1, 128, 2), np.float32)
  gate[0, :40, 0] = 1.0          # segment 1: head 0 full
  gate[0, 40:80, :] = 0.5        # segment 2: both mixed
  plan = packed_plan(jnp.asarray(seg[None]), jnp.asarray(pos[None]), jnp.asarray(gate),
                     Streaming(1, 1, 16), 32, 32)
  q_modes = np.asarray(plan["q_modes"])[0]
  np.testing.assert_array_equal(q_modes[0], [1, 2, 2, 0])     # rows 0-31 full; 32-63 mixed...
  np.testing.assert_array_equal(q_modes[1], [0, 2, 2, 0])


SMALL = dict(forward_tiles=Tiles(16, 16, 1), train_forward_tiles=Tiles(16, 16, 1),
             dq_tiles=Tiles(16, 32, 1), dkv_tiles=Tiles(32, 16, 1))


def _packed_case(n, k, seed, short=False):
  """Two rows: left padding, three segments of odd lengths, right padding (the pads are
  runs of their own ids with positions that are not 0.. (as generation leaves them)); the
  other row a different split. Gates per (segment, KV head): every combination of full and
  streaming over the first two KV heads, one mixed. short: 64 tokens a row, else 128."""
  rows = ([([5, 19, 22, 10, 8], [0, 1, 2, 3, 8]), ([30, 3, 17, 14], [1, 2, 3, 4])] if short
          else [([9, 37, 50, 21, 11], [0, 1, 2, 3, 8]), ([60, 3, 41, 24], [1, 2, 3, 4])])
  segs, poss = [], []
  for lengths, ids in rows:
    seg, pos = _row(lengths, ids)
    for pad_id in (0, 8):              # padding keeps the positions it was given
      pos = np.where(seg == pad_id, 5, pos)
    segs.append(seg)
    poss.append(pos)
  seg, pos = np.stack(segs), np.stack(poss)
  t = seg.shape[1]
  combos = {0: (0.0, 0.0), 1: (1.0, 0.0), 2: (0.0, 1.0), 3: (1.0, 1.0), 4: (0.5, 0.0),
            8: (0.0, 0.0)}
  gate = np.zeros((2, t, k), np.float32)
  for b in range(2):
    for i in range(t):
      g = combos[int(seg[b, i])]
      gate[b, i, :2] = g
      gate[b, i, 2:] = g[0]
  keys = jax.random.split(jax.random.key(seed), 3)
  q, kk, v = (jax.random.normal(key, (2, t, h, 64), jnp.float32)
              for key, h in zip(keys, (n, k, k)))
  return q, kk, v, jnp.asarray(gate), jnp.asarray(seg), jnp.asarray(pos)


@pytest.mark.parametrize("n,k", [(4, 4), (8, 2)])
def test_packed_kernel_outputs_and_gradients_match_the_reference(n, k):
  st = Streaming(1, 2, 16)
  q, kk, v, gate, seg, pos = _packed_case(n, k, seed=n)
  fn = make_hybrid(**SMALL, packed=True)
  ours = lambda q, kk, v, g: fn(q, kk, v, g, seg, pos, st, INTERPRET)
  ref = lambda q, kk, v, g: reference(q, kk, v, g, st, seg, pos, q_chunk=32, kv_chunk=32)
  out = _jit(ours)(q, kk, v, gate)
  want = ref(q, kk, v, gate)
  assert float(jnp.abs(out - want).max()) <= F32_TOL
  cot = jax.random.normal(jax.random.key(1), q.shape)
  loss = lambda f: lambda *a: jnp.sum(f(*a) * cot)
  val, g_ours = _jit(jax.value_and_grad(loss(ours), argnums=(0, 1, 2, 3)))(q, kk, v, gate)
  ref_val, g_ref = jax.value_and_grad(loss(ref), argnums=(0, 1, 2, 3))(q, kk, v, gate)
  np.testing.assert_allclose(float(val), float(ref_val), rtol=1e-5 if INTERPRET else 1e-3,
                             atol=1e-3)
  tol = 1e-5 if INTERPRET else 2e-2
  for name, a, r in zip(("dq", "dk", "dv", "d_gate"), g_ours, g_ref):
    err = float(jnp.abs(a - r).max())
    assert err <= tol * max(1.0, float(jnp.abs(r).max())), (name, err)


def test_packed_rows_break_the_rules_in_one_sentence():
  """Where the values are known: a segment split into runs, positions that do not count from
  a segment's start, a gate that varies inside a segment. Padding (id 0) is free of them."""
  from elastic_jax import hybrid_attention
  from elastic_jax.errors import ElasticJaxError
  st = dict(sink_blocks=1, local_blocks=2, block=16)
  q = jnp.zeros((1, 12, 2, 16))
  kk = jnp.zeros((1, 12, 1, 16))
  ok_seg = jnp.asarray([[0, 0, 1, 1, 1, 1, 2, 2, 2, 0, 0, 0]])
  ok_pos = jnp.asarray([[9, 9, 0, 1, 2, 3, 0, 1, 2, 9, 9, 9]])
  gate = jnp.zeros((1, 12, 1))
  hybrid_attention(q, kk, kk, gate, segment_ids=ok_seg, positions=ok_pos, **st)
  cases = [
      (jnp.asarray([[1, 1, 2, 2, 1, 1, 3, 3, 3, 3, 3, 3]]), None, gate,
       "segment 1 is split into several runs"),
      (ok_seg, jnp.asarray([[9, 9, 1, 2, 3, 4, 0, 1, 2, 9, 9, 9]]), gate,
       "segment 1 \\(tokens 2-5\\) must count 0, 1, ... from its start"),
      (ok_seg, ok_pos, gate.at[0, 7, 0].set(1.0),
       "segment 2 \\(tokens 6-8\\) has more than one gate per KV head"),
  ]
  for seg, pos, g, msg in cases:
    with pytest.raises(ElasticJaxError, match=msg):
      hybrid_attention(q, kk, kk, g, segment_ids=seg, positions=pos, **st)


def test_rule_breaking_rows_under_jit_agree_across_implementations():
  """Under jit the values go unchecked; the operator then still computes one thing for every
  implementation: an id used by two runs makes two segments, and a segment (without
  segment_ids, a row) is routed by its first token's gate. The kernel against the reference,
  each through the public operator, on such rows; and a well-formed per-token gate keeps its
  per-token gradient."""
  from elastic_jax import hybrid_attention
  st = dict(sink_blocks=1, local_blocks=1, block=16)
  t, k = 96, 2
  keys = jax.random.split(jax.random.key(7), 4)
  q, kk, v = (jax.random.normal(key, (1, t, h, 32), jnp.float32)
              for key, h in zip(keys, (2 * k, k, k)))
  split = jnp.asarray([[1] * 32 + [2] * 32 + [1] * 32])
  varying = jax.random.uniform(keys[3], (1, t, k))
  kernel = dict(attn_impl="pallas_gpu", interpret=INTERPRET)
  for seg, gate in ((split, jnp.tile(jnp.asarray([[[1.0, 0.0]]]), (1, t, 1))),
                    (None, varying), (split, varying)):
    run = lambda impl, seg=seg: jax.jit(lambda g, s: hybrid_attention(
        q, kk, v, g, segment_ids=s, **st, **impl))(gate, seg)
    out, want = run(kernel), run(dict(attn_impl="reference"))
    assert float(jnp.abs(out - want).max()) <= F32_TOL
  # What the rule means, on the reference (on the CPU device, also on a GPU host, whose
  # float32 products would leave these tight tolerances): the split row is three segments.
  ref = dict(st, attn_impl="reference")
  with _on_cpu():
    runs = jnp.asarray([[1] * 32 + [2] * 32 + [3] * 32])
    g2 = jnp.ones((1, k))
    a = hybrid_attention(q, kk, v, g2, segment_ids=runs, **ref)
    b = jax.jit(lambda s: hybrid_attention(q, kk, v, g2, segment_ids=s, **ref))(split)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    # A well-formed per-token gate: its gradient is the raw reference's, token by token.
    seg, _ = _row([40, 56])
    gate = jnp.where(jnp.asarray(seg)[None, :, None] == 1, 0.3, 0.8) * jnp.ones((1, t, k))
    cot = jax.random.normal(keys[0], q.shape)
    loss = lambda g: jnp.sum(hybrid_attention(q, kk, v, g, segment_ids=jnp.asarray(seg[None]),
                                              **ref) * cot)
    raw = lambda g: jnp.sum(reference(q, kk, v, g, Streaming(1, 1, 16), jnp.asarray(seg[None]),
                                      None) * cot)
    np.testing.assert_allclose(np.asarray(jax.grad(loss)(gate)),
                               np.asarray(jax.grad(raw)(gate)), atol=1e-5)


@pytest.mark.parametrize("g", [1, 4])
def test_packed_forward_on_tile_aligned_segments_matches_the_reference(g):
  """Segments that start on tile boundaries (the unmasked interior tiles run), gates per
  (segment, KV head) in every combination, one segment as long as the sink."""
  st = Streaming(1, 2, 16)
  seg, pos = _row([64, 96, 16, 80])
  k = 2
  gate = np.zeros((1, len(seg), k), np.float32)
  for i, pair in zip(range(1, 5), [(1, 0), (0, 1), (1, 1), (0, 0)]):
    gate[0, seg == i] = pair
  keys = jax.random.split(jax.random.key(g), 3)
  q, kk, v = (jax.random.normal(key, (1, len(seg), h, 32), jnp.float32)
              for key, h in zip(keys, (k * g, k, k)))
  fn = make_hybrid(**SMALL, packed=True)
  args = (jnp.asarray(gate), jnp.asarray(seg[None]), jnp.asarray(pos[None]))
  out = _jit(lambda q, kk, v, gt, s, p: fn(q, kk, v, gt, s, p, st, INTERPRET))(q, kk, v, *args)
  want = reference(q, kk, v, args[0], st, args[1], args[2], q_chunk=32, kv_chunk=32)
  assert float(jnp.abs(out - want).max()) <= F32_TOL


@needs_cpu
@pytest.mark.parametrize("n,k", [(8, 2)])
def test_packed_tpu_kernel_outputs_and_gradients_match_the_reference(n, k):
  """The TPU kernels (interpret mode, slow: short rows) on the same kind of packed rows:
  outputs, dq, dk, dv, d(gate), GQA 4 (GQA 1 runs in the packed XA case below)."""
  with _on_cpu():
    _check_packed_tpu_kernel(n, k)


def _check_packed_tpu_kernel(n, k):
  from elastic_jax.attention import pallas_tpu
  st = Streaming(1, 2, 8)
  q, kk, v, gate, seg, pos = _packed_case(n, k, seed=10 + n, short=True)
  fn = pallas_tpu.make_hybrid(pallas_tpu.Tiles(16, 16), packed=True)
  ours = lambda q, kk, v, g: fn(q, kk, v, g, seg, pos, st, True)
  ref = lambda q, kk, v, g: reference(q, kk, v, g, st, seg, pos, q_chunk=32, kv_chunk=32)
  assert float(jnp.abs(_jit(ours)(q, kk, v, gate) - ref(q, kk, v, gate)).max()) <= 2e-5
  cot = jax.random.normal(jax.random.key(1), q.shape)
  loss = lambda f: lambda *a: jnp.sum(f(*a) * cot)
  _, g_ours = _jit(jax.value_and_grad(loss(ours), argnums=(0, 1, 2, 3)))(q, kk, v, gate)
  _, g_ref = jax.value_and_grad(loss(ref), argnums=(0, 1, 2, 3))(q, kk, v, gate)
  for name, a, r in zip(("dq", "dk", "dv", "d_gate"), g_ours, g_ref):
    err = float(jnp.abs(a - r).max())
    assert err <= 1e-5 * max(1.0, float(jnp.abs(r).max())), (name, err)


def _xa_keep(b, k, nb, seed):
  """Random kept blocks (about half) with the diagonal kept, causal: XAttention's form."""
  keep = (jax.random.bernoulli(jax.random.key(seed), 0.5, (b, k, nb, nb))
          | jnp.eye(nb, dtype=bool)[None, None])
  return keep & jnp.tril(jnp.ones((nb, nb), bool))[None, None]


@pytest.mark.parametrize("patterns,n,k,tpu", [("fa-xa", 4, 4, False), ("xa-ssa", 8, 2, False),
                                              pytest.param("xa-ssa", 2, 2, True,
                                                           marks=needs_cpu)])
def test_packed_xa_kernels_match_the_reference(patterns, n, k, tpu):
  """The XAttention settings on packed rows (an XA head walks its segment's tiles and masks
  in the kept blocks): outputs and gradients against the reference, which the case can tell
  from FA/SSA."""
  if tpu:
    with _on_cpu():
      _check_packed_xa(patterns, n, k, tpu)
  else:
    _check_packed_xa(patterns, n, k, tpu)


def _check_packed_xa(patterns, n, k, tpu):
  from elastic_jax.attention import pallas_tpu
  # On a GPU host the GPU kernels and the reference run on the GPU (looser tolerances).
  out_tol, grad_tol = (2e-5, 1e-5) if INTERPRET or tpu else (2e-2, 2e-2)
  st = Streaming(1, 2, 16 if not tpu else 8)
  q, kk, v, gate, seg, pos = _packed_case(n, k, seed=20 + n, short=tpu)
  xa_block = 32 if not tpu else 16
  keep = _xa_keep(2, k, seg.shape[1] // xa_block, seed=n)
  fn = (pallas_tpu.make_hybrid(pallas_tpu.Tiles(16, 16), packed=True, xa=True) if tpu
        else make_hybrid(**SMALL, packed=True, xa=True))
  ours = lambda q, kk, v, g: fn(q, kk, v, g, seg, pos, keep, st, patterns, xa_block,
                                True if tpu else INTERPRET)
  ref = lambda q, kk, v, g, pat=patterns: reference(
      q, kk, v, g, st, seg, pos, q_chunk=32, kv_chunk=32, patterns=pat, xa_keep=keep,
      xa_block=xa_block)
  out, want = _jit(ours)(q, kk, v, gate), ref(q, kk, v, gate)
  assert float(jnp.abs(out - want).max()) <= out_tol
  assert float(jnp.abs(want - ref(q, kk, v, gate, "fa-ssa")).max()) > 100 * out_tol
  cot = jax.random.normal(jax.random.key(2), q.shape)
  loss = lambda f: lambda *a: jnp.sum(f(*a) * cot)
  g_ours = _jit(jax.grad(loss(ours), argnums=(0, 1, 2, 3)))(q, kk, v, gate)
  g_ref = jax.grad(loss(ref), argnums=(0, 1, 2, 3))(q, kk, v, gate)
  for name, a, r in zip(("dq", "dk", "dv", "d_gate"), g_ours, g_ref):
    err = float(jnp.abs(a - r).max())
    assert err <= grad_tol * max(1.0, float(jnp.abs(r).max())), (name, err)
