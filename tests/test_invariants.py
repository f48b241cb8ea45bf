"""Boundary invariants pinned against independent NumPy transcriptions (float64).

Each test targets a place where an off-by-one or a swapped operator would keep routing
decisions, shapes and training thresholds plausible while computing the wrong thing:
  * boundary pooling and router logits, for prompts shorter than, equal to and longer than
    the boundary, on unpadded, right- and left-padded and packed rows (docs/method.md §4);
  * the Gumbel relaxation's temperature: soft gate and its gradient at tau != 1;
  * the context limit: a request that exactly fills max_length is accepted, one token more
    is refused (generation, `logits`, and the per-head cache's capacity);
  * the MSR's axes, the ESR's pattern pair, the sigmoid router's head norm, top-p sampling,
    the SSA block rule and the decode cache's capacity buckets.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import elastic_jax.elastic_model as elastic_model
from elastic_jax.attention import Streaming
from elastic_jax.config import config_from_hf_dict
from elastic_jax.elastic_model import ElasticModel
from elastic_jax.errors import ElasticJaxError
from elastic_jax.generation.generate import SamplingConfig, _sample, capacity_bucket, generate
from elastic_jax.generation import kv_cache
from elastic_jax.model import abstract_params, forward_routed_jit
from elastic_jax.router import (RouterConfig, esr, gate_from_logits, init_router_params, msr,
                                streaming_kept_fraction)

BOUNDARY = 4
RCFG = RouterConfig(block=4, sink_blocks=1, local_blocks=2, boundary=BOUNDARY)
HF = dict(model_type="qwen3", vocab_size=61, hidden_size=32, intermediate_size=48,
          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
          rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=24)
T = 12                       # tokens per row in the pooling tests


# ----------------------------------------------------------------------------------------------
# Helpers: a tiny float32 model with non-trivial norms and routers, and the NumPy oracles.


@pytest.fixture(scope="module")
def model():
  """float32 parameters drawn in NumPy on the model's parameter shapes (no compiled init):
  N(0, 0.02) backbone weights, norm scales in [0.5, 1.5] (so that a missing or misplaced
  scale shows), and routers with weights large enough and non-zero biases, so that every
  term moves the logits."""
  cfg = config_from_hf_dict(HF)
  rng = np.random.default_rng(7)
  shapes, _ = abstract_params(cfg, "float32")
  draw = lambda path, x: jnp.asarray(
      rng.uniform(0.5, 1.5, x.shape) if "scale" in jax.tree_util.keystr(path)
      else rng.normal(0.0, 0.02, x.shape), jnp.float32)
  params = jax.tree_util.tree_map_with_path(draw, shapes)
  router = jax.eval_shape(lambda: init_router_params(cfg, RCFG, jax.random.key(0)))
  router = {name: jnp.asarray(rng.normal(0.0, 0.3 if "_w" in name else 0.2, v.shape),
                              jnp.float32) for name, v in router.items()}
  return ElasticModel(cfg, params, dict(HF), router_params=router, router_config=RCFG)


def _silu(x):
  return x / (1.0 + np.exp(-x))


def _np_router_logits(p, x):
  """docs/method.md §4: task MLP Linear-SiLU-Linear, router MLP Linear-SiLU-Linear-SiLU-Linear."""
  x = _silu(x @ p["task_w1"] + p["task_b1"]) @ p["task_w2"] + p["task_b2"]
  x = _silu(x @ p["route_w1"] + p["route_b1"])
  x = _silu(x @ p["route_w2"] + p["route_b2"])
  return x @ p["route_w3"] + p["route_b3"]


def _np_boundary_pool(k_tkh, seg_t, prompt_t, slots, boundary):
  """Per segment slot: the mean of the concatenation of its first `boundary` and its last
  `boundary` prompt tokens (a prompt shorter than 2 x boundary counts its overlap twice);
  0 for a slot without prompt. [slots, K, H]."""
  out = np.zeros((slots,) + k_tkh.shape[1:])
  for s in range(slots):
    idx = [i for i in range(len(seg_t)) if seg_t[i] == s and prompt_t[i]]
    if idx:
      rows = idx[:boundary] + idx[-boundary:]
      out[s] = k_tkh[rows].mean(0)
  return out


def _np_unrope(k_tkh, pos_t, theta, h):
  """Undoes rotate-half RoPE (the HF layout) at positions pos_t: keys before RoPE."""
  inv = 1.0 / theta ** (np.arange(0, h, 2) / h)
  ang = pos_t[:, None] * inv[None]
  cos = np.cos(np.concatenate([ang, ang], -1))[:, None]
  sin = np.sin(np.concatenate([ang, ang], -1))[:, None]
  rot = np.concatenate([-k_tkh[..., h // 2:], k_tkh[..., :h // 2]], -1)
  return k_tkh * cos - rot * sin


def _np_layer0_keys(params, cfg, ids_t):
  """Layer 0's keys after the k-norm and before RoPE, from the embedding alone."""
  f = lambda x: np.asarray(x, np.float64)
  rms = lambda x, w: x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.rms_norm_eps) * w
  x = f(params["embed"])[ids_t]
  x = rms(x, f(params["layers"]["attn_norm"]["scale"][0]))
  k = np.einsum("te,ekh->tkh", x, f(params["layers"]["attn"]["k_kernel"][0]))
  return rms(k, f(params["layers"]["attn"]["k_norm"]["scale"][0]))


