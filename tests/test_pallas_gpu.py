"""The fused hybrid GPU kernel against the reference; interpret mode on CPU, native on a GPU.

Tolerances against the float32 reference. Outputs: float32 inputs max |diff| <= 2e-5 (interpret)
or 2e-2 (native: Triton's float32 dot runs in tf32); bfloat16 inputs <= 3e-2. Gradients: max
|diff| <= tol * max(1, max |reference grad|) with tol 1e-5 for float32 in interpret mode, 2e-2
natively, and 2e-2 for bfloat16 inputs.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elastic_jax import hybrid_attention
from elastic_jax.attention import Streaming, pallas_gpu
from elastic_jax.attention.common import (dkv_program, modes_from_gate, q_tile_range,
                                          tile_ranges)
from elastic_jax.attention.pallas_gpu import Tiles, make_hybrid
from elastic_jax.attention.reference import dense_hybrid_attention

INTERPRET = jax.default_backend() != "gpu"
F32_TOL = 2e-5 if INTERPRET else 2e-2
GRAD_TOL = {jnp.float32: 1e-5 if INTERPRET else 2e-2, jnp.bfloat16: 2e-2}
# Interpret-mode programs run as host callbacks: XLA's backend optimisation only costs compile
# time there.
_jit = functools.partial(
    jax.jit, compiler_options={"xla_backend_optimization_level": 0} if INTERPRET else None)


def _inputs(b, t, n, k, d, dtype, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  return tuple(jax.random.normal(kk, (b, t, h, d), jnp.float32).astype(dtype)
               for kk, h in zip(keys, (n, k, k)))


def _reference(q, k, v, gate_bk, st):
  return dense_hybrid_attention(q, k, v, gate_bk, st)


def test_modes_from_gate():
  np.testing.assert_array_equal(np.asarray(modes_from_gate(jnp.asarray([0.0, 1.0, 0.5, 1e-3]))),
                                [0, 1, 2, 2])


@pytest.mark.parametrize("block_q,block_k", [(16, 16), (16, 32), (32, 16), (64, 64)])
@pytest.mark.parametrize("st", [Streaming(1, 2, 16), Streaming(2, 1, 32), Streaming(1, 3, 64)])
def test_tile_ranges_cover_exactly_the_needed_tiles(block_q, block_k, st):
  """A sparse tile visits every KV tile holding a key some row may see, and no tile that holds
  none beyond the gap between sink and window (checked against the token-level mask)."""
  t = 640
  pos = np.arange(t)
  for q_start in range(0, t, block_q):
    rows = pos[q_start:q_start + block_q]
    ok = (pos[None] <= rows[:, None]) & ((pos[None] // st.block < st.sink_blocks) | (
        rows[:, None] // st.block - pos[None] // st.block < st.local_blocks))
    needed = {int(j) // block_k for j in np.nonzero(ok.any(0))[0]}
    sink_end, win_start, causal_end = (int(x) for x in tile_ranges(q_start, block_q, block_k,
                                                                   st))
    visited = set(range(sink_end)) | set(range(max(win_start, sink_end), causal_end))
    assert needed <= visited, (q_start, needed - visited)
    assert visited - needed == set(), (q_start, visited - needed)


@pytest.mark.parametrize("kh,nt,keys,st", [(8, 256, 128, Streaming(1, 16, 128)),
                                           (3, 7, 32, Streaming(3, 2, 16)),
                                           (2, 5, 64, Streaming(0, 2, 64)),
                                           (4, 2, 16, Streaming(4, 1, 16))])
def test_dkv_program_order(kh, nt, keys, st):
  """`common.dkv_program`, the dK/dV kernels' start order: every (key tile, KV head) once;
  first the tiles holding sink keys (at least one) of every head, then head by head the rest
  in key order (the heaviest first)."""
  tile, head = (np.asarray(x) for x in dkv_program(jnp.arange(kh * nt, dtype=jnp.int32), kh,
                                                   nt, keys, st))
  order = list(zip(tile.tolist(), head.tolist()))
  assert sorted(order) == [(i, h) for i in range(nt) for h in range(kh)]
  sink_tiles = {key // keys for key in range(min(st.sink_blocks * st.block, nt * keys))}
  first = max(1, len(sink_tiles))   # tiles holding a sink key, counted one key at a time
  assert order[:kh * first] == [(i, h) for i in range(first) for h in range(kh)]
  assert order[kh * first:] == [(i, h) for h in range(kh) for i in range(first, nt)]


@pytest.mark.parametrize("block_q,block_k", [(16, 16), (16, 32), (32, 16), (64, 128)])
@pytest.mark.parametrize("st", [Streaming(1, 2, 16), Streaming(2, 1, 32), Streaming(0, 3, 24)])
def test_q_tile_range_is_the_transpose_of_the_forward_schedule(block_q, block_k, st):
  """The dK/dV pass visits, for each KV tile, exactly the query tiles whose forward walk visits
  it: all causal ones for a full head, the sink/window ones for a streaming head."""
  t = 768
  nq = t // block_q
  for j in range(t // block_k):
    full, sparse = [], []
    for i in range(nq):
      sink_end, win_start, causal_end = (int(x) for x in tile_ranges(i * block_q, block_q,
                                                                     block_k, st))
      full += [i] if j < causal_end else []
      sparse += [i] if j < sink_end or max(win_start, sink_end) <= j < causal_end else []
    lo, hi = (int(x) for x in q_tile_range(j, block_q, block_k, nq, st))
    assert full == list(range(lo, nq)), j
    assert sparse == list(range(lo, hi)), j


# Every mode (sparse 0, full 1, mixed) in one launch; T from one tile to ragged multi-tile;
# GQA groups 1 and 4; head_dim 64 and 128.
CASES = [
    # b, t, n, k, d, block, gates
    (1, 1, 4, 4, 64, 16, [[0.0, 1.0, 0.3, 0.0]]),
    (2, 100, 4, 1, 64, 16, [[0.0], [1.0]]),
    (1, 150, 8, 2, 128, 32, [[0.6, 0.0]]),
    (2, 77, 4, 4, 64, 16, [[1.0, 0.0, 0.25, 1.0], [0.0, 0.0, 1.0, 0.9]]),
    (1, 90, 4, 2, 64, 24, [[0.0, 0.5]]),  # SSA blocks not aligned with tiles: masked path
]
# Small tiles so that short inputs still cross many tiles and SSA blocks.
SMALL = dict(forward_tiles=Tiles(16, 16, 1), train_forward_tiles=Tiles(16, 16, 1),
             dq_tiles=Tiles(16, 32, 1), dkv_tiles=Tiles(32, 16, 1))


@pytest.mark.parametrize("b,t,n,k,d,block,gates", CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_forward_training_forward_and_gradients_match_reference(b, t, n, k, d, block, gates,
                                                                dtype):
  """Inference forward, training forward (both outputs in one pass) and the fused backward
  (dq, dk, dv, d_gate) against the float32 reference's values and `jax.grad`."""
  if dtype == jnp.bfloat16 and t < 100:
    pytest.skip("bfloat16 is checked on the longer cases")
  st = Streaming(1, 2, block)
  q, kk, v = _inputs(b, t, n, k, d, dtype, seed=t)
  gate = jnp.asarray(gates, jnp.float32)
  fn = make_hybrid(**SMALL)
  out = _jit(lambda *a: fn(*a, st, INTERPRET))(q, kk, v, gate)
  assert out.dtype == dtype and out.shape == q.shape
  want = _reference(q, kk, v, gate, st)
  fwd_tol = F32_TOL if dtype == jnp.float32 else 3e-2
  assert float(jnp.abs(out.astype(jnp.float32) - want).max()) <= fwd_tol

  cot = jax.random.normal(jax.random.key(7), q.shape)
  loss = lambda f: lambda *a: jnp.sum(f(*a).astype(jnp.float32) * cot)
  train_out, g_ours = _jit(jax.value_and_grad(loss(lambda *a: fn(*a, st, INTERPRET)),
                                              argnums=(0, 1, 2, 3)))(q, kk, v, gate)
  up = lambda x: x.astype(jnp.float32)
  ref_out, g_ref = _jit(jax.value_and_grad(loss(lambda *a: _reference(*a, st)),
                                           argnums=(0, 1, 2, 3)))(up(q), up(kk), up(v), gate)
  np.testing.assert_allclose(float(train_out), float(ref_out), atol=1e-3,
                             rtol=1e-5 if dtype == jnp.float32 and INTERPRET else 2e-2)
  for name, a, r in zip(("dq", "dk", "dv", "d_gate"), g_ours, g_ref):
    assert a.dtype == (gate.dtype if name == "d_gate" else dtype), name
    err = float(jnp.abs(up(a) - r).max())
    bound = GRAD_TOL[dtype] * max(1.0, float(jnp.abs(r).max()))
    assert err <= bound, (name, err, bound)


