"""The fused hybrid TPU kernels against the reference, in Pallas TPU interpret mode on CPU.

Tolerances, against the float32 reference (for bfloat16, on the same rounded inputs):
  forward    max |diff| <= 2e-5 for float32 inputs, 3e-2 for bfloat16;
  gradients  max |diff| <= tol * max(1, max |reference grad|) for dq, dk, dv and the gate, with
             tol 1e-5 for float32 (errors are ~1e-6 of the magnitude) and 2e-2 for bfloat16
             (P and dS are rounded to bfloat16 for their matmuls, as on a TPU);
  the training forward's output equals the inference forward's exactly.

Interpret mode spends its time in one host callback per memory access, not in XLA's code, so
the kernel tests compile with XLA's backend optimisation off (`_jit`), which cuts their compile
time about threefold, and keep the grids short: small T, 16-row tiles or one or two of 128.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from elastic_jax import hybrid_attention
from elastic_jax.attention import HYBRID_IMPLS, Streaming
from elastic_jax.attention.common import MODE_FULL, MODE_MIX, MODE_SPARSE, kernel_or_reference
from elastic_jax.attention.pallas_tpu import (Tiles, hybrid_forward, kv_schedule, make_hybrid,
                                              q_schedule)
from elastic_jax.attention.reference import hybrid_attention as reference

INTERPRET = jax.default_backend() != "tpu"
_jit = functools.partial(
    jax.jit, compiler_options={"xla_backend_optimization_level": 0} if INTERPRET else None)


@pytest.mark.parametrize("st", [Streaming(1, 2, 16), Streaming(2, 1, 32)])
@pytest.mark.parametrize("bq,bk", [(16, 16), (32, 16)])
def test_schedule_fetches_exactly_the_needed_tiles_then_repeats(st, bq, bk):
  t = 512
  pos = np.arange(t)
  steps = t // bk
  for qi in range(t // bq):
    rows = pos[qi * bq:(qi + 1) * bq]
    causal = pos[None] <= rows[:, None]
    window = causal & ((pos[None] // st.block < st.sink_blocks) |
                       (rows[:, None] // st.block - pos[None] // st.block < st.local_blocks))
    for mode, mask in ((MODE_FULL, causal), (MODE_MIX, causal), (MODE_SPARSE, window)):
      needed = sorted({int(k) // bk for k in np.nonzero(mask.any(0))[0]})
      fetched, n_visit = kv_schedule(mode, qi, np.arange(steps), bq, bk, st)
      fetched, n_visit = np.asarray(fetched).tolist(), int(n_visit)
      assert fetched[:n_visit] == needed, (mode, qi)
      # After the last needed tile the index repeats: the pipeline issues no new copy.
      assert set(fetched[n_visit:]) <= {needed[-1]}


CASES = [  # b, t, n, k, d, block, gates
    (1, 1, 4, 4, 64, 16, [[0.0, 1.0, 0.3, 0.0]]),
    (2, 100, 8, 2, 64, 16, [[0.0, 1.0], [0.45, 0.0]]),
    (1, 72, 4, 1, 128, 32, [[0.0]]),
]


@pytest.mark.parametrize("b,t,n,k,d,block,gates", CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_forward_matches_reference(b, t, n, k, d, block, gates, dtype):
  st = Streaming(1, 2, block)
  keys = jax.random.split(jax.random.key(t), 3)
  q, kk, v = (jax.random.normal(kk_, (b, t, h, d)).astype(dtype)
              for kk_, h in zip(keys, (n, k, k)))
  gate = jnp.asarray(gates, jnp.float32)
  out = _jit(functools.partial(hybrid_forward, streaming=st, tiles=Tiles(16, 16),
                              interpret=INTERPRET))(q, kk, v, gate)
  assert out.dtype == dtype and out.shape == q.shape
  up = lambda x: x.astype(jnp.float32)
  want = _jit(functools.partial(reference, streaming=st))(
      up(q), up(kk), up(v), jnp.broadcast_to(gate[:, None], (b, t, k)))
  tol = 2e-5 if dtype == jnp.float32 else 3e-2
  assert float(jnp.abs(out.astype(jnp.float32) - want).max()) <= tol


@pytest.mark.parametrize("st", [Streaming(1, 2, 16), Streaming(2, 1, 32), Streaming(0, 3, 8)])
@pytest.mark.parametrize("bq,bk", [(16, 16), (32, 16), (16, 32)])
def test_transposed_schedule_fetches_exactly_the_needed_query_tiles_then_repeats(st, bq, bk):
  """The dK/dV pass's query-side walk for KV tile kj: each query head of the group in turn,
  over the query tiles holding a row that sees a key of kj; then the last block repeats."""
  t, groups = 256, 3
  pos = np.arange(t)
  nq = t // bq
  steps = np.arange(groups * nq)
  for kj in range(t // bk):
    keys = pos[kj * bk:(kj + 1) * bk]
    causal = keys[None] <= pos[:, None]
    window = causal & st.allows(pos[:, None], keys[None])
    for mode, mask in ((MODE_FULL, causal), (MODE_MIX, causal), (MODE_SPARSE, window)):
      needed = sorted({int(r) // bq for r in np.nonzero(mask.any(1))[0]})
      want = [(g, i) for g in range(groups) for i in needed]
      g, qi, n_work = (np.asarray(x) for x in q_schedule(mode, kj, steps, bq, bk, nq, groups,
                                                          st))
      fetched = list(zip(g.tolist(), qi.tolist()))
      assert fetched[:int(n_work)] == want, (mode, kj)
      assert set(fetched[int(n_work):]) <= {want[-1]}


# Each case has every mode (sparse 0, full 1, mixed) in one launch.
GRAD_CASES = [  # b, t, n, k, d, tiles (None: the op's own, 128), streaming, gates, dtype
    (1, 1, 12, 3, 64, None, Streaming(1, 2, 16), [[0.0, 1.0, 0.3]], jnp.float32),
    (1, 75, 3, 3, 64, 16, Streaming(1, 2, 16), [[0.0, 1.0, 0.45]], jnp.float32),
    (1, 150, 12, 3, 128, None, Streaming(1, 2, 16), [[0.0, 1.0, 0.3]], jnp.bfloat16),
]


@functools.partial(_jit, static_argnums=0)
def _out_and_grads(fn, q, k, v, gate, d_out):
  out, vjp = jax.vjp(fn, q, k, v, gate)
  return out, vjp(d_out.astype(out.dtype))


@pytest.mark.parametrize("b,t,n,k,d,tiles,st,gates,dtype", GRAD_CASES,
                         ids=["t1-g4", "t75-g1-tiles16", "t150-g4-d128-bf16"])
def test_gradients_match_reference(b, t, n, k, d, tiles, st, gates, dtype, monkeypatch):
  """dq, dk, dv and the gate's gradient of the op on the kernels, against the reference's; the
  cases cover one tile and ragged multi-tile T, GQA groups 1 and 4, head dims 64 and 128,
  float32 and bfloat16."""
  if tiles is not None:  # the op on smaller tiles than its own, for more of them
    monkeypatch.setitem(HYBRID_IMPLS, "pallas_tpu",
                        functools.partial(kernel_or_reference,
                                          make_hybrid(Tiles(tiles, tiles))))
  pattern = dict(sink_blocks=st.sink_blocks, local_blocks=st.local_blocks, block=st.block)
  ours = functools.partial(hybrid_attention, attn_impl="pallas_tpu", interpret=INTERPRET,
                           **pattern)
  ref = functools.partial(hybrid_attention, attn_impl="reference", **pattern)
  keys = jax.random.split(jax.random.key(t), 4)
  q, kk, v, d_out = (jax.random.normal(key, (b, t, h, d)).astype(dtype)
                     for key, h in zip(keys, (n, k, k, n)))
  gate = jnp.asarray(gates, jnp.float32)
  out, grads = _out_and_grads(ours, q, kk, v, gate, d_out)
  up = lambda x: x.astype(jnp.float32)
  _, want = _out_and_grads(ref, up(q), up(kk), up(v), gate, up(d_out))
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  for name, got, ref_grad in zip(("dq", "dk", "dv", "d_gate"), grads, want):
    assert got.dtype == (jnp.float32 if name == "d_gate" else dtype), name
    scale = max(1.0, float(jnp.abs(ref_grad).max()))
    err = float(jnp.abs(up(got) - ref_grad).max())
    assert err <= tol * scale, (name, err, scale)
  if tiles is not None:
    # The training forward walks every head's causal tiles; the inference forward skips a
    # streaming head's far ones (here there are some). Their outputs are the same.
    np.testing.assert_array_equal(np.asarray(out), np.asarray(_jit(ours)(q, kk, v, gate)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernels_lower_for_a_tpu(dtype):
  """All four kernels (forward, training forward, dQ, dK/dV) on their default tiles get
  through Pallas's Mosaic lowering for a TPU; Mosaic's own compiler needs a TPU to run."""
  st = Streaming(1, 2, 128)
  fn = make_hybrid()

  def forward_and_grads(q, k, v, gate):
    out, vjp = jax.vjp(lambda *a: fn(*a, st, False), q, k, v, gate)
    return fn(q, k, v, gate, st, False), vjp(out)

  q = jax.ShapeDtypeStruct((1, 300, 4, 64), dtype)
  kv = jax.ShapeDtypeStruct((1, 300, 1, 64), dtype)
  gate = jax.ShapeDtypeStruct((1, 1), jnp.float32)
  tpu = jax.sharding.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                abstract_device=tpu)):
    module = export.export(jax.jit(forward_and_grads), platforms=["tpu"])(
        q, kv, kv, gate).mlir_module()
  for name in ("forward", "forward_train", "backward_dq", "backward_dkv"):
    assert f'kernel_name = "elastic_hybrid_{name}_tpu"' in module, name


def test_auto_is_the_reference_on_cpu():
  if jax.default_backend() != "cpu":
    pytest.skip("checks the CPU choice")
  keys = jax.random.split(jax.random.key(6), 2)
  q = jax.random.normal(keys[0], (1, 40, 2, 16))
  kk = jax.random.normal(keys[1], (1, 40, 1, 16))
  gate = jnp.asarray([[0.0]])
  np.testing.assert_array_equal(
      np.asarray(hybrid_attention(q, kk, kk, gate, block=8, local_blocks=2, attn_impl="auto")),
      np.asarray(hybrid_attention(q, kk, kk, gate, block=8, local_blocks=2)))


def test_xa_schedule_fetches_exactly_the_kept_tiles_then_repeats():
  """An XA head's query tile fetches the tiles of its kept blocks in order, the diagonal
  block only up to the causal end, then repeats the last tile."""
  from elastic_jax.attention.common import xa_operands
  from elastic_jax.attention.pallas_tpu import xa_schedule
  rng = np.random.default_rng(0)
  nb, blk, bq, bk = 6, 32, 16, 16
  keep = np.tril(rng.random((nb, nb)) < 0.5) | np.eye(nb, dtype=bool)
  keep[:, 0] = True
  index, count, _ = (np.asarray(x).reshape(-1) for x in
                     xa_operands(jnp.asarray(keep)[None, None], nb, 1))
  steps = nb * blk // bk
  for qi in range(nb * blk // bq):
    rows = np.arange(qi * bq, (qi + 1) * bq)
    keys = np.arange(nb * blk)
    ok = (keys[None] <= rows[:, None]) & keep[rows[:, None] // blk, keys[None] // blk]
    needed = sorted({int(x) // bk for x in np.nonzero(ok.any(0))[0]})
    fetched, n_visit = xa_schedule(0, qi, np.arange(steps), bq, bk, blk, nb, index, count)
    fetched, n_visit = np.asarray(fetched).tolist(), int(n_visit)
    assert fetched[:n_visit] == needed, qi
    assert set(fetched[n_visit:]) <= {needed[-1]}


@pytest.mark.parametrize("setting", ["fa-xa", "xa-ssa"])
def test_xattention_mode_matches_the_reference(setting):
  """XA heads (kept blocks prefetched as lists) with full, streaming and mixed heads in one
  launch; gradients through the training forward and the dQ / dK-dV kernels."""
  from elastic_jax.attention.reference import dense_hybrid_attention
  from elastic_jax.attention.xattention import XAttention, select
  b, t, n, kh, d = 1, 80, 3, 3, 64            # one row, three KV heads: every mode at once
  keys = jax.random.split(jax.random.key(5), 3)
  q = 3.0 * jax.random.normal(keys[0], (b, t, n, d), jnp.float32)
  k, v = (jax.random.normal(kk, (b, t, kh, d), jnp.float32) for kk in keys[1:])
  st = Streaming(1, 1, 16)
  keep = select(q, k, XAttention(stride=4, block=16, threshold=0.6))
  assert not bool(keep[..., jnp.tril(jnp.ones(keep.shape[-2:], bool))].all())
  gate = jnp.asarray([[0.0, 1.0, 0.25]])
  xa_hybrid = make_hybrid(xa=True)
  got = _jit(xa_hybrid, static_argnums=(5, 6, 7, 8))(q, k, v, gate, keep, st, setting, 16,
                                                      INTERPRET)
  want = dense_hybrid_attention(q, k, v, gate, st, patterns=setting, xa_keep=keep, xa_block=16)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)
  cot = jax.random.normal(jax.random.key(9), q.shape)
  args = (0, 1, 2, 3)
  got_g = _jit(jax.grad(lambda q, k, v, g: jnp.sum(
      xa_hybrid(q, k, v, g, keep, st, setting, 16, INTERPRET) * cot), argnums=args))(
          q, k, v, gate)
  want_g = jax.grad(lambda q, k, v, g: jnp.sum(dense_hybrid_attention(
      q, k, v, g, st, patterns=setting, xa_keep=keep, xa_block=16) * cot), argnums=args)(
          q, k, v, gate)
  for name, a, w in zip("dq dk dv dgate".split(), got_g, want_g):
    err = float(jnp.abs(a - w).max())
    assert err <= 1e-5 * max(1.0, float(jnp.abs(w).max())), (name, err)


def test_xa_kernels_lower_to_mosaic():
  """The XA mode's scalar-prefetched lists and index maps lower for a TPU, in the inference
  forward, the training forward and both backward kernels (Mosaic itself needs a TPU)."""
  st = Streaming(1, 2, 128)
  fn = make_hybrid(xa=True)

  def forward_and_grads(q, k, v, gate, keep):
    out, vjp = jax.vjp(lambda *a: fn(*a, keep, st, "fa-xa", 128, False), q, k, v, gate)
    return fn(q, k, v, gate, keep, st, "fa-xa", 128, False), vjp(out)

  q = jax.ShapeDtypeStruct((1, 512, 4, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 512, 1, 128), jnp.bfloat16)
  gate = jax.ShapeDtypeStruct((1, 1), jnp.float32)
  keep = jax.ShapeDtypeStruct((1, 1, 4, 4), jnp.bool_)
  tpu = jax.sharding.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                abstract_device=tpu)):
    module = export.export(jax.jit(forward_and_grads), platforms=["tpu"])(
        q, kv, kv, gate, keep).mlir_module()
  for name in ("forward", "forward_train", "backward_dq", "backward_dkv"):
    assert f'kernel_name = "elastic_hybrid_{name}_tpu"' in module, name


def test_former_names_and_keywords_build_the_same_kernels():
  """`fused_hybrid`, `fused_xa_hybrid` and `fused_packed_hybrid` warn (DeprecationWarning,
  naming the new call) and give `make_hybrid`'s function for those tiles; the entry points'
  block_q / block_k warn and trace to the program of `tiles=`."""
  from elastic_jax.attention import pallas_tpu
  for old, kwargs in ((lambda: pallas_tpu.fused_hybrid(16, 32), {}),
                      (lambda: pallas_tpu.fused_xa_hybrid(16, 32), dict(xa=True)),
                      (lambda: pallas_tpu.fused_packed_hybrid(16, 32, xa=True),
                       dict(packed=True, xa=True))):
    with pytest.warns(DeprecationWarning,
                      match=r"use pallas_tpu\.make_hybrid\(Tiles\(block_q, block_k\)"):
      fn = old()
    assert fn is make_hybrid(Tiles(16, 32), **kwargs)
  q = jax.ShapeDtypeStruct((1, 32, 2, 16), jnp.float32)
  kv = jax.ShapeDtypeStruct((1, 32, 1, 16), jnp.float32)
  gate = jax.ShapeDtypeStruct((1, 1), jnp.float32)
  st = Streaming(1, 1, 16)
  trace = lambda **tiles: str(jax.make_jaxpr(lambda q, k, v, g: hybrid_forward(
      q, k, v, g, st, **tiles))(q, kv, kv, gate))
  with pytest.warns(DeprecationWarning, match=r"tiles=Tiles\(block_q=16, block_k=8\)"):
    old = trace(block_q=16, block_k=8)
  assert old == trace(tiles=Tiles(16, 8))
