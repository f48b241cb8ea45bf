"""Ulysses sequence parallelism (sequence_parallel.py) equals unsharded attention, alone and in the model."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elastic_jax import sharding
from elastic_jax.attention import sequence_parallel
from elastic_jax.attention import (Streaming, causal_attention, dense_causal_attention,
                                   hybrid_attention)
from elastic_jax.attention import pallas_gpu
from elastic_jax.config import config_from_hf_dict
from elastic_jax.errors import ElasticJaxError
from elastic_jax.model import abstract_params, forward, forward_routed
from elastic_jax.router import RouterConfig

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices "
                                "(XLA_FLAGS=--xla_force_host_platform_device_count=8)")

STREAM = Streaming(sink_blocks=1, local_blocks=2, block=4)
B, T, D = 2, 32, 8


def _mesh(shape):
  n = int(np.prod(list(shape.values())))
  return sharding.make_mesh(shape, jax.devices()[:n])


def _packed(b=B, t=T):
  """Packed rows (segments of 13, 11, 8 and of 20, 12 tokens): positions restart in each."""
  seg = np.zeros((b, t), np.int32)
  seg[0, 13:24], seg[0, 24:] = 1, 2
  seg[1, 20:] = 1
  pos = np.zeros((b, t), np.int32)
  for i in range(b):
    starts = np.r_[0, np.flatnonzero(np.diff(seg[i])) + 1]
    for s, e in zip(starts, np.r_[starts[1:], t]):
      pos[i, s:e] = np.arange(e - s)
  return jnp.asarray(seg), jnp.asarray(pos)


def _inputs(n, k, seed=0):
  """q, k, v, mixed gates [B, T, K] and an output cotangent (NumPy draws: no eager compiles)."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32))
  seg, _ = _packed()
  # Each (row, segment, KV head) gets 0, 1 or a fraction, shared by the segment's tokens.
  per_seg = rng.choice(np.asarray([0.0, 1.0, 0.3], np.float32), (B, 3, k))
  gate = jnp.asarray(np.take_along_axis(per_seg, np.asarray(seg)[:, :, None], axis=1))
  return (normal(B, T, n, D), normal(B, T, k, D), normal(B, T, k, D), gate,
          normal(B, T, n, D))


