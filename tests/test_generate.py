"""Generation with the per-head cache against recomputation without any cache.

The reference re-runs the whole routed forward pass (plain-jnp attention, the same gates) over
the prompt and the tokens generated so far, at every step: it shares no code with the cache.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elastic_jax.config import config_from_hf_dict
from elastic_jax.errors import ElasticJaxError
from elastic_jax.generation.generate import SamplingConfig, generate
from elastic_jax.generation import kv_cache
from elastic_jax.generation.kv_cache import assign_slots
from elastic_jax.model import forward_routed_jit, init_params
from elastic_jax.router import RouterConfig, init_router_params

# Small SSA blocks so that prompts of ~40 tokens already leave the local window.
RCFG = RouterConfig(block=4, sink_blocks=1, local_blocks=2, boundary=4)
CONFIGS = {
    "qwen3": dict(model_type="qwen3", vocab_size=97, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=512),
    "llama": dict(model_type="llama", vocab_size=97, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                  head_dim=8, max_position_embeddings=512, tie_word_embeddings=True),
}


REF_LEN = 64


def _model(name):
  cfg = config_from_hf_dict(CONFIGS[name])
  return cfg, init_params(cfg, jax.random.key(1), "float32")


def _reference(params, cfg, prompts, gates_lbk, steps):
  """Greedy tokens and each step's logits, recomputing the forward pass without a cache."""
  out, logits_steps = [], []
  for row, prompt in enumerate(prompts):
    seq, row_logits = list(prompt), []
    g = jnp.asarray(gates_lbk[:, row:row + 1])                       # [L, 1, K]
    forced = jnp.stack([jnp.zeros_like(g), g], axis=2)               # [L, 1, S=2, K]
    for _ in range(steps):
      # One padded shape for every call (one compilation): causal attention keeps the
      # trailing padding out of the real positions.
      ids = jnp.asarray([seq + [0] * (REF_LEN - len(seq))], jnp.int32)
      pos = jnp.arange(REF_LEN, dtype=jnp.int32)[None]
      logits, _ = forward_routed_jit(params, ids, pos, jnp.ones_like(ids), pos < len(prompt),
                                     cfg=cfg, rcfg=RCFG, attention="forced", forced_gates=forced)
      row_logits.append(np.asarray(logits[0, len(seq) - 1]))
      seq.append(int(np.argmax(row_logits[-1])))
    out.append(seq[len(prompt):])
    logits_steps.append(row_logits)
  return out, logits_steps


@pytest.mark.parametrize("name,decode_impl,layer_loop,per_sync,chunk,pack", [
    # the Pallas decode kernel; 3 device loops; the prompts packed in one row, prefilled
    # layer by layer, the MLP 16 tokens at a time, one cache per layer
    ("qwen3", "triton:interpret", "split", 4, 16, True),
    # right-padded rows, one prefill call, one pooled cache
    ("llama", "reference", "scan", 32, None, False)])
def test_forced_mixed_heads_match_recomputation(name, decode_impl, layer_loop, per_sync, chunk,
                                                pack):
  cfg, params = _model(name)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (37, 21, 5)]
  gates = rng.integers(0, 2, (cfg.num_layers, 3, cfg.num_kv_heads)).astype(np.float32)
  gates[0, 0] = [1, 0]                       # every row mixes modes somewhere
  steps = 10                                 # decoding crosses several SSA blocks
  gen = generate(params, cfg, prompts, attention="forced", rcfg=RCFG, gates=gates,
                 sampling=SamplingConfig(max_new_tokens=steps), attn_impl="reference",
                 decode_impl=decode_impl, layer_loop=layer_loop, tokens_per_sync=per_sync,
                 prefill_chunk=chunk, pack=pack)
  assert gen.info["layer_loop"] == layer_loop and gen.info["packed"] == pack
  assert gen.info["prefill"] == ("whole" if chunk is None else "by_layer")
  want, _ = _reference(params, cfg, prompts, gates, steps)
  assert gen.tokens == want
  assert gen.finish == ["length"] * 3
  np.testing.assert_allclose(gen.msr, 1 - gates.mean(axis=(0, 2)), rtol=1e-6)