def _check_pooling(model, stats, ids, seg, pos, prompt, slots, noiseless=True):
  """The library's pooled keys and router logits, every layer, row and slot, against the
  NumPy pooling of its own pre-RoPE keys (recovered from the post-RoPE keys it returns;
  layer 0's are also rebuilt from the embedding) and the NumPy router MLPs."""
  cfg = model.config
  k_all = np.asarray(stats["k"], np.float64)                # [L, B, T, K, H] after RoPE
  pooled, logits = np.asarray(stats["pooled"]), np.asarray(stats["logits"])
  assert pooled.shape == (cfg.num_layers, ids.shape[0], slots, cfg.num_kv_heads, cfg.head_dim)
  for layer in range(cfg.num_layers):
    p = {n: np.asarray(v[layer], np.float64) for n, v in model.router_params.items()}
    for b in range(ids.shape[0]):
      keys = _np_unrope(k_all[layer, b], pos[b].astype(np.float64), cfg.rope_theta,
                        cfg.head_dim)
      if layer == 0:
        real = seg[b] > 0
        np.testing.assert_allclose(keys[real], _np_layer0_keys(model.params, cfg, ids[b])[real],
                                   rtol=1e-5, atol=1e-5)
      want = _np_boundary_pool(keys, seg[b], prompt[b], slots, BOUNDARY)
      np.testing.assert_allclose(pooled[layer, b], want, rtol=1e-5, atol=1e-5,
                                 err_msg=f"pooled keys, layer {layer}, row {b}")
      np.testing.assert_allclose(logits[layer, b], _np_router_logits(p, want), rtol=1e-5,
                                 atol=1e-5, err_msg=f"router logits, layer {layer}, row {b}")
  if noiseless:   # inference decisions: the argmax of those logits (index 1 = full attention)
    np.testing.assert_array_equal(np.asarray(stats["gate"]), logits[..., 1] > logits[..., 0])


def _capture(monkeypatch):
  """Runs ElasticModel.logits' routed forward with return_kv and records its stats."""
  seen = {}
  original = elastic_model.forward_routed_jit

  def spy(*args, **kwargs):
    logits, stats = original(*args, **dict(kwargs, return_kv=True))
    seen.update(stats=stats, packed=kwargs["packed"])
    return logits, stats

  monkeypatch.setattr(elastic_model, "forward_routed_jit", spy)
  return seen


# ----------------------------------------------------------------------------------------------
# 1. Boundary pooling and router logits


def test_boundary_pooling_and_logits_on_unpadded_rows(model, monkeypatch):
  """One input per row, no padding: the prefix path (`pool_prompt_prefix`). Prompts of 1, 3
  (< boundary), 4 (= boundary), 6 (between 1 and 2 boundaries), 8 (= 2 boundaries), 11 and
  the whole row: the tokens after each prompt (the answer) must stay out of the pooling."""
  seen = _capture(monkeypatch)
  plen = np.asarray([1, 3, 4, 6, 8, 11, T])
  ids = np.random.default_rng(0).integers(0, HF["vocab_size"], (len(plen), T))
  _, report = model.logits(ids, attention="elastic", prompt_lengths=plen, return_routing=True)
  assert seen["packed"] is False                           # the boundary-gather path
  seg = np.ones_like(ids)
  pos = np.broadcast_to(np.arange(T), ids.shape)
  prompt = pos < plen[:, None]
  _check_pooling(model, seen["stats"], ids, seg, pos, prompt, 2)
  np.testing.assert_array_equal(np.asarray(report["gates"]),
                                np.asarray(seen["stats"]["gate"])[:, :, 1])