def test_backward_kernels_launch_alone():
  """`_backward_call(kernels=...)` (what benchmarks/kernel_profile.py times): the dQ or dK/dV
  kernel alone gives the gradients the two together give, bit for bit, and None for the
  kernel left out."""
  st = Streaming(1, 2, 16)
  q, kk, v = _inputs(1, 70, 4, 2, 64, jnp.float32, seed=3)
  gate = jnp.asarray([[0.0, 0.4]], jnp.float32)
  _, forward_train, _ = pallas_gpu.parts(**{k: x for k, x in SMALL.items()
                                            if k != "forward_tiles"})
  _, res = forward_train(q, kk, v, gate, st, INTERPRET)
  d_out = jax.random.normal(jax.random.key(5), q.shape)
  call = lambda kernels: pallas_gpu._backward_call(res, d_out, st, INTERPRET, SMALL["dq_tiles"],
                                                   SMALL["dkv_tiles"], kernels=kernels)
  both, dq_alone, dkv_alone = call(("dq", "dkv")), call(("dq",)), call(("dkv",))
  assert dq_alone[1] is None and dq_alone[2] is None and dkv_alone[0] is None
  for name, x, y in (("dq", both[0], dq_alone[0]), ("dk", both[1], dkv_alone[1]),
                     ("dv", both[2], dkv_alone[2]), ("d_gate", both[3], dkv_alone[3])):
    assert bool(jnp.array_equal(x, y)), name
  assert float(jnp.abs(both[1]).max()) > 0