def dense_hybrid(q, k, v, gate_btk, streaming, segment_ids=None, positions=None):
  """The textbook [T, T] hybrid attention with segments and positions: a fast-compiling oracle
  (and a local implementation: the wrapper does not care which one runs inside)."""
  b, t, n, d = q.shape
  kh = k.shape[2]
  seg = jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_ids
  pos = jnp.broadcast_to(jnp.arange(t)[None], (b, t)) if positions is None else positions
  s = jnp.einsum("bqkgd,bskd->bkgqs", q.reshape(b, t, kh, n // kh, d), k) * d ** -0.5
  idx = jnp.arange(t)
  causal = (idx[None, :] <= idx[:, None])[None] & (seg[:, :, None] == seg[:, None, :])
  window = causal & streaming.allows(pos[:, :, None], pos[:, None, :])

  def attend(ok):
    p = jax.nn.softmax(jnp.where(ok[:, None, None], s, -1e30), axis=-1)
    return jnp.einsum("bkgqs,bskd->bqkgd", p, v)

  if gate_btk is None:
    return attend(window).reshape(b, t, n, d)
  r = gate_btk[:, :, :, None, None]
  return (r * attend(causal) + (1.0 - r) * attend(window)).reshape(b, t, n, d)


def _value_and_grads(fn, q, k, v, gate, cot):
  """fn's output and the gradients of <fn, cot> w.r.t. q, k, v and gate, jitted."""
  loss = lambda *a: jnp.sum(fn(*a) * cot)
  return jax.jit(lambda *a: (fn(*a), jax.grad(loss, argnums=(0, 1, 2, 3))(*a)))(q, k, v, gate)


def _assert_close(got, want, atol=2e-5):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=atol, rtol=atol)


def _check_hybrid(local_fn, mesh_shape, n, k, atol=2e-5):
  q, kk, v, gate, cot = _inputs(n, k)
  seg, pos = _packed()
  sp = sequence_parallel.sequence_parallel_hybrid(local_fn, _mesh(mesh_shape), head_axis="tensor")
  want = _value_and_grads(lambda *a: dense_hybrid(*a, STREAM, seg, pos), q, kk, v, gate, cot)
  got = _value_and_grads(lambda *a: sp(*a, STREAM, seg, pos), q, kk, v, gate, cot)
  assert np.abs(np.asarray(want[1][3])).max() > 1e-3  # the gate gradient is really tested
  _assert_close(got, want, atol)


@pytest.mark.parametrize("mesh_shape,n,k", [
    ({"data": 2, "sequence": 4}, 4, 1),       # MQA
    ({"sequence": 4}, 12, 3),                 # K < P, and neither K | P nor P | K
    ({"sequence": 4, "tensor": 2}, 8, 4),     # heads also split over the tensor axis
])
def test_hybrid_matches_unsharded(mesh_shape, n, k):
  _check_hybrid(dense_hybrid, mesh_shape, n, k)


def test_reference_inside_matches_unsharded():
  """The real (chunked, lax.cond-skipping) reference runs inside, gradients included; GQA 8/4
  on 4 devices: one KV head per device."""
  _check_hybrid(functools.partial(hybrid_attention, q_chunk=16, kv_chunk=16),
                {"data": 2, "sequence": 4}, 8, 4)


def test_hybrid_gate_per_row_and_none():
  """A [B, K] gate is broadcast over tokens; None (all streaming) passes through."""
  q, kk, v, _, _ = _inputs(8, 4)
  gate_bk = jnp.asarray([[0.0, 1.0, 0.5, 1.0], [1.0, 0.0, 0.0, 0.2]])
  sp = sequence_parallel.sequence_parallel_hybrid(dense_hybrid, _mesh({"sequence": 4}))
  want = dense_hybrid(q, kk, v, jnp.broadcast_to(gate_bk[:, None], (B, T, 4)), STREAM)
  got = jax.jit(lambda *a: (sp(*a, gate_bk, STREAM), sp(*a, None, STREAM)))(q, kk, v)
  _assert_close(got, (want, dense_hybrid(q, kk, v, None, STREAM)))


def test_kernel_runs_inside():
  """Any implementation runs locally: the fused GPU kernel (interpret mode) on unpacked rows.

  (Not the TPU kernel: its CPU interpreter simulates devices itself and can hang inside a
  multi-device shard_map.)"""
  q, kk, v, gate, _ = _inputs(8, 4)
  gate = jnp.broadcast_to(gate[:, :1], gate.shape)  # one gate per (row, KV head)
  kernel = functools.partial(pallas_gpu.hybrid_attention, interpret=True)
  sp = sequence_parallel.sequence_parallel_hybrid(kernel, _mesh({"data": 2, "sequence": 4}))
  got = jax.jit(sp, static_argnums=4)(q, kk, v, gate, STREAM)
  _assert_close(got, dense_hybrid(q, kk, v, gate, STREAM), atol=1e-4)


def test_causal_matches_unsharded():
  q, kk, v, _, cot = _inputs(8, 2)
  seg, _ = _packed()
  sp = sequence_parallel.sequence_parallel(dense_causal_attention, _mesh({"data": 2, "sequence": 4}))
  want = _value_and_grads(lambda q, k, v, _: dense_causal_attention(q, k, v, seg), q, kk, v,
                          None, cot)
  got = _value_and_grads(lambda q, k, v, _: sp(q, k, v, seg), q, kk, v, None, cot)
  _assert_close(got, want)


def test_indivisible_sizes_are_refused():
  mesh = _mesh({"sequence": 4})
  q, kk, v, gate, _ = _inputs(6, 2)
  sp = sequence_parallel.sequence_parallel_hybrid(hybrid_attention, mesh)
  with pytest.raises(ElasticJaxError, match="6 query heads per device do not split over the 4"):
    sp(q, kk, v, gate, STREAM)
  q, kk, v, gate, _ = _inputs(8, 4)
  with pytest.raises(ElasticJaxError, match="30 tokens do not split over the 4"):
    sp(q[:, :30], kk[:, :30], v[:, :30], gate[:, :30], STREAM)
  with pytest.raises(ElasticJaxError, match="needs a mesh"):
    sequence_parallel.sequence_parallel(causal_attention)(q, kk, v)


def test_for_context_only_wraps_under_a_sequence_mesh():
  assert sequence_parallel.for_context(causal_attention, hybrid=False) is causal_attention
  mesh = _mesh({"data": 8})
  with jax.set_mesh(mesh):
    assert sequence_parallel.for_context(causal_attention, hybrid=False) is causal_attention
  mesh = _mesh({"data": 2, "sequence": 4})
  with jax.set_mesh(mesh):
    with nn.logical_axis_rules(sharding.rules_for(mesh)):
      assert sequence_parallel.for_context(causal_attention, hybrid=False) is not causal_attention
    assert sequence_parallel.for_context(causal_attention, hybrid=False) is causal_attention  # no rules


# The model: GQA 8 query / 4 KV heads, so sequence=4 leaves one KV head per device.
CFG = config_from_hf_dict(dict(model_type="qwen3", vocab_size=64, hidden_size=32,
                               intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=8, num_key_value_heads=4, head_dim=8,
                               max_position_embeddings=128))
RCFG = RouterConfig(block=4, sink_blocks=1, local_blocks=2, boundary=4)


@pytest.fixture(scope="module")
def model_inputs():
  """Random parameters drawn in NumPy from the abstract tree (no init compile), and a batch."""
  rng = np.random.default_rng(0)
  shapes, _ = abstract_params(CFG, "float32")
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: jnp.asarray(
          (1.0 if "scale" in jax.tree_util.keystr(path) else 0.0)
          + 0.05 * rng.standard_normal(x.shape, np.float32)), shapes)
  ids = jnp.asarray(rng.integers(0, CFG.vocab_size, (B, T), np.int32))
  seg, pos = _packed()
  return params, ids, pos, seg, pos < 6