def test_boundary_pooling_and_logits_on_padded_rows(model, monkeypatch):
  """Right- and left-padded rows in one batch (`pool_prompt` over positions counted from each
  row's first real token), prompts shorter than, equal to and longer than the boundary."""
  seen = _capture(monkeypatch)
  # (real tokens, prompt tokens, padding side)
  rows = [(9, 3, "right"), (12, 4, "right"), (7, 6, "left"), (10, 2, "left"), (11, 9, "right"),
          (8, 8, "left"), (5, 1, "right")]
  ids = np.random.default_rng(1).integers(0, HF["vocab_size"], (len(rows), T))
  mask = np.zeros_like(ids)
  for b, (n, _, side) in enumerate(rows):
    if side == "right":
      mask[b, :n] = 1
    else:
      mask[b, T - n:] = 1
  plen = np.asarray([r[1] for r in rows])
  _, report = model.logits(ids, attention="elastic", attention_mask=mask, prompt_lengths=plen,
                           return_routing=True)
  assert seen["packed"] is True
  pos = np.maximum(np.cumsum(mask, 1) - 1, 0)             # counted from the first real token
  prompt = (mask > 0) & (pos < plen[:, None])
  _check_pooling(model, seen["stats"], ids, mask, pos, prompt, 2)
  np.testing.assert_array_equal(np.asarray(report["gates"]),
                                np.asarray(seen["stats"]["gate"])[:, :, 1])


PACKED_KEY = jax.random.key(21)


@pytest.fixture(scope="module")
def packed_runs(model):
  """Rows packing several inputs each (segment ids 1..3, positions restarting at 0, padding
  segment 0), through the routed forward in training mode (Gumbel noise from PACKED_KEY) at
  tau 0.5 and 3.0: {tau: stats}, and the inputs. Prompts of 2, 3 (< boundary), 4, 5 (the
  whole segment), 6, 7 and 9 tokens."""
  layout = [[(3, 2), (5, 4), (9, 7)], [(5, 5), (6, 6), (7, 3)], [(11, 9)]]  # (length, prompt)
  b, t = len(layout), 20
  ids = np.random.default_rng(2).integers(0, HF["vocab_size"], (b, t))
  seg, pos = np.zeros((b, t), np.int32), np.zeros((b, t), np.int32)
  prompt = np.zeros((b, t), bool)
  for r, segments in enumerate(layout):
    at = 0
    for s, (n, plen) in enumerate(segments, start=1):
      seg[r, at:at + n], pos[r, at:at + n] = s, np.arange(n)
      prompt[r, at:at + plen] = True
      at += n
  runs = {tau: forward_routed_jit(
      model.params, jnp.asarray(ids, jnp.int32), jnp.asarray(pos), jnp.asarray(seg),
      jnp.asarray(prompt), cfg=model.config, rcfg=RCFG, attention="elastic",
      router_params=model.router_params, packed=True, num_segments=4, key=PACKED_KEY,
      tau=tau, return_kv=True)[1] for tau in (0.5, 3.0)}
  return runs, (ids, seg, pos, prompt)


def test_boundary_pooling_and_logits_on_packed_rows(model, packed_runs):
  """Each packed input pooled over its own prompt into its own slot (slots without one pool
  to 0). Training mode: the noise changes the gates, hence the deeper layers' keys, but each
  layer's pooling of its own keys and its logits stay the transcription's."""
  runs, (ids, seg, pos, prompt) = packed_runs
  for stats in runs.values():
    _check_pooling(model, stats, ids, seg, pos, prompt, 4, noiseless=False)
    assert np.all(np.asarray(stats["pooled"])[:, 2, 2:] == 0)   # row 2: one segment


# ----------------------------------------------------------------------------------------------
# 2. The relaxation temperature


def _np_gumbel(key, shape):
  u = np.asarray(jax.random.uniform(key, shape, jnp.float32), np.float64)
  return -np.log(-np.log(u + 1e-10) + 1e-10)


def _sig(x):
  return 1.0 / (1.0 + np.exp(-x))


