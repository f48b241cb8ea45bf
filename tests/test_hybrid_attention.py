"""Hybrid FA/SSA attention against a dense masked softmax written here, independently."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elastic_jax import hybrid_attention
from elastic_jax.attention import Streaming
from elastic_jax.attention.reference import hybrid_attention as reference_hybrid


@pytest.fixture(autouse=True)
def _float32_matmuls():
  """These tests check the algorithm in float32 against float64; a GPU's default precision
  (TF32 products, ~1e-3) would be the hardware's rounding, not the algorithm's."""
  with jax.default_matmul_precision("highest"):
    yield


def ssa_mask(t, sink, local, block, positions=None):
  """The docs/method.md §3 mask, token by token with Python loops."""
  pos = np.arange(t) if positions is None else positions
  ok = np.zeros((t, t), bool)
  for qi in range(t):
    for ki in range(qi + 1):
      qb, kb = pos[qi] // block, pos[ki] // block
      ok[qi, ki] = kb < sink or qb - kb < local
  return ok


def dense_hybrid(q, k, v, gate_bk, sink, local, block):
  """float64 NumPy: softmax under the causal mask and under the SSA mask, mixed per KV head."""
  q, k, v, gate_bk = (np.asarray(x, np.float64) for x in (q, k, v, gate_bk))
  b, t, n, h = q.shape
  g = n // k.shape[2]
  masks = {"fa": np.tril(np.ones((t, t), bool)), "sa": ssa_mask(t, sink, local, block)}
  out = np.zeros(q.shape)
  for bi in range(b):
    for ni in range(n):
      s = q[bi, :, ni] @ k[bi, :, ni // g].T / np.sqrt(h)
      o = {}
      for name, m in masks.items():
        e = np.exp(np.where(m, s, -np.inf) - np.where(m, s, -np.inf).max(-1, keepdims=True))
        o[name] = (e / e.sum(-1, keepdims=True)) @ v[bi, :, ni // g]
      r = gate_bk[bi, ni // g]
      out[bi, :, ni] = r * o["fa"] + (1 - r) * o["sa"]
  return out


def _qkv(b, t, n, k, h, seed=0, dtype=jnp.float32):
  keys = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(keys[0], (b, t, n, h), dtype),
          jax.random.normal(keys[1], (b, t, k, h), dtype),
          jax.random.normal(keys[2], (b, t, k, h), dtype))


@functools.partial(jax.jit, static_argnames=("sink", "local", "block", "chunk"))
def _ours(q, k, v, gate, sink, local, block, chunk):
  return hybrid_attention(q, k, v, gate, sink_blocks=sink, local_blocks=local, block=block,
                              q_chunk=chunk, kv_chunk=chunk)


def test_ssa_mask_matches_spec_formula():
  t, sink, local, block = 70, 1, 3, 8
  qp, kp = np.arange(t)[:, None], np.arange(t)[None]
  spec = (kp <= qp) & ((kp // block < sink) | (qp // block - kp // block < local))
  np.testing.assert_array_equal(ssa_mask(t, sink, local, block), spec)
  assert not spec.all() and spec[t - 1, 0] and not spec[t - 1, 20]


# T not a multiple of the block, one block, several; GQA 1/2/4; several sink/local.
@pytest.mark.parametrize("t,n,k,sink,local,block,chunk", [
    (7, 4, 4, 1, 2, 8, 4), (45, 4, 2, 1, 2, 8, 16), (61, 4, 1, 2, 3, 4, 8),
    (100, 8, 2, 1, 4, 16, 32)])
def test_forward_matches_dense(t, n, k, sink, local, block, chunk):
  q, kk, v = _qkv(2, t, n, k, 8)
  gate = jnp.asarray(np.array([[1.0, 0.0, 0.3, 0.7][:k], [0.0, 1.0, 0.5, 0.0][:k]]))
  got = _ours(q, kk, v, gate, sink, local, block, chunk)
  want = dense_hybrid(q, kk, v, gate, sink, local, block)
  np.testing.assert_allclose(np.asarray(got), want, atol=3e-5, rtol=1e-5)


def test_gate_one_is_full_and_gate_zero_is_streaming():
  q, kk, v = _qkv(1, 40, 4, 2, 8, seed=3)
  full = _ours(q, kk, v, jnp.ones((1, 2)), 1, 2, 8, 16)
  stream = _ours(q, kk, v, jnp.zeros((1, 2)), 1, 2, 8, 16)
  np.testing.assert_allclose(np.asarray(full), dense_hybrid(q, kk, v, np.ones((1, 2)), 1, 2, 8),
                             atol=3e-5)
  # Early rows see everything under both masks; late rows differ.
  np.testing.assert_allclose(np.asarray(full[:, :24]), np.asarray(stream[:, :24]), atol=1e-6)
  assert np.abs(np.asarray(full[:, 30:] - stream[:, 30:])).max() > 1e-2


def test_gradients_match_dense_autodiff():
  """Gradients in q, k, v and the gate against autodiff of a dense masked implementation."""
  t, sink, local, block = 37, 1, 2, 8
  q, kk, v = _qkv(1, t, 4, 2, 8, seed=5)
  gate = jnp.asarray([[0.3, 0.8]])
  cot = jax.random.normal(jax.random.key(7), q.shape)
  fa = jnp.asarray(np.tril(np.ones((t, t), bool)))
  sa = jnp.asarray(ssa_mask(t, sink, local, block))

  def dense(q, k, v, gate):
    kr, vr = jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2)
    s = jnp.einsum("bqnh,bsnh->bnqs", q, kr) / np.sqrt(8)
    o = [jnp.einsum("bnqs,bsnh->bqnh", jax.nn.softmax(jnp.where(m, s, -1e30), -1), vr)
         for m in (fa, sa)]
    r = jnp.repeat(gate, 2, axis=1)[:, None, :, None]
    return r * o[0] + (1 - r) * o[1]

  ours = lambda q, k, v, g: reference_hybrid(q, k, v, jnp.broadcast_to(g[:, None], (1, t, 2)),
                                             Streaming(sink, local, block), q_chunk=8,
                                             kv_chunk=16)
  g_ours = jax.jit(jax.grad(lambda *a: jnp.sum(ours(*a) * cot), argnums=(0, 1, 2, 3)))(
      q, kk, v, gate)
  g_dense = jax.jit(jax.grad(lambda *a: jnp.sum(dense(*a) * cot), argnums=(0, 1, 2, 3)))(
      q, kk, v, gate)
  for a, b in zip(g_ours, g_dense):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-4)
  assert np.abs(np.asarray(g_ours[3])).min() > 0  # the gate really gets a gradient


def test_packed_segments_route_and_block_independently():
  """Two packed segments with different gates equal the two sequences run on their own."""
  q, kk, v = _qkv(1, 50, 4, 2, 8, seed=11)
  seg = jnp.asarray(np.repeat([[1, 2]], [30, 20], axis=1).astype(np.int32))
  pos = jnp.asarray(np.concatenate([np.arange(30), np.arange(20)])[None].astype(np.int32))
  g1, g2 = np.array([1.0, 0.0]), np.array([0.0, 0.4])
  gate_btk = jnp.asarray(np.concatenate([np.tile(g1, (30, 1)), np.tile(g2, (20, 1))])[None])
  got = np.asarray(reference_hybrid(q, kk, v, gate_btk, Streaming(1, 1, 8), seg, pos,
                                    q_chunk=16, kv_chunk=16))
  a = dense_hybrid(q[:, :30], kk[:, :30], v[:, :30], g1[None], 1, 1, 8)
  b = dense_hybrid(q[:, 30:], kk[:, 30:], v[:, 30:], g2[None], 1, 1, 8)
  np.testing.assert_allclose(got, np.concatenate([a, b], axis=1), atol=3e-5)


def test_bad_gate_shape_is_refused():
  q, kk, v = _qkv(1, 8, 4, 2, 8)
  with pytest.raises(ValueError, match="gate has shape"):
    hybrid_attention(q, kk, v, jnp.ones((1, 3)))


def test_memory_at_16k_is_bounded():
  """At T = 16K neither the forward nor the backward pass holds a [T, T] matrix for a head."""
  t = 16384
  q = jax.ShapeDtypeStruct((1, t, 4, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, t, 2, 64), jnp.bfloat16)
  g = jax.ShapeDtypeStruct((1, 2), jnp.float32)
  one_head_scores = t * t * 4

  def out(q, k, v, gate):
    return hybrid_attention(q, k, v, gate).astype(jnp.float32).sum()

  def temp_bytes(fn):
    return jax.jit(fn).lower(q, kv, kv, g).compile().memory_analysis().temp_size_in_bytes

  assert temp_bytes(out) < one_head_scores / 8
  assert temp_bytes(jax.grad(out, argnums=(0, 1, 2, 3))) < one_head_scores / 2