def _sharded(params, mesh):
  shapes, axes = abstract_params(CFG, "float32")
  return jax.device_put(params, sharding.param_shardings(axes, mesh, shapes))


def test_model_logits_match_unsharded(model_inputs):
  """forward_routed (forced mixed gates, packed rows) and forward under a data x sequence mesh
  give the unsharded logits."""
  params, ids, pos, seg, prompt = model_inputs
  forced = jnp.asarray(np.random.default_rng(3).choice(
      np.asarray([0.0, 1.0, 0.6], np.float32), (CFG.num_layers, B, 3, CFG.num_kv_heads)))
  routed = jax.jit(lambda p, rules: forward_routed(
      p, ids, pos, seg, prompt, cfg=CFG, rcfg=RCFG, attention="forced", forced_gates=forced,
      rules=rules)[0], static_argnums=1)
  full = lambda p, rules: forward(p, ids, pos, seg, cfg=CFG, attn_impl="dense", rules=rules)
  want = (routed(params, None), full(params, None))

  mesh = _mesh({"data": 2, "sequence": 4})
  rules = sharding.rules_for(mesh)
  sharded = _sharded(params, mesh)
  with jax.set_mesh(mesh):
    jaxpr = str(jax.make_jaxpr(routed, static_argnums=1)(sharded, rules))
    got = (routed(sharded, rules), full(sharded, rules))
  assert jaxpr.count("all_to_all") >= 2  # the attention really ran sequence parallel
  assert np.abs(np.asarray(want[0] - want[1])).max() > 1e-3  # the gates matter
  _assert_close(got, want)