@pytest.mark.parametrize("tau", [0.5, 3.0])
def test_softmax_gate_value_and_gradient_at_temperature(tau):
  """soft = softmax((z + g) / tau)[1] = sigmoid((z1 + g1 - z0 - g0) / tau), with the noise g
  drawn as `gumbel(key)` does; d soft / d z1 = -d soft / d z0 = soft (1 - soft) / tau. The
  straight-through gate has the hard value and the soft gradient."""
  rng = np.random.default_rng(3)
  z = rng.normal(0.0, 1.5, (2, 3, 4, 2)).astype(np.float32)
  w = rng.normal(size=(2, 3, 4))
  key = jax.random.key(11)
  g = _np_gumbel(key, z.shape)
  d = (z[..., 1] + g[..., 1]) - (z[..., 0] + g[..., 0])
  soft = _sig(d / tau)
  gate, got_soft, grads, plain = _softmax_gate(jnp.asarray(z), jnp.asarray(w, jnp.float32),
                                               key, tau)
  np.testing.assert_allclose(np.asarray(got_soft), soft, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(gate), (d > 0).astype(np.float32))
  want = np.stack([-w * soft * (1 - soft) / tau, w * soft * (1 - soft) / tau], -1)
  for grad in grads:     # of the straight-through gate and of the soft gate
    np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-4, atol=1e-6)
  # Inference (no key): no noise and no temperature, the plain probability.
  np.testing.assert_allclose(np.asarray(plain), _sig(z[..., 1] - z[..., 0]), rtol=1e-5,
                             atol=1e-6)


@jax.jit
def _softmax_gate(z, w, key, tau):
  gate, soft = gate_from_logits(z, RCFG, key=key, tau=tau)
  grads = [jax.grad(lambda z: jnp.sum(w * gate_from_logits(z, RCFG, key=key, tau=tau)[i]))(z)
           for i in (0, 1)]
  return gate, soft, grads, gate_from_logits(z, RCFG, tau=tau)[1]


@pytest.mark.parametrize("tau,head_norm", [(0.5, False), (3.0, True)])
def test_sigmoid_gate_value_and_gradient_at_temperature(tau, head_norm):
  """One logit: soft = sigmoid((y + g) / tau) where y is z, or z layer-normalised across the
  KV heads (no affine, eps 1e-5) under head_norm; the gradient through the normalisation's
  Jacobian (I - 1/K - y y^T / K) / sqrt(var + eps)."""
  rcfg = RouterConfig(relaxation="sigmoid", head_norm=head_norm)
  rng = np.random.default_rng(4)
  z = rng.normal(0.0, 1.5, (2, 3, 5, 1)).astype(np.float32)
  w = rng.normal(size=(2, 3, 5))
  key = jax.random.key(12)
  x = z[..., 0].astype(np.float64)
  y, jac = x, None
  if head_norm:
    k = x.shape[-1]
    sd = np.sqrt(x.var(-1, keepdims=True) + 1e-5)
    y = (x - x.mean(-1, keepdims=True)) / sd
    jac = (np.eye(k) - 1.0 / k - y[..., :, None] * y[..., None, :] / k) / sd[..., None]
  g = _np_gumbel(key, x.shape)
  soft = _sig((y + g) / tau)
  gate, got_soft = gate_from_logits(jnp.asarray(z), rcfg, key=key, tau=tau)
  np.testing.assert_allclose(np.asarray(got_soft), soft, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(gate), (soft > 0.5).astype(np.float32))
  dy = w * soft * (1 - soft) / tau
  want = dy if jac is None else np.einsum("...i,...ij->...j", dy, jac)
  grad = jax.grad(lambda z: jnp.sum(jnp.asarray(w, jnp.float32)
                                    * gate_from_logits(z, rcfg, key=key, tau=tau)[0]))(
      jnp.asarray(z))
  np.testing.assert_allclose(np.asarray(grad)[..., 0], want, rtol=1e-4, atol=1e-6)
  # Inference: the (normalised) logit's sign decides.
  hard, _ = gate_from_logits(jnp.asarray(z), rcfg)
  np.testing.assert_array_equal(np.asarray(hard), (y > 0).astype(np.float32))


def test_routed_forward_applies_the_temperature_per_layer(model, packed_runs):
  """Through the model (training mode): each layer draws its noise from its own split of the
  key, and the soft gates it reports are sigmoid((z1 + g1 - z0 - g0) / tau) of its logits;
  the gates are the hard decisions of the noisy logits."""
  runs, _ = packed_runs
  keys = jax.random.split(PACKED_KEY, model.config.num_layers)
  for tau, stats in runs.items():
    z = np.asarray(stats["logits"], np.float64)                     # [L, B, S, K, 2]
    for layer in range(model.config.num_layers):
      g = _np_gumbel(keys[layer], z.shape[1:])
      d = z[layer, ..., 1] + g[..., 1] - z[layer, ..., 0] - g[..., 0]
      np.testing.assert_allclose(np.asarray(stats["soft_gate"][layer]), _sig(d / tau),
                                 rtol=1e-5, atol=1e-6)
      np.testing.assert_array_equal(np.asarray(stats["gate"][layer]), d > 0)