def test_op_routes_to_the_kernel_unpacked_and_packed():
  """`hybrid_attention(attn_impl="pallas_gpu")`: the kernel's values (default tiles), and with
  segment ids the packed kernel's, both the reference's."""
  st = dict(sink_blocks=1, local_blocks=2, block=16)
  q, kk, v = _inputs(1, 70, 4, 2, 64, jnp.float32, seed=3)
  gate = jnp.asarray([[0.0, 0.7]])
  ours = functools.partial(hybrid_attention, attn_impl="pallas_gpu", interpret=INTERPRET, **st)
  ref = functools.partial(hybrid_attention, attn_impl="reference", **st)
  np.testing.assert_allclose(np.asarray(ours(q, kk, v, gate)),
                             np.asarray(ref(q, kk, v, gate)), atol=F32_TOL)
  seg = jnp.asarray([[1] * 30 + [2] * 40])
  np.testing.assert_allclose(np.asarray(ours(q, kk, v, gate, segment_ids=seg)),
                             np.asarray(ref(q, kk, v, gate, segment_ids=seg)), atol=F32_TOL)


@pytest.mark.parametrize("setting,t,g,d,tiles", [("fa-xa", 128, 1, 64, (32, 16)),
                                                  ("xa-ssa", 300, 4, 128, (16, 32))])
