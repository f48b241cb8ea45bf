"""XAttention's block selection and the attention over the kept blocks.

The oracle is an independent NumPy transcription of docs/method.md §3's steps (explicit loops
over stride rows and blocks); attention over the kept blocks is checked against the dense
[T, T] softmax under the same token mask.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elastic_jax.attention import Streaming, hybrid_attention
from elastic_jax.attention.reference import dense_hybrid_attention
from elastic_jax.attention.mosaic_gpu import scoring as mosaic_gpu_scoring
from elastic_jax.attention.mosaic_gpu import Tiles
from elastic_jax.attention.mosaic_gpu.scoring import block_mass_mosaic
from elastic_jax.attention.xattention import (XAttention, block_lists, block_mass,
                                              block_mass_pallas, forced_blocks, kept_fraction,
                                              select, select_blocks)


def _numpy_mass(q, k, stride, block, seg=None):
  """A[b, kv head, I, J] by the spec's steps, one query head at a time."""
  b, t, n, d = q.shape
  kh = k.shape[2]
  g = n // kh
  nb = -(-t // block)
  ns = nb * block // stride
  real = -(-t // stride)
  qp = np.zeros((b, ns * stride, n, d))
  kp = np.zeros((b, ns * stride, kh, d))
  qp[:, :t], kp[:, :t] = q, k
  segp = np.zeros((b, ns * stride), int)
  if seg is not None:
    segp[:, :t] = seg
  out = np.zeros((b, kh, nb, nb))
  for bi in range(b):
    for h in range(n):
      q_r = np.stack([np.concatenate([qp[bi, i * stride + stride - 1 - u, h]
                                      for u in range(stride)]) for i in range(ns)])
      k_r = np.stack([np.concatenate([kp[bi, j * stride + u, h // g] for u in range(stride)])
                      for j in range(ns)])
      s = q_r @ k_r.T / (np.sqrt(d) * stride)
      for i in range(real):
        cols = [j for j in range(i + 1)
                if segp[bi, j * stride] == segp[bi, i * stride]]
        p = np.exp(s[i, cols] - s[i, cols].max())
        p /= p.sum()
        for j, pj in zip(cols, p):
          out[bi, h // g, i * stride // block, j * stride // block] += pj / g
  return out


def _numpy_select(mass, threshold, forced):
  """Per row: the forced blocks, then the rest by descending mass while kept < tau * row."""
  b, kh, nb, _ = mass.shape
  keep = np.zeros(mass.shape, bool)
  for bi in range(b):
    for h in range(kh):
      for i in range(nb):
        row = mass[bi, h, i, :i + 1]
        kept = {j for j in range(i + 1) if forced[bi, i, j]}
        total = sum(row[j] for j in kept)
        for j in sorted((j for j in range(i + 1) if j not in kept), key=lambda j: (-row[j], j)):
          if total >= threshold * row.sum():
            break
          kept.add(j)
          total += row[j]
        keep[bi, h, i, sorted(kept)] = True
  return keep


def _inputs(t, n=4, kh=2, d=8, b=2, seed=0, sharp=3.0):
  rng = np.random.default_rng(seed)
  q = (sharp * rng.normal(size=(b, t, n, d))).astype(np.float32)
  k = (sharp * rng.normal(size=(b, t, kh, d))).astype(np.float32)
  v = rng.normal(size=(b, t, kh, d)).astype(np.float32)
  return q, k, v


@pytest.mark.parametrize("t,chunk,unroll", [(64, 16, 8), (100, 2, 8), (131, 3, 0), (80, 4, 0)])
def test_block_mass_matches_numpy(t, chunk, unroll):
  """One and four chunks unrolled (each chunk's causal prefix at once), three and two in the
  device loop of tiles (`unroll_chunks`)."""
  xa = XAttention(stride=4, block=16, threshold=0.9, chunk_blocks=chunk, unroll_chunks=unroll)
  q, k, _ = _inputs(t)
  got = np.asarray(block_mass(jnp.asarray(q), jnp.asarray(k), xa))
  np.testing.assert_allclose(got, _numpy_mass(q, k, 4, 16), atol=2e-5)


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize("t,stride,block,d", [(600, 4, 16, 8), (300, 8, 32, 64)])
def test_scoring_kernel_matches_numpy(t, stride, block, d, backend):
  """The Pallas scoring kernel: GPU (interpret mode on CPU, native on a GPU) and Pallas TPU
  interpret mode."""
  native = backend == "gpu" and jax.default_backend() == "gpu"
  xa = XAttention(stride=stride, block=block)
  q, k, _ = _inputs(t, d=d, seed=7)
  got = np.asarray(block_mass_pallas(jnp.asarray(q), jnp.asarray(k), xa, interpret=not native,
                                     backend=backend))
  # tf32 scores on a GPU, also in interpret mode there (its products run on the GPU)
  atol = 2e-3 if jax.default_backend() == "gpu" else 2e-5
  np.testing.assert_allclose(got, _numpy_mass(q, k, stride, block), atol=atol)


def test_mosaic_scoring_kernel_matches_numpy():
  """The Mosaic GPU scoring kernel (interpret mode on CPU, native on a GPU): head_dim in two
  pieces per step, three row tiles against one to three column tiles (open and masked ones),
  padded rows and columns, two batch rows."""
  native = jax.default_backend() == "gpu"
  t, stride, block = 600, 4, 16
  xa = XAttention(stride=stride, block=block)
  q, k, _ = _inputs(t, d=128, seed=11)
  q, k = (jnp.asarray(x, jnp.bfloat16) for x in (q, k))
  tiles = Tiles(score_rows=64, score_cols=64, score_depth=64, score_slots=3)
  got = np.asarray(block_mass_mosaic(q, k, xa, tiles=tiles, interpret=not native))
  want = _numpy_mass(*(np.asarray(x, np.float32) for x in (q, k)), stride, block)
  np.testing.assert_allclose(got, want, atol=2e-5)
  keep = np.asarray(select(q, k, xa, attn_impl="mosaic_gpu"))
  assert (keep == np.asarray(select(q, k, xa))).mean() > 0.99


def test_mosaic_scoring_kernel_names_what_it_does_not_take_and_its_memory():
  q, k = jnp.zeros((1, 256, 3, 64), jnp.bfloat16), jnp.zeros((1, 256, 1, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="does not take"):
    block_mass_mosaic(q, k, XAttention(stride=4, block=16))
  # What select(auto) budgets is the kernel's real output (traced, not run).
  xa = XAttention()
  for t in (5000, 40000):
    q, k = (jax.ShapeDtypeStruct((2, t, h, 128), jnp.bfloat16) for h in (8, 2))
    jaxpr = jax.make_jaxpr(lambda q, k: block_mass_mosaic(q, k, xa))(q, k).jaxpr
    part, _, _ = next(_three_float32_outputs(jaxpr))   # the kernel: part, tile max, tile sum
    assert part.size * 4 == mosaic_gpu_scoring.partial_sums_bytes(q.shape, xa)


def _three_float32_outputs(jaxpr):
  """The output avals of every equation with three float32 outputs, nested jaxprs included."""
  for eqn in jaxpr.eqns:
    avals = [v.aval for v in eqn.outvars]
    if len(avals) == 3 and all(a.dtype == jnp.float32 for a in avals):
      yield avals
    for param in eqn.params.values():
      inner = getattr(param, "jaxpr", param)
      if hasattr(inner, "eqns"):
        yield from _three_float32_outputs(inner)


@pytest.mark.parametrize("unroll", [0, 8])
def test_block_mass_in_packed_rows_stays_within_segments(unroll):
  xa = XAttention(stride=4, block=16, chunk_blocks=2, unroll_chunks=unroll)
  q, k, _ = _inputs(96, b=1)
  seg = np.asarray([[1] * 40 + [2] * 56])
  got = np.asarray(block_mass(jnp.asarray(q), jnp.asarray(k), xa, jnp.asarray(seg)))
  np.testing.assert_allclose(got, _numpy_mass(q, k, 4, 16, seg), atol=2e-5)


@pytest.mark.parametrize("threshold", [0.5, 0.9, 1.0])
def test_selection_is_the_minimal_set_reaching_the_threshold(threshold):
  xa = XAttention(stride=4, block=16, threshold=threshold)
  q, k, _ = _inputs(200, seed=1)
  mass = np.asarray(block_mass(jnp.asarray(q), jnp.asarray(k), xa))
  nb = mass.shape[-1]
  forced = np.asarray(forced_blocks(200, xa, batch=2))
  got = np.asarray(select(jnp.asarray(q), jnp.asarray(k), xa))
  np.testing.assert_array_equal(got, _numpy_select(mass, threshold, forced))
  causal = np.tril(np.ones((nb, nb), bool))
  assert not (got & ~causal).any() and got[..., 0].all()
  assert got[..., np.arange(nb), np.arange(nb)].all()
  row = (mass * causal).sum(-1)
  kept = (mass * got).sum(-1)
  assert (kept >= threshold * row - 1e-5).all()
  # Minimal: without its lightest non-forced block, a row falls below the threshold.
  optional = got & ~forced[:, None]
  lightest = np.where(optional, mass, np.inf).min(-1)
  has = optional.any(-1)
  assert (kept[has] - lightest[has] < threshold * row[has] + 1e-6).all()
  if threshold < 1.0:
    assert got.sum() < causal.sum() * got.shape[0] * got.shape[1]   # really sparse


def test_select_blocks_handles_ties_and_forced_blocks():
  mass = np.zeros((1, 1, 4, 4), np.float32)
  mass[0, 0, 3] = [0.1, 0.3, 0.3, 0.3]
  got = np.asarray(select_blocks(jnp.asarray(mass), 0.7))
  assert got[0, 0, 3].tolist() == [True, True, False, True]     # 0 and 3 forced, then J=1
  assert np.asarray(select_blocks(jnp.asarray(mass), 0.8))[0, 0, 3].tolist() == [True] * 4


def test_packed_rows_keep_the_block_where_each_segment_starts():
  xa = XAttention(stride=4, block=16)
  seg = jnp.asarray([[1] * 40 + [2] * 56])              # segment 2 starts in block 2
  forced = np.asarray(forced_blocks(96, xa, seg))[0]
  assert forced[5, 2] and forced[3, 2] and forced[2, 0]
  assert not forced[5, 1] and forced[5, 0] and forced[5, 5]


def test_block_lists_and_kept_fraction():
  keep = np.zeros((1, 1, 4, 4), bool)
  keep[0, 0] = np.tril(np.ones((4, 4), bool))
  keep[0, 0, 3, 1] = keep[0, 0, 2, 1] = False
  index, count = block_lists(jnp.asarray(keep))
  assert np.asarray(count)[0, 0].tolist() == [1, 2, 2, 3]
  assert np.asarray(index)[0, 0, 3, :3].tolist() == [0, 2, 3]
  # Brute force: count attended (query, key) pairs of a 58-token row, blocks of 16.
  t, blk = 58, 16
  pairs = sum(1 for qi in range(t) for kj in range(qi + 1) if keep[0, 0, qi // blk, kj // blk])
  got = np.asarray(kept_fraction(jnp.asarray(keep), jnp.asarray([t]), blk))[0, 0]
  assert got == pytest.approx(pairs / (t * (t + 1) / 2))


@pytest.mark.parametrize("setting", ["fa-xa", "xa-ssa"])
def test_attention_over_kept_blocks_matches_dense_with_gradients(setting):
  with jax.default_matmul_precision("highest"):     # no tf32 on a GPU: two jnp programs
    _attention_over_kept_blocks(setting)


def _attention_over_kept_blocks(setting):
  t, blk = 77, 16
  xa = XAttention(stride=4, block=blk, threshold=0.8)
  q, k, v = (jnp.asarray(x) for x in _inputs(t, seed=2))
  keep = select(q, k, xa)
  streaming = Streaming(sink_blocks=1, local_blocks=2, block=blk)
  gate = jnp.asarray([[1.0, 0.0], [0.3, 1.0]])
  cot = jnp.asarray(np.random.default_rng(3).normal(size=q.shape), jnp.float32)

  def loss(fn, q, k, v, gate):
    return jnp.sum(fn(q, k, v, gate) * cot)

  ref = lambda q, k, v, g: hybrid_attention(
      q, k, v, jnp.broadcast_to(g[:, None], (2, t, 2)), streaming, patterns=setting,
      xa_keep=keep, xa_block=blk, q_chunk=32, kv_chunk=16)
  dense = lambda q, k, v, g: dense_hybrid_attention(q, k, v, g, streaming, patterns=setting,
                                                    xa_keep=keep, xa_block=blk)
  np.testing.assert_allclose(ref(q, k, v, gate), dense(q, k, v, gate), atol=2e-5)
  got = jax.grad(lambda *a: loss(ref, *a), argnums=(0, 1, 2, 3))(q, k, v, gate)
  want = jax.grad(lambda *a: loss(dense, *a), argnums=(0, 1, 2, 3))(q, k, v, gate)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, atol=2e-4, rtol=1e-4)
  # A head routed to XA really skips blocks: its output differs from full attention's.
  full = dense_hybrid_attention(q, k, v, jnp.ones((2, 2)), streaming)
  xa_heads = dense(q, k, v, jnp.zeros((2, 2)) if setting == "fa-xa" else jnp.ones((2, 2)))
  assert np.abs(np.asarray(full - xa_heads)).max() > 1e-3


@pytest.mark.parametrize("backend,packed", [("triton", False), ("triton", True), ("tpu", False),
                                            ("mosaic", False)])
def test_gate_gradient_keeps_its_precision_where_xa_nearly_equals_full(backend, packed):
  """Under "fa-xa" with every block kept but one that no query attends to, O_FA and O_XA agree
  to ~4e-4, and the gate's gradient, rowsum(dO * (O_FA - O_XA)), is that small too. Each
  kernel's training forward must hand over the difference taken before rounding (bf16 O_FA and
  O_XA, subtracted afterwards, leave 40-65% errors here): against the float32 reference,
  within 2%. Run in interpret mode (natively on a GPU for the Triton and Mosaic kernels); the
  other packed kernels share the code that differs with a case here (the TPU's, the epilogue;
  the Mosaic's, `_training_outputs`)."""
  if backend == "tpu" and jax.default_backend() == "gpu":   # the TPU kernel's interpret mode
    try:                                                     # runs on the CPU device
      cpu = jax.devices("cpu")[0]
    except RuntimeError:
      pytest.skip("the TPU kernels' interpret mode needs a CPU device")
    with jax.default_device(cpu):
      _check_gate_gradient_precision(backend, packed, gpu=False)
  else:
    _check_gate_gradient_precision(backend, packed, gpu=jax.default_backend() == "gpu")


def _check_gate_gradient_precision(backend, packed, gpu):
  from elastic_jax.attention import mosaic_gpu, pallas_gpu, pallas_tpu, reference
  b, t, n, kh, d, blk = 1, 512, 4, 2, 64, 128
  keys = jax.random.split(jax.random.key(0), 5)
  u = jax.random.normal(keys[0], (d,))
  u = (u / jnp.linalg.norm(u))[None, None, None]
  q = jax.random.normal(keys[1], (b, t, n, d)) + 4.0 * u
  k = jax.random.normal(keys[2], (b, t, kh, d)).at[:, blk:2 * blk].add(-32.0 * u)
  v = jax.random.normal(keys[3], (b, t, kh, d))
  q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
  nb = t // blk
  keep = jnp.broadcast_to(jnp.tril(jnp.ones((nb, nb), bool)).at[2:, 1].set(False),
                          (b, kh, nb, nb))                 # block 1 dropped below block 2
  st = Streaming(1, 1, blk)
  seg, pos = jnp.ones((b, t), jnp.int32), jnp.arange(t, dtype=jnp.int32)[None]
  gate = jnp.full((b, t, kh) if packed else (b, kh), 0.5, jnp.float32)
  interpret = backend == "tpu" or not gpu
  if backend == "mosaic":
    fn = mosaic_gpu.make_hybrid(training="mosaic", packed=packed, xa=True)
  elif backend == "triton":
    fn = pallas_gpu.make_hybrid(packed=packed, xa=True)
  else:
    fn = pallas_tpu.make_hybrid(packed=packed, xa=True)
  rows = (seg, pos) if packed else ()
  ours = lambda g: fn(q, k, v, g, *rows, keep, st, "fa-xa", blk, interpret)
  up = lambda x: x.astype(jnp.float32)
  ref = lambda g: reference.hybrid_attention(up(q), up(k), up(v), g, st, seg, pos,
                                             patterns="fa-xa", xa_keep=keep, xa_block=blk)
  d_out = jax.random.normal(keys[4], q.shape).astype(jnp.bfloat16)
  with jax.disable_jit(backend == "mosaic" and interpret):   # as the Mosaic training tests
    got = jax.vjp(ours, gate)[1](d_out)[0]
  gate_rows = jnp.broadcast_to(gate[:, None] if not packed else gate, (b, t, kh))
  want = jax.vjp(ref, gate_rows)[1](up(d_out))[0]
  if not packed:
    want = want.sum(axis=1)
  gap = jnp.abs(ref(jnp.ones_like(gate_rows)) - ref(jnp.zeros_like(gate_rows))).max()
  assert 0 < float(gap) < 2e-2 * float(jnp.abs(ref(jnp.ones_like(gate_rows))).max())
  err = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
  assert err <= 2e-2, err