# ----------------------------------------------------------------------------------------------
# 3. A request that exactly fills the context


def test_generation_accepts_a_request_that_exactly_fills_the_context(model):
  """prompt + max_new_tokens == max_length is a valid request: it generates all its tokens
  (the last one at position max_length - 1). One token more, by the prompt or the limit, or
  in one request of a batch, is refused before anything runs."""
  cfg = model.config
  limit = cfg.max_length
  assert limit == HF["max_position_embeddings"]
  prompt = [int(x) for x in np.random.default_rng(6).integers(0, HF["vocab_size"], limit - 4)]
  prompts = [prompt, prompt[:5]]                  # the first fills the context exactly
  kw = dict(attention="sparse", rcfg=RCFG, attn_impl="reference", layer_loop="scan")
  gen = generate(model.params, cfg, prompts, sampling=SamplingConfig(max_new_tokens=4), **kw)
  assert [len(t) for t in gen.tokens] == [4, 4] and gen.finish == ["length"] * 2
  # ElasticModel.generate, per-request limits (the same shapes: no new compilation).
  gen = model.generate(prompts, attention="sparse", max_new_tokens=[4, 3],
                       attn_impl="reference", layer_loop="scan")
  assert [len(t) for t in gen.tokens] == [4, 3]
  for prompts, new in (([prompt], 5), ([prompt + [1]], 4), ([prompt[:5], prompt], [4, 5]),
                       ([prompt * 2], 1)):
    with pytest.raises(ElasticJaxError, match="exceeds the model's max_position_embeddings"):
      if isinstance(new, list):
        generate(model.params, cfg, prompts, max_new_tokens=new, **kw)
      else:
        generate(model.params, cfg, prompts, sampling=SamplingConfig(max_new_tokens=new), **kw)
  with pytest.raises(ElasticJaxError, match="exceeds"):
    model.generate([prompt], attention="sparse", max_new_tokens=5)


def test_logits_accept_exactly_max_length_tokens(model):
  limit = model.config.max_length
  ids = np.random.default_rng(8).integers(0, HF["vocab_size"], limit + 1)
  assert model.logits(ids[:limit]).shape == (1, limit, HF["vocab_size"])
  with pytest.raises(ElasticJaxError, match=f"sequence of {limit + 1} tokens is longer"):
    model.logits(ids)
  with pytest.raises(ElasticJaxError, match="longer"):
    model.logits(ids, attention="elastic")


def test_cache_build_accepts_a_prompt_that_exactly_fills_its_capacity():
  """`kv_cache.build`: a request of exactly `capacity` tokens fits (every position kept by a
  full head); one token more is refused."""
  st = Streaming(1, 1, 4)
  cap = 16
  k = jnp.asarray(np.random.default_rng(9).normal(size=(1, 1, cap + 1, 2, 4)), jnp.float32)
  cache, _, _ = kv_cache.build(k[:, :, :cap], k[:, :, :cap], np.asarray([[[1.0, 0.0]]]),
                               np.asarray([cap]), cap, st)
  np.testing.assert_array_equal(np.asarray(cache.full_k[0]), np.asarray(k[0, 0, :cap, 0]))
  with pytest.raises(ValueError, match=f"capacity {cap} is below a prompt's length {cap + 1}"):
    kv_cache.build(k, k, np.asarray([[[1.0, 0.0]]]), np.asarray([cap + 1]), cap, st)


