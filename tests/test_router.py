"""The Attention Router: parameters, pooling, relaxations, and the sparsity ratios."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elastic_jax.attention import Streaming
from elastic_jax.config import config_from_hf_dict
from elastic_jax.router import (RouterConfig, esr, gate_from_logits, gates_per_token,
                                init_router_params, msr, pool_prompt, pool_prompt_prefix,
                                router_logits, streaming_kept_fraction)

CFG = config_from_hf_dict(dict(model_type="llama", vocab_size=32, hidden_size=256,
                               intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                               num_key_value_heads=2))  # head_dim 128


def test_router_parameters_shapes_and_init():
  p = init_router_params(CFG, RouterConfig(), jax.random.key(0))
  assert p["task_w1"].shape == (3, 128, 512) and p["route_w3"].shape == (3, 128, 2)
  per_layer = sum(x[0].size for x in jax.tree.leaves(p))
  assert 0.25e6 < per_layer < 0.28e6  # the paper: about 0.27 M per layer at head_dim 128
  weights = np.concatenate([np.ravel(v) for k, v in p.items() if "_w" in k])
  assert abs(weights.std() - 0.02) < 1e-3 and abs(weights.mean()) < 1e-3
  assert all(np.all(v == 0) for k, v in p.items() if "_b" in k)
  z = router_logits(jax.tree.map(lambda x: x[0], p), jnp.ones((2, 4, 2, 128)))
  assert z.shape == (2, 4, 2, 2)
  sig = init_router_params(CFG, RouterConfig(relaxation="sigmoid"), jax.random.key(0))
  assert sig["route_w3"].shape == (3, 128, 1)
  # The ablation without a task MLP: the router MLP reads the pooled keys directly.
  bare = init_router_params(CFG, RouterConfig(task_mlp=False), jax.random.key(0))
  assert not any(k.startswith("task_") for k in bare)
  one = jax.tree.map(lambda x: x[0], bare)
  x = np.asarray(jax.random.normal(jax.random.key(1), (2, 4, 2, 128)))
  w = {k: np.asarray(v, np.float64) for k, v in one.items()}
  silu = lambda a: a / (1 + np.exp(-a))
  h = silu(silu(x @ w["route_w1"] + w["route_b1"]) @ w["route_w2"] + w["route_b2"])
  np.testing.assert_allclose(router_logits(one, jnp.asarray(x)), h @ w["route_w3"] + w["route_b3"],
                             rtol=1e-4, atol=1e-6)


def _numpy_pool(k, seg, pos, prompt, slots, boundary, mode):
  b, t, kh, h = k.shape
  out = np.zeros((b, slots, kh, h))
  for bi in range(b):
    for s in range(slots):
      idx = [i for i in range(t) if seg[bi, i] == s and prompt[bi, i]]
      if not idx:
        continue
      if mode == "prompt_mean":
        rows = idx
      else:  # concatenation of the first and last `boundary` prompt tokens
        rows = idx[:boundary] + idx[-boundary:]
      out[bi, s] = k[bi, rows].mean(0)
  return out


@pytest.mark.parametrize("mode", ["boundary", "prompt_mean"])
def test_pooling_per_packed_segment(mode):
  rng = np.random.default_rng(0)
  k = rng.normal(size=(2, 20, 2, 4)).astype(np.float32)
  # Row 0: segment 1 (8 tokens, prompt 6) then segment 2 (10 tokens, prompt 9), 2 pads (0).
  # Row 1: one segment of 20 tokens, prompt 15.
  seg = np.array([[1] * 8 + [2] * 10 + [0] * 2, [1] * 20])
  pos = np.array([list(range(8)) + list(range(10)) + [0, 0], list(range(20))])
  prompt = np.array([[1] * 6 + [0] * 2 + [1] * 9 + [0] + [0] * 2, [1] * 15 + [0] * 5], bool)
  rcfg = RouterConfig(pooling=mode, boundary=4)
  got = pool_prompt(jnp.asarray(k), jnp.asarray(seg), jnp.asarray(pos), jnp.asarray(prompt),
                    rcfg, 3)
  want = _numpy_pool(k, seg, pos, prompt & (seg > 0), 3, 4, mode)
  np.testing.assert_allclose(np.asarray(got)[:, 1:], want[:, 1:], atol=1e-6)


def _random_packed_rows(rng, b, t, max_segments):
  """Rows packing segments of random lengths (each prompt a prefix of its segment, some
  shorter than the boundary, some whole), then padding (segment 0)."""
  seg = np.zeros((b, t), np.int32)
  pos = np.zeros((b, t), np.int32)
  prompt = np.zeros((b, t), bool)
  for bi in range(b):
    off, s = 0, 1
    while s < max_segments and off < t:
      n = int(min(rng.integers(1, 16), t - off))
      seg[bi, off:off + n] = s
      pos[bi, off:off + n] = np.arange(n)
      prompt[bi, off:off + int(rng.integers(1, n + 1))] = True
      off, s = off + n, s + 1
  return seg, pos, prompt


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_packed_boundary_pooling_on_random_layouts(seed):
  """The gathered boundary pooling equals the numpy pooling on random packings, and its
  gradient reaches exactly the keys it averages (each with its weight)."""
  rng = np.random.default_rng(seed)
  b, t, slots, boundary = 3, 64, 7, int(rng.integers(2, 6))
  k = rng.normal(size=(b, t, 2, 4)).astype(np.float32)
  seg, pos, prompt = _random_packed_rows(rng, b, t, slots)
  rcfg = RouterConfig(boundary=boundary)
  f = jax.jit(lambda k: pool_prompt(k, jnp.asarray(seg), jnp.asarray(pos), jnp.asarray(prompt),
                                    rcfg, slots))
  want = _numpy_pool(k, seg, pos, prompt & (seg > 0), slots, boundary, "boundary")
  np.testing.assert_allclose(np.asarray(f(jnp.asarray(k)))[:, 1:], want[:, 1:], atol=1e-6)
  # d(sum of slot s's pooled keys)/dk: 1/count for each selected token (twice if in both spans).
  grad = np.asarray(jax.grad(lambda k: f(k)[:, 1:].sum())(jnp.asarray(k)))[..., 0, 0]
  expect = np.zeros((b, t))
  for bi in range(b):
    for s in range(1, slots):
      idx = [i for i in range(t) if seg[bi, i] == s and prompt[bi, i]]
      rows = idx[:boundary] + idx[-boundary:]
      for i in rows:
        expect[bi, i] += 1.0 / len(rows)
  np.testing.assert_allclose(grad, expect, atol=1e-6)


def test_prefix_pooling_reads_only_the_boundaries():
  """Unpacked rows (one input each, prompt a prefix, right padding): the boundary-only
  gather equals the numpy pooling, including prompts shorter than 2 x boundary."""
  rng = np.random.default_rng(1)
  k = rng.normal(size=(3, 24, 2, 4)).astype(np.float32)
  plen = np.array([24, 7, 13])                     # whole row; shorter than 2 x boundary; ...
  total = np.array([24, 10, 20])                   # prompt then answer, then right padding
  seg = (np.arange(24)[None] < total[:, None]).astype(np.int32)
  pos = np.broadcast_to(np.arange(24), (3, 24))
  prompt = np.arange(24)[None] < plen[:, None]
  rcfg = RouterConfig(boundary=5)
  got = pool_prompt_prefix(jnp.asarray(k), jnp.asarray(seg), jnp.asarray(prompt), rcfg, 2)
  want = _numpy_pool(k, seg, pos, prompt, 2, 5, "boundary")
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-6)


def test_straight_through_estimator():
  """Training: the value is the hard one-hot, the gradient is that of the soft gate."""
  rcfg = RouterConfig()
  z = jax.random.normal(jax.random.key(1), (3, 2, 4, 2))
  w = jax.random.normal(jax.random.key(2), (3, 2, 4))
  key = jax.random.key(3)
  hard, soft = gate_from_logits(z, rcfg, key=key, tau=1.3)
  assert set(np.unique(np.asarray(hard))) <= {0.0, 1.0}
  noisy = z + (-jnp.log(-jnp.log(jax.random.uniform(key, z.shape) + 1e-10) + 1e-10))
  np.testing.assert_array_equal(np.asarray(hard), np.asarray(noisy[..., 1] > noisy[..., 0]))
  g_ste = jax.grad(lambda z: jnp.sum(w * gate_from_logits(z, rcfg, key=key, tau=1.3)[0]))(z)
  g_soft = jax.grad(lambda z: jnp.sum(w * gate_from_logits(z, rcfg, key=key, tau=1.3)[1]))(z)
  np.testing.assert_allclose(np.asarray(g_ste), np.asarray(g_soft), atol=1e-7)
  assert np.abs(np.asarray(g_ste)).max() > 0


def test_inference_is_noiseless_argmax_and_sigmoid_option():
  z = jnp.asarray([[[[0.1, 0.3], [2.0, -1.0]]]])  # [1, 1, 2, 2]
  hard, soft = gate_from_logits(z, RouterConfig())
  np.testing.assert_array_equal(np.asarray(hard), [[[1.0, 0.0]]])
  np.testing.assert_allclose(np.asarray(soft), np.asarray(jax.nn.softmax(z, -1)[..., 1]))
  hard, soft = gate_from_logits(jnp.asarray([[[[0.4], [-0.2]]]]), RouterConfig(
      relaxation="sigmoid"))
  np.testing.assert_array_equal(np.asarray(hard), [[[1.0, 0.0]]])


def test_gates_per_token_follow_segments():
  gate_bsk = jnp.asarray([[[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]]])
  seg = jnp.asarray([[1, 1, 2, 0]])
  np.testing.assert_array_equal(np.asarray(gates_per_token(gate_bsk, seg))[0],
                                [[1, 0], [1, 0], [0, 1], [0, 0]])


def test_msr_hand_built():
  gates = np.zeros((2, 1, 1, 4))  # L=2, K=4
  gates[0, 0, 0, :3] = 1         # 3 of 8 (layer, head) pairs full
  assert float(msr(jnp.asarray(gates))[0, 0]) == pytest.approx(5 / 8)


def _kept_by_counting(n, st):
  pos = np.arange(n)
  qp, kp = pos[:, None], pos[None]
  ok = (kp <= qp) & ((kp // st.block < st.sink_blocks) |
                     (qp // st.block - kp // st.block < st.local_blocks))
  return ok.sum() / (n * (n + 1) / 2)


@pytest.mark.parametrize("st", [Streaming(1, 2, 8), Streaming(2, 3, 4), Streaming(1, 16, 128)])
def test_streaming_kept_fraction_matches_counting(st):
  lengths = np.array([1, 7, 8, 9, 23, 24, 25, 64, 100, 333, 4000])
  got = np.asarray(streaming_kept_fraction(jnp.asarray(lengths), st))
  want = [_kept_by_counting(int(n), st) for n in lengths]
  np.testing.assert_allclose(got, want, rtol=1e-5)


def test_esr_hand_built():
  st = Streaming(1, 1, 4)
  # n = 12, blocks of 4: queries 0..7 see every earlier key (36 pairs); queries 8..11 see the
  # sink block (4 keys) plus their own block up to themselves: 5 + 6 + 7 + 8 = 26. Causal: 78.
  assert _kept_by_counting(12, st) == pytest.approx(62 / 78)
  gates = jnp.asarray([[1.0, 0.0, 0.0, 1.0]])  # last layer: heads 1 and 2 sparse
  got = float(esr(gates, jnp.asarray([12]), st)[0])
  assert got == pytest.approx(0.5 * (1 - 62 / 78))
  assert float(esr(jnp.ones((1, 4)), jnp.asarray([12]), st)[0]) == 0.0
