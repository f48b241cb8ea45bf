"""The fused hybrid GPU kernel against the reference; interpret mode on CPU, native on a GPU.

Tolerances against the float32 reference: float32 inputs max |diff| <= 2e-5 (interpret) or
2e-2 (native: Triton's float32 dot runs in tf32); bfloat16 inputs <= 3e-2.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elastic_jax import ops
from elastic_jax.attention import Streaming
from elastic_jax.attention.common import modes_from_gate, tile_ranges
from elastic_jax.attention.pallas_gpu import hybrid_forward
from elastic_jax.attention.reference import hybrid_attention as reference

INTERPRET = jax.default_backend() != "gpu"
F32_TOL = 2e-5 if INTERPRET else 2e-2


def _inputs(b, t, n, k, d, dtype, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  return tuple(jax.random.normal(kk, (b, t, h, d), jnp.float32).astype(dtype)
               for kk, h in zip(keys, (n, k, k)))


def _reference(q, k, v, gate_bk, st):
  t = q.shape[1]
  up = lambda x: x.astype(jnp.float32)
  g = jnp.broadcast_to(gate_bk[:, None], (gate_bk.shape[0], t, gate_bk.shape[1]))
  return reference(up(q), up(k), up(v), g, st, q_chunk=64, kv_chunk=64)


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


# Every mode (sparse 0, full 1, mixed) in one launch; T from one tile to ragged multi-tile;
# GQA groups 1 and 4; head_dim 64 and 128.
CASES = [
    # b, t, n, k, d, block, gates
    (1, 1, 4, 4, 64, 16, [[0.0, 1.0, 0.3, 0.0]]),
    (2, 100, 4, 1, 64, 16, [[0.0], [1.0]]),
    (1, 130, 8, 2, 128, 32, [[0.6, 0.0]]),
    (2, 77, 4, 4, 64, 16, [[1.0, 0.0, 0.25, 1.0], [0.0, 0.0, 1.0, 0.9]]),
    (1, 90, 4, 2, 64, 24, [[0.0, 0.5]]),  # SSA blocks not aligned with tiles: masked path
]


@pytest.mark.parametrize("b,t,n,k,d,block,gates", CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_forward_matches_reference(b, t, n, k, d, block, gates, dtype):
  st = Streaming(1, 2, block)
  q, kk, v = _inputs(b, t, n, k, d, dtype, seed=t)
  gate = jnp.asarray(gates, jnp.float32)
  out = hybrid_forward(q, kk, v, gate, st, block_q=16, block_k=16, interpret=INTERPRET)
  assert out.dtype == dtype and out.shape == q.shape
  want = _reference(q, kk, v, gate, st)
  tol = F32_TOL if dtype == jnp.float32 else 3e-2
  err = float(jnp.abs(out.astype(jnp.float32) - want).max())
  assert err <= tol, err


def test_op_and_gradients_through_the_kernel():
  """`ops.hybrid_attention(impl="pallas_gpu")` gives the reference's values and gradients."""
  st = dict(sink_blocks=1, local_blocks=2, block=16)
  q, kk, v = _inputs(1, 70, 4, 2, 64, jnp.float32, seed=3)
  gate = jnp.asarray([[0.0, 0.7]])
  ours = functools.partial(ops.hybrid_attention, impl="pallas_gpu", interpret=INTERPRET, **st)
  ref = functools.partial(ops.hybrid_attention, impl="reference", **st)
  np.testing.assert_allclose(np.asarray(ours(q, kk, v, gate)),
                             np.asarray(ref(q, kk, v, gate)), atol=F32_TOL)
  cot = jax.random.normal(jax.random.key(4), q.shape)
  g_ours = jax.grad(lambda *a: jnp.sum(ours(*a) * cot), argnums=(0, 1, 2, 3))(q, kk, v, gate)
  g_ref = jax.grad(lambda *a: jnp.sum(ref(*a) * cot), argnums=(0, 1, 2, 3))(q, kk, v, gate)
  for a, b in zip(g_ours, g_ref):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-4)