def test_capacity_bucket_is_the_smallest_multiple_of_its_step():
  """n rounded up to a multiple of max(128, 2^floor(log2 n) / 8): never below n, less than
  one step above it, and n itself when n is such a multiple."""
  for n in list(range(1, 300)) + [1023, 1024, 1025, 1151, 1152, 1153, 4096, 65535, 65536,
                                  65537, 131072]:
    step = max(128, 2 ** int(np.floor(np.log2(n))) // 8)
    want = -(-n // step) * step
    assert capacity_bucket(n) == want, n


# ----------------------------------------------------------------------------------------------
# Other places an off-by-one or a swapped operator would go unnoticed


def test_msr_is_the_mean_over_layers_and_kv_heads_per_segment():
  """gates [L, B, S, K] -> MSR [B, S]: 1 - the mean over L and K, every (row, slot) its own."""
  g = (np.random.default_rng(10).random((3, 2, 4, 5)) < 0.5).astype(np.float32)
  g[:, 1, 2] = 1.0        # one segment all full, one all sparse
  g[:, 0, 3] = 0.0
  got = np.asarray(msr(jnp.asarray(g)))
  want = np.asarray([[1 - g[:, b, s].sum() / (3 * 5) for s in range(4)] for b in range(2)])
  np.testing.assert_allclose(got, want, rtol=1e-6)
  assert got[1, 2] == 0.0 and got[0, 3] == 1.0


def _np_ssa_mask(n, st):
  q, k = np.arange(n)[:, None], np.arange(n)[None]
  ok = np.zeros((n, n), bool)
  for qi in range(n):
    for ki in range(qi + 1):
      ok[qi, ki] = (ki // st.block) < st.sink_blocks or (qi // st.block) - (ki // st.block) \
          < st.local_blocks
  return ok, q >= k


@pytest.mark.parametrize("st", [Streaming(1, 2, 4), Streaming(0, 1, 3), Streaming(2, 3, 2)])
def test_streaming_rule_and_kept_fraction_against_counting(st):
  """`Streaming.allows` against a loop over (query, key) blocks (sink blocks [0, s), the
  query's own block and the w - 1 before it), and the closed-form kept fraction against the
  count of that mask, at lengths around the sink and window edges."""
  n = 40
  ok, causal = _np_ssa_mask(n, st)
  pos = np.arange(n)
  allowed = np.asarray(st.allows(jnp.asarray(pos)[:, None], jnp.asarray(pos)[None]))
  np.testing.assert_array_equal(allowed & causal, ok)
  lengths = np.arange(1, n + 1)
  want = [ok[:m, :m].sum() / (m * (m + 1) / 2) for m in lengths]
  np.testing.assert_allclose(np.asarray(streaming_kept_fraction(jnp.asarray(lengths), st)), want,
                             rtol=1e-6)


@pytest.mark.parametrize("patterns", ["fa-ssa", "xa-ssa", "fa-xa"])
def test_esr_charges_each_head_the_pattern_of_its_gate(patterns):
  """ESR: the mean over the last layer's heads of 1 - kept/causal, a head with r = 1 running
  the pair's first pattern and r = 0 its second. Asymmetric gates, so that swapping the two
  sides of the pair changes the result."""
  st = Streaming(1, 1, 4)
  n = 24
  ok, _ = _np_ssa_mask(n, st)
  stream_pruned = 1 - ok.sum() / (n * (n + 1) / 2)
  gates = np.asarray([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]], np.float32)
  xa_kept = np.asarray([[0.9, 0.6, 0.5, 0.3], [0.8, 0.7, 0.2, 0.4]], np.float32)
  pruned = {"fa": np.zeros_like(xa_kept), "ssa": np.full_like(xa_kept, stream_pruned),
            "xa": 1 - xa_kept}
  hi, lo = patterns.split("-")
  want = (gates * pruned[hi] + (1 - gates) * pruned[lo]).mean(-1)
  got = esr(jnp.asarray(gates), jnp.asarray([n, n]), st, patterns=patterns,
            xa_kept_bsk=jnp.asarray(xa_kept) if "xa" in patterns else None)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5)
  assert abs(want[0] - want[1]) > 1e-2


def test_top_p_keeps_the_smallest_set_reaching_p():
  """Nucleus sampling: with probabilities 0.4, 0.3, 0.2, 0.1 and top_p 0.75, a token is kept
  when the mass before it is below 0.75: tokens 0, 1, 2 (0, 0.4, 0.7) but not 3 (0.9),
  drawn with probabilities 4/9, 3/9, 2/9."""
  probs = np.asarray([0.4, 0.3, 0.2, 0.1])
  logits = jnp.asarray(np.tile(np.log(probs), (6000, 1)), jnp.float32)
  toks = np.asarray(jax.jit(_sample, static_argnums=(2, 3))(logits, jax.random.key(0), 1.0,
                                                             0.75))
  assert set(np.unique(toks)) == {0, 1, 2}
  np.testing.assert_allclose([(toks == i).mean() for i in range(3)], [4 / 9, 3 / 9, 2 / 9],
                             atol=0.025)
