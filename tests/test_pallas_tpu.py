"""The fused hybrid TPU kernel against the reference, in Pallas TPU interpret mode on CPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elastic_jax import ops
from elastic_jax.attention import Streaming
from elastic_jax.attention.common import MODE_FULL, MODE_MIX, MODE_SPARSE
from elastic_jax.attention.pallas_tpu import hybrid_forward, kv_schedule
from elastic_jax.attention.reference import hybrid_attention as reference

INTERPRET = jax.default_backend() != "tpu"


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
      fetched = [int(kv_schedule(mode, qi, j, bq, bk, st)[0]) for j in range(steps)]
      n_visit = int(kv_schedule(mode, qi, 0, bq, bk, st)[1])
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
  out = hybrid_forward(q, kk, v, gate, st, block_q=16, block_k=16, interpret=INTERPRET)
  assert out.dtype == dtype and out.shape == q.shape
  up = lambda x: x.astype(jnp.float32)
  want = reference(up(q), up(kk), up(v), jnp.broadcast_to(gate[:, None], (b, t, k)), st)
  tol = 2e-5 if dtype == jnp.float32 else 3e-2
  assert float(jnp.abs(out.astype(jnp.float32) - want).max()) <= tol


def test_op_and_gradients_through_the_kernel():
  st = dict(sink_blocks=1, local_blocks=2, block=16)
  keys = jax.random.split(jax.random.key(5), 3)
  q = jax.random.normal(keys[0], (1, 50, 4, 32))
  kk = jax.random.normal(keys[1], (1, 50, 2, 32))
  v = jax.random.normal(keys[2], (1, 50, 2, 32))
  gate = jnp.asarray([[1.0, 0.3]])
  ours = functools.partial(ops.hybrid_attention, impl="pallas_tpu", interpret=INTERPRET, **st)
  ref = functools.partial(ops.hybrid_attention, impl="reference", **st)
  np.testing.assert_allclose(np.asarray(ours(q, kk, v, gate)), np.asarray(ref(q, kk, v, gate)),
                             atol=2e-5)
  g_ours = jax.grad(lambda *a: jnp.sum(ours(*a) ** 2), argnums=(0, 1, 2, 3))(q, kk, v, gate)
  g_ref = jax.grad(lambda *a: jnp.sum(ref(*a) ** 2), argnums=(0, 1, 2, 3))(q, kk, v, gate)
  for a, b in zip(g_ours, g_ref):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-4, rtol=1e-4)


def test_auto_is_the_reference_on_cpu():
  if jax.default_backend() != "cpu":
    pytest.skip("checks the CPU choice")
  keys = jax.random.split(jax.random.key(6), 2)
  q = jax.random.normal(keys[0], (1, 40, 2, 16))
  kk = jax.random.normal(keys[1], (1, 40, 1, 16))
  gate = jnp.asarray([[0.0]])
  np.testing.assert_array_equal(
      np.asarray(ops.hybrid_attention(q, kk, kk, gate, block=8, local_blocks=2, impl="auto")),
      np.asarray(ops.hybrid_attention(q, kk, kk, gate, block=8, local_blocks=2)))