def test_xattention_mode_matches_the_reference(setting, t, g, d, tiles):
  """The XA mode: heads read only their kept blocks (a compact list per query block), in one
  launch with full, streaming and mixed heads; gradients (dq, dk, dv, gate) through the fused
  training forward and backward kernels."""
  from elastic_jax.attention.xattention import XAttention, select
  b, kh = 2, 2
  q, k, v = _inputs(b, t, kh * g, kh, d, jnp.float32, seed=4)
  q = q * 3.0                                   # peaky scores: XA really drops blocks
  st = Streaming(1, 1, 32)
  keep = select(q, k, XAttention(stride=8, block=32, threshold=0.6))
  assert not bool(keep[..., jnp.tril(jnp.ones(keep.shape[-2:], bool))].all())
  gate = jnp.asarray([[0.0, 1.0], [1.0, 0.25]])            # every mode in one launch
  fn = make_hybrid(Tiles(*tiles, 1, 4), xa=True)
  got = _jit(fn, static_argnums=(5, 6, 7, 8))(q, k, v, gate, keep, st, setting, 32, INTERPRET)
  want = dense_hybrid_attention(q, k, v, gate, st, patterns=setting, xa_keep=keep, xa_block=32)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=F32_TOL)
  cot = jax.random.normal(jax.random.key(9), q.shape)
  grads = jax.grad(lambda q, k, v, gate: jnp.sum(
      fn(q, k, v, gate, keep, st, setting, 32, INTERPRET) * cot), argnums=(0, 1, 2, 3))(
          q, k, v, gate)
  want_g = jax.grad(lambda q, k, v, gate: jnp.sum(dense_hybrid_attention(
      q, k, v, gate, st, patterns=setting, xa_keep=keep, xa_block=32) * cot),
      argnums=(0, 1, 2, 3))(q, k, v, gate)
  for a, w in zip(grads, want_g):
    np.testing.assert_allclose(np.asarray(a), np.asarray(w),
                               atol=GRAD_TOL[jnp.float32] * max(1.0, float(jnp.abs(w).max())))


def test_former_names_and_keywords_build_the_same_kernels():
  """The builders' former names and the entry points' bare tile keywords warn
  (DeprecationWarning, naming the new call) and trace to the program of `make_hybrid(...,
  packed=, xa=)` and `tiles=`; the parts' former names (the Mosaic GPU backend's) do not warn."""
  q = jax.ShapeDtypeStruct((1, 32, 2, 16), jnp.float32)
  kv = jax.ShapeDtypeStruct((1, 32, 1, 16), jnp.float32)
  gate = jax.ShapeDtypeStruct((1, 1), jnp.float32)
  keep = jax.ShapeDtypeStruct((1, 1, 2, 2), jnp.bool_)
  st = Streaming(1, 1, 16)
  trace = lambda fn, *a: str(jax.make_jaxpr(fn)(*a))
  xa_call = lambda fn: lambda q, k, v, g, keep: fn(q, k, v, g, keep, st, "fa-xa", 16, False)
  new_call = r"use pallas_gpu\.make_hybrid\(\.\.\., "
  with pytest.warns(DeprecationWarning, match=new_call + r"xa=True\)"):
    old = pallas_gpu.make_xa_hybrid(**SMALL)
  assert trace(xa_call(old), q, kv, kv, gate, keep) == trace(
      xa_call(make_hybrid(**SMALL, xa=True)), q, kv, kv, gate, keep)
  for name, new in (("make_packed_hybrid", r"packed=True\)"),
                    ("make_packed_xa_hybrid", r"packed=True, xa=True\)")):
    with pytest.warns(DeprecationWarning, match=rf"{name}.*{new_call}{new}"):
      getattr(pallas_gpu, name)()
  with pytest.warns(DeprecationWarning, match=r"tiles=Tiles\(block_q=32, block_k=16"):
    old = trace(lambda q, k, v, g: pallas_gpu.hybrid_forward(q, k, v, g, st, block_q=32,
                                                             block_k=16), q, kv, kv, gate)
  assert old == trace(lambda q, k, v, g: pallas_gpu.hybrid_forward(
      q, k, v, g, st, tiles=Tiles(32, 16)), q, kv, kv, gate)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for parts in (pallas_gpu.hybrid_parts(), pallas_gpu.xa_parts(), pallas_gpu.packed_parts(),
                  pallas_gpu.packed_parts(xa=True)):
      assert len(parts) == 3