def test_full_attention_equals_all_gates_full():
  """attention="full" (plain causal attention, right-padded rows) decodes like forced gates
  that send every head to full attention."""
  cfg, params = _model("llama")
  rng = np.random.default_rng(2)
  prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (33, 9)]
  kw = dict(rcfg=RCFG, sampling=SamplingConfig(max_new_tokens=6), attn_impl="reference")
  full = generate(params, cfg, prompts, attention="full", **kw)
  forced = generate(params, cfg, prompts, attention="forced",
                    gates=np.ones((cfg.num_layers, cfg.num_kv_heads), np.float32), **kw)
  assert full.tokens == forced.tokens and (full.msr == 0).all()


def test_elastic_routing_is_decided_once_and_cached():
  """The routers decide at prefill, per request; the layer-by-layer prefill (each layer's
  router reading its keys of the whole prompt before its attention) and the packed rows
  decide the same modes and give the same logits and tokens as the one-call prefill of
  padded rows, and all equal recomputation, request by request."""
  cfg, params = _model("qwen3")
  router = init_router_params(cfg, RCFG, jax.random.key(3))
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (30, 44)]
  kw = dict(attention="elastic", rcfg=RCFG, router_params=router, return_logits=True,
            sampling=SamplingConfig(max_new_tokens=10), attn_impl="reference")
  gen = generate(params, cfg, prompts, prefill_chunk=None, pack=False, **kw)
  layered = generate(params, cfg, prompts, prefill_chunk=48, layer_loop="scan", pack=True,
                     **kw)
  assert not gen.info["packed"] and layered.info["packed"]
  assert set(np.unique(gen.gates)) <= {0.0, 1.0} and 0 < gen.gates.mean() < 1
  np.testing.assert_array_equal(layered.gates, gen.gates)
  np.testing.assert_allclose(layered.logits, gen.logits, atol=1e-5)
  want, _ = _reference(params, cfg, prompts, gen.gates, 10)
  assert gen.tokens == want and layered.tokens == want


