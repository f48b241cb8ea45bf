"""The memory-safe reference attention against a dense softmax written here, independently."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elastic_jax.attention import reference

# Compiled once per shape; run op by op the scan-of-conds costs seconds per call on CPU.
causal_attention = jax.jit(reference.causal_attention, static_argnames=("q_chunk", "kv_chunk"))
dense_causal_attention = jax.jit(reference.dense_causal_attention)


def numpy_attention(q, k, v, seg):
  """Per-head loops in float64 NumPy: the independent oracle."""
  b, t, n, h = q.shape
  g = n // k.shape[2]
  out = np.zeros((b, t, n, h))
  for bi in range(b):
    for ni in range(n):
      s = q[bi, :, ni].astype(np.float64) @ k[bi, :, ni // g].astype(np.float64).T / np.sqrt(h)
      ok = np.tril(np.ones((t, t), bool)) & (seg[bi][:, None] == seg[bi][None, :])
      s = np.where(ok, s, -np.inf)
      p = np.exp(s - s.max(-1, keepdims=True))
      p /= p.sum(-1, keepdims=True)
      out[bi, :, ni] = p @ v[bi, :, ni // g]
  return out


def _inputs(b, t, n, k, h, seed=0, dtype=jnp.float32):
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (b, t, n, h), dtype)
  kk = jax.random.normal(keys[1], (b, t, k, h), dtype)
  v = jax.random.normal(keys[2], (b, t, k, h), dtype)
  return q, kk, v


# T crossing chunk edges (ragged last chunk, one chunk, chunk larger than T) and GQA 1/2/4.
@pytest.mark.parametrize("t,q_chunk,kv_chunk,n,k", [
    (1, 4, 4, 4, 4), (13, 4, 8, 4, 2), (33, 8, 4, 4, 1), (40, 16, 16, 4, 2), (21, 64, 64, 8, 2)])
def test_matches_numpy_oracle(t, q_chunk, kv_chunk, n, k):
  q, kk, v = _inputs(2, t, n, k, 8)
  seg = np.zeros((2, t), np.int32)
  seg[1, t // 2:] = 1  # second row packs two segments
  got = causal_attention(q, kk, v, jnp.asarray(seg), q_chunk=q_chunk, kv_chunk=kv_chunk)
  want = numpy_attention(*(np.asarray(x) for x in (q, kk, v)), seg)
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(dense_causal_attention(q, kk, v, jnp.asarray(seg))),
                             want, atol=2e-5, rtol=1e-5)


def test_gradients_match_dense():
  q, kk, v = _inputs(1, 29, 4, 2, 8, seed=1)
  seg = jnp.asarray(np.repeat([[0, 1]], [17, 12], axis=1).astype(np.int32))
  cot = jax.random.normal(jax.random.key(9), q.shape)

  def loss(fn, *args):
    return jnp.sum(fn(*args, seg) * cot)

  chunked = lambda q, k, v, s: reference.causal_attention(q, k, v, s, q_chunk=8, kv_chunk=4)
  g_got = jax.jit(jax.grad(lambda *a: loss(chunked, *a), argnums=(0, 1, 2)))(q, kk, v)
  g_want = jax.jit(jax.grad(lambda *a: loss(reference.dense_causal_attention, *a),
                            argnums=(0, 1, 2)))(q, kk, v)
  for a, b in zip(g_got, g_want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=5e-5, rtol=1e-4)


def test_bfloat16_close_to_float32_oracle():
  q, kk, v = _inputs(1, 50, 4, 2, 16, seed=2, dtype=jnp.bfloat16)
  got = causal_attention(q, kk, v, q_chunk=16, kv_chunk=16)
  assert got.dtype == jnp.bfloat16
  want = numpy_attention(*(np.asarray(x.astype(jnp.float32)) for x in (q, kk, v)),
                         np.zeros((1, 50), np.int32))
  assert np.abs(np.asarray(got.astype(jnp.float32)) - want).max() < 3e-2


def test_long_sequence_memory_is_bounded():
  """At T = 32K the compiled program holds no [T, T] score matrix for a head."""
  t, h = 32768, 64
  q = jax.ShapeDtypeStruct((1, t, 2, h), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, t, 1, h), jnp.bfloat16)
  fn = jax.jit(lambda q, k, v: reference.causal_attention(q, k, v))
  temp = fn.lower(q, kv, kv).compile().memory_analysis().temp_size_in_bytes
  one_score_matrix = t * t * 4
  assert temp < one_score_matrix / 16, temp
