"""RoPE scaling types against `transformers`: YaRN, linear and dynamic NTK, both families.

Tiny random models are made and saved by transformers (torch_reference.py), loaded here
through the converter, and compared in float32 (max |diff| <= 1e-4) on prompts far past the
length the scaling is anchored to (original_max_position_embeddings 32 for YaRN; for dynamic
NTK, max_position_embeddings 32, past which the base grows), then in decoding: greedy steps
through the KV cache, transformers' at its cache positions, ours through the per-head cache.
"""

import numpy as np
import pytest

import jax

import elastic_jax as ej
from elastic_jax.config import config_from_hf_dict, rope_attention_factor, rope_inv_freq
from elastic_jax.errors import ElasticJaxError
from elastic_jax.generation.generate import SamplingConfig
from elastic_jax.model import init_params

BASE = dict(vocab_size=89, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)
MODELS = {
    # Qwen3's published long-context setting, scaled down: factor 4 over 32 positions.
    "qwen3_yarn": ("qwen3", dict(max_position_embeddings=256, rope_theta=1000.0,
                                 rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 32})),
    # YaRN with every field transformers reads: betas, no truncation, mscale terms.
    "llama_yarn_fields": ("llama", dict(max_position_embeddings=256, rope_theta=500.0,
                                        rope_scaling={"rope_type": "yarn", "factor": 8.0,
                                                      "original_max_position_embeddings": 32,
                                                      "beta_fast": 16.0, "beta_slow": 2.0,
                                                      "truncate": False, "mscale": 1.0,
                                                      "mscale_all_dim": 0.5})),
    "llama_yarn_attention_factor": ("llama", dict(max_position_embeddings=256,
                                                  rope_scaling={"rope_type": "yarn",
                                                                "factor": 6.0,
                                                                "attention_factor": 1.3,
                                                                "original_max_position_"
                                                                "embeddings": 32})),
    "qwen3_linear": ("qwen3", dict(max_position_embeddings=256,
                                   rope_scaling={"rope_type": "linear", "factor": 3.0})),
    "llama_dynamic": ("llama", dict(max_position_embeddings=32, rope_theta=2000.0,
                                    rope_scaling={"rope_type": "dynamic", "factor": 8.0})),
    "qwen3_dynamic": ("qwen3", dict(max_position_embeddings=32,
                                    rope_scaling={"rope_type": "dynamic", "factor": 6.0})),
}
_rng = np.random.default_rng(3)
PROMPTS = [_rng.integers(0, 89, size=n).tolist() for n in (9, 70, 190)]
DECODE_PROMPT = _rng.integers(0, 89, size=150).tolist()
DECODE_STEPS = 6


@pytest.fixture(scope="module")
def rope_models(torch_reference, tmp_path_factory):
  root = tmp_path_factory.mktemp("rope")
  jobs = []
  for seed, (name, (family, overrides)) in enumerate(MODELS.items()):
    jobs.append({"op": "make", "family": family, "config": {**BASE, **overrides},
                 "seed": 10 + seed, "out": str(root / name), "prompts": PROMPTS,
                 "logits": str(root / f"{name}.npz")})
    jobs.append({"op": "greedy", "dir": str(root / name), "prompts": [DECODE_PROMPT],
                 "steps": DECODE_STEPS, "logits": str(root / f"{name}_greedy.npz")})
  torch_reference(jobs)
  return root


@pytest.mark.parametrize("name", list(MODELS))
def test_prefill_logits_match_transformers(rope_models, name):
  model = ej.from_pretrained(rope_models / name, dtype="float32", show_progress=False)
  assert model.config.rope_scaling.rope_type == MODELS[name][1]["rope_scaling"]["rope_type"]
  ref = np.load(rope_models / f"{name}.npz")
  for k, prompt in enumerate(PROMPTS):
    ours = np.asarray(model.logits(prompt))[0]
    want = ref[str(k)]
    assert np.abs(want).max() > 1.0
    assert np.abs(ours - want).max() <= 1e-4, (name, len(prompt), np.abs(ours - want).max())


@pytest.mark.parametrize("name", list(MODELS))
def test_decode_logits_match_transformers(rope_models, name):
  """Greedy decoding through the cache: the same tokens, each step's logits within 1e-4."""
  model = ej.from_pretrained(rope_models / name, dtype="float32", show_progress=False)
  ref = np.load(rope_models / f"{name}_greedy.npz")
  gen = model.generate([DECODE_PROMPT], attention="full", attn_impl="reference",
                       sampling=SamplingConfig(max_new_tokens=DECODE_STEPS),
                       return_logits=True)
  assert gen.tokens[0] == ref["tokens_0"].tolist()
  diff = np.abs(gen.logits[:, 0] - ref["0"]).max()
  assert diff <= 1e-4, (name, diff)


def test_dynamic_rope_depends_on_length_past_the_limit_only():
  """Dynamic NTK changes nothing up to max_position_embeddings and everything after it."""
  cfg = config_from_hf_dict({"model_type": "llama", **BASE, "max_position_embeddings": 32,
                             "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}})
  plain = config_from_hf_dict({"model_type": "llama", **BASE, "max_position_embeddings": 256})
  model = ej.ElasticModel(cfg, init_params(cfg, jax.random.key(0), "float32"),
                          cfg.to_hf_dict())
  same = ej.ElasticModel(plain, model.params, plain.to_hf_dict())
  short, long = PROMPTS[0], PROMPTS[1]
  np.testing.assert_array_equal(np.asarray(model.logits(short)), np.asarray(same.logits(short)))
  assert np.abs(np.asarray(model.logits(long)) - np.asarray(same.logits(long))).max() > 1e-3
  assert cfg.max_length == 128
  with pytest.raises(ElasticJaxError, match="dynamic RoPE factor"):
    model.logits(list(range(80)) * 2)


def test_rope_fields_and_refusals():
  yarn = config_from_hf_dict({"model_type": "qwen3", **BASE, "max_position_embeddings": 128,
                              "rope_scaling": {"type": "yarn", "factor": 4.0}})
  # original_max_position_embeddings defaults to max_position_embeddings, as transformers.
  assert yarn.rope_scaling.original_max_position_embeddings == 128
  assert rope_attention_factor(yarn) == pytest.approx(0.1 * np.log(4.0) + 1)
  # A round trip through our HF export keeps the table.
  again = config_from_hf_dict(yarn.to_hf_dict())
  np.testing.assert_array_equal(rope_inv_freq(again), rope_inv_freq(yarn))
  for rope, words in (({"rope_type": "longrope", "factor": 2.0}, "rope type 'longrope'"),
                      ({"rope_type": "yarn", "factor": 2.0, "partial_rotary_factor": 0.5},
                       "'partial_rotary_factor'"),
                      ({"rope_type": "linear"}, "needs field 'factor'"),
                      ({"rope_type": "yarn", "factor": 2.0, "truncate": "no"}, "'truncate'")):
    with pytest.raises(ElasticJaxError, match=words):
      config_from_hf_dict({"model_type": "llama", **BASE, "rope_scaling": rope})