def test_cache_memory_shrinks_with_msr():
  cfg, params = _model("qwen3")
  prompt = [list(range(1, 60))]
  sizes = {}
  for label, g in (("dense", 1.0), ("half", None), ("sparse", 0.0)):
    gates = (np.full((cfg.num_layers, cfg.num_kv_heads), g, np.float32) if g is not None
             else np.tile([1.0, 0.0], (cfg.num_layers, 1)).astype(np.float32))
    gen = generate(params, cfg, prompt, attention="forced", rcfg=RCFG, gates=gates,
                   sampling=SamplingConfig(max_new_tokens=1), attn_impl="reference")
    sizes[label] = gen.cache_bytes
    dense = gen.dense_cache_bytes
  cap = gen.info["capacity"]
  # A streaming slot keeps its sink and ring, rounded up to a multiple of 16 positions.
  window = -(-RCFG.block * (RCFG.sink_blocks + RCFG.local_blocks) // 16) * 16
  per_pos = 2 * cfg.num_layers * cfg.head_dim * 4              # k and v, float32, per slot
  # Row and head per slot (int32, L * K slots in all here), each layer's first pool slot, and
  # the slot of each (row, KV head) of each layer.
  index = 3 * 4 * cfg.num_layers * cfg.num_kv_heads + 4 * cfg.num_layers
  assert sizes["dense"] == per_pos * 2 * cap + index
  assert sizes["half"] == per_pos * (cap + window) + index
  assert sizes["sparse"] == per_pos * 2 * window + index
  assert dense == per_pos * 2 * cap
  assert sizes["sparse"] < sizes["half"] < sizes["dense"]


def test_build_refuses_a_request_over_the_capacity():
  k = jnp.zeros((1, 1, 256, 2, 4))
  with pytest.raises(ValueError, match="capacity 128 is below a prompt's length 200"):
    kv_cache.build(k, k, np.ones((1, 1, 2)), np.asarray([200]), 128, RCFG.streaming)


def test_slot_tables():
  g = np.asarray([[[1, 0], [0, 0]], [[1, 1], [0, 1]]], np.float32)      # [L=2, B=2, K=2]
  s = assign_slots(g)
  assert s.full_b.tolist() == [[0, 2, 2], [0, 0, 1]]
  assert s.full_h.tolist() == [[0, 0, 0], [0, 1, 1]]
  assert s.st_b.tolist() == [[0, 1, 1], [1, 2, 2]] and s.st_h.tolist() == [[1, 0, 1], [0, 0, 0]]
  # (row, head) b * K + h -> its full slot i, or F + i for its streaming slot i (F = 3)
  assert s.slot_of.tolist() == [[0, 3, 4, 5], [0, 1, 3, 2]]
  # The pool holds the full heads layer after layer, plus spare slots so that the last
  # layer's window of F = 3 slots stays inside it.
  assert s.full_start.tolist() == [0, 1]
  assert (s.pool_l.tolist(), s.pool_b.tolist(), s.pool_h.tolist()) == (
      [0, 1, 1, 1], [0, 0, 0, 1], [0, 0, 1, 1])


def test_cache_pool_holds_only_the_full_heads():
  """Layers with different numbers of full heads: the pool has one slot per full head (plus
  the last window's spare), not layers x the widest layer, and decoding stays exact."""
  cfg, params = _model("qwen3")                                # L=3, K=2
  gates = np.asarray([[1, 1], [0, 0], [0, 1]], np.float32)     # 2, 0 and 1 full heads
  s = assign_slots(gates[:, None])
  assert s.pool_b.size == 4 and s.full_b.shape == (3, 2)      # not 3 * 2 = 6 slots
  rng = np.random.default_rng(5)
  prompts = [rng.integers(0, cfg.vocab_size, 29).tolist()]
  kw = dict(attention="forced", rcfg=RCFG, gates=gates, attn_impl="reference",
            sampling=SamplingConfig(max_new_tokens=9))
  gen = generate(params, cfg, prompts, prefill_chunk=None, **kw)
  want, _ = _reference(params, cfg, prompts, gates[:, None], 9)
  assert gen.tokens == want
  # Prefilled layer by layer, the cache is one per layer: exactly each layer's own slots
  # (3 full and 3 streaming in all, no spare), its tables (a start, row and head per slot,
  # the slot of each (row, head)), and no more.
  layered = generate(params, cfg, prompts, prefill_chunk=32, **kw)
  assert layered.tokens == want
  cap, h, n_layers = layered.info["capacity"], cfg.head_dim, cfg.num_layers
  width = -(-RCFG.block * (RCFG.sink_blocks + RCFG.local_blocks) // 16) * 16
  tables = 4 * n_layers + 2 * 4 * 6 + 4 * n_layers * cfg.num_kv_heads
  assert layered.cache_bytes == 2 * 4 * h * (3 * cap + 3 * width) + tables


class _Tok:
  """Decodes token i as the letter chr(97 + i % 26)."""
  def decode(self, ids, skip_special_tokens=False):
    return "".join(chr(97 + i % 26) for i in ids)


def test_eos_stop_strings_and_sampling():
  cfg, params = _model("llama")
  prompt = [[3, 9, 27, 4, 4, 8]]
  greedy = generate(params, cfg, prompt, attention="sparse", rcfg=RCFG,
                    sampling=SamplingConfig(max_new_tokens=8), attn_impl="reference")
  toks = greedy.tokens[0]
  eos = generate(params, cfg, prompt, attention="sparse", rcfg=RCFG, eos_ids=[toks[2]],
                 sampling=SamplingConfig(max_new_tokens=8), attn_impl="reference")
  first = toks.index(toks[2])
  assert eos.tokens[0] == toks[:first + 1] and eos.finish == ["eos"]
  stop = _Tok().decode(toks[3:5])
  got = generate(params, cfg, prompt, attention="sparse", rcfg=RCFG, tokenizer=_Tok(),
                 sampling=SamplingConfig(max_new_tokens=8, stop=(stop,)), attn_impl="reference")
  text = _Tok().decode(toks)
  assert got.finish == ["stop"] and got.texts == [text[:text.find(stop)]]
  sampled = [generate(params, cfg, prompt, attention="sparse", rcfg=RCFG,
                      sampling=SamplingConfig(max_new_tokens=8, temperature=1.0, seed=s),
                      attn_impl="reference").tokens[0] for s in (0, 0, 1)]
  assert sampled[0] == sampled[1] and sampled[0] != sampled[2]


def test_bad_requests():
  cfg, params = _model("llama")
  with pytest.raises(ElasticJaxError, match="at least one token"):
    generate(params, cfg, [[]], attention="sparse", rcfg=RCFG)
  with pytest.raises(ElasticJaxError, match="max_position_embeddings"):
    generate(params, cfg, [[1] * 500], attention="sparse", rcfg=RCFG,
             sampling=SamplingConfig(max_new_tokens=20))
  with pytest.raises(ElasticJaxError, match="needs trained routers"):
    generate(params, cfg, [[1, 2]], attention="elastic", rcfg=RCFG)
  with pytest.raises(ElasticJaxError, match="gates must be"):
    generate(params, cfg, [[1, 2]], attention="forced", rcfg=RCFG, gates=np.ones((5, 2)))
  with pytest.raises(ElasticJaxError, match="max_new_tokens"):
    dataclasses.replace(SamplingConfig(), max_new_tokens=0)


def test_batched_requests_keep_their_own_limits():
  """Requests of different lengths in one batch, each with its own new-token limit: every row
  gets the tokens it gets alone (greedy), cut at its own limit, and stops there."""
  cfg, params = _model("qwen3")
  prompts = [[5, 9, 1, 33, 2, 8, 8, 14, 3], [7, 2], [40, 41, 42, 43, 44, 45]]
  run = lambda ps, limits: generate(params, cfg, ps, attention="sparse", rcfg=RCFG,
                                    attn_impl="reference", max_new_tokens=limits)
  both = run(prompts, [6, 2, 4])
  for i, (prompt, limit) in enumerate(zip(prompts, [6, 2, 4])):
    alone = run([prompt], [6])
    assert both.tokens[i] == alone.tokens[0][:limit]
  assert both.finish == ["length"] * 3 and both.info["new_tokens"] == 12
  for bad in ([2, 0, 1], [1, 2], [1.5, 2, 2]):
    with pytest.raises(ElasticJaxError, match="one integer >= 1 per prompt"):
      run(prompts, bad)


@pytest.mark.parametrize("kwargs,words", [
    (dict(temperature=float("nan")), "temperature must be a finite number, got nan"),
    (dict(temperature=float("inf")), "temperature must be a finite number, got inf"),
    (dict(top_p=float("nan")), "top_p must be a finite number, got nan"),
    (dict(temperature=[0.5]), "temperature must be a finite number, got [0.5]"),
    (dict(top_p=0.0), "top_p in (0, 1]"),
    (dict(max_new_tokens=[3]), "max_new_tokens must be an integer >= 1, got [3]"),
    (dict(max_new_tokens=2.5), "max_new_tokens must be an integer >= 1, got 2.5"),
    (dict(seed=1.5), "seed must be an integer, got 1.5"),
    (dict(stop=("",)), "stop strings must not be empty"),
    (dict(stop=("a", "")), "stop strings must not be empty"),
    (dict(stop="\n\n"), "stop must be a tuple of strings"),
    (dict(stop=(1,)), "stop must be a tuple of strings"),
])
def test_sampling_settings_are_checked(kwargs, words):
  """A non-finite temperature sampled token 0 forever, an empty stop string stopped after one
  token: every setting is refused in one sentence instead."""
  with pytest.raises(ElasticJaxError) as err:
    SamplingConfig(**kwargs)
  assert words in str(err.value) and "\n" not in str(err.value)


def test_sampling_near_zero_temperature_is_greedy():
  """A tiny temperature sharpens toward the argmax (the logits are shifted by their largest
  before dividing), instead of overflowing to inf and drawing token 0."""
  cfg, params = _model("llama")
  prompt = [[3, 9, 27, 4, 4, 8]]
  run = lambda sampling: generate(params, cfg, prompt, attention="sparse", rcfg=RCFG,
                                  sampling=sampling, attn_impl="reference").tokens[0]
  greedy = run(SamplingConfig(max_new_tokens=6))
  assert run(SamplingConfig(max_new_tokens=6, temperature=1e-30, seed=3)) == greedy
  assert SamplingConfig(stop=["x"]).stop == ("x",)       # a list of stop strings is kept


def test_arrays_given_as_other_things_are_refused():
  cfg, params = _model("llama")
  for gates in ({"a": 1}, [[1.0], [1.0, 0.0]]):
    with pytest.raises(ElasticJaxError, match=r"gates must be an array of numbers \[L, K\]"):
      generate(params, cfg, [[1, 2]], attention="forced", rcfg=RCFG, gates=gates)
  for eos in ({"a": 1}, ["2"], "2"):
    with pytest.raises(ElasticJaxError, match="eos_ids must be a list of integer token ids"):
      generate(params, cfg, [[1, 2]], attention="sparse", rcfg=RCFG, eos_ids=eos)
