"""Parity with Hugging Face `transformers` (PyTorch, eager attention) on tiny random models.

The models are created and saved by `transformers` itself inside the test (torch_reference.py),
then loaded here through the real converter. Tolerances: float32 logits max |diff| <= 1e-4;
bfloat16 logits max |diff| <= 0.04 * max |logit| (both sides round activations to bf16 at
every layer, in different orders, so only a loose bound holds).
"""

import os
import subprocess
import sys

import numpy as np
import pytest

import elastic_jax as ej
from elastic_jax import attention
from elastic_jax.attention.reference import causal_attention

BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

# name -> (family, config overrides, dtype, max_shard_size)
MODELS = {
    "qwen3": ("qwen3", dict(head_dim=32), "float32", None),
    "qwen3_tied_bias": ("qwen3", dict(head_dim=16, tie_word_embeddings=True,
                                      attention_bias=True, num_key_value_heads=1), "float32",
                        None),
    "llama3": ("llama", dict(rope_theta=500000.0, rope_scaling=LLAMA3_ROPE,
                             tie_word_embeddings=True), "float32", None),
    "llama3_untied_bias_sharded": ("llama", dict(rope_theta=500000.0, rope_scaling=LLAMA3_ROPE,
                                                 attention_bias=True, mlp_bias=True,
                                                 num_key_value_heads=4), "float32", "40KB"),
    "qwen3_bf16": ("qwen3", dict(head_dim=32), "bfloat16", None),
    "llama3_bf16": ("llama", dict(rope_theta=500000.0, rope_scaling=LLAMA3_ROPE), "bfloat16",
                    None),
}

_rng = np.random.default_rng(0)
PROMPTS = [_rng.integers(0, 97, size=n).tolist() for n in (1, 7, 40, 130)]


@pytest.fixture(scope="module")
def hf_models(torch_reference, tmp_path_factory):
  root = tmp_path_factory.mktemp("hf")
  jobs = []
  for seed, (name, (family, overrides, dtype, shard)) in enumerate(MODELS.items()):
    jobs.append({"op": "make", "family": family, "config": {**BASE, **overrides},
                 "seed": seed, "dtype": dtype, "out": str(root / name),
                 "max_shard_size": shard, "prompts": PROMPTS,
                 "logits": str(root / f"{name}.npz")})
  torch_reference(jobs)
  return root


def _reference_logits(root, name):
  data = np.load(root / f"{name}.npz")
  return [data[str(k)] for k in range(len(PROMPTS))]


@pytest.mark.parametrize("name", [n for n in MODELS if not n.endswith("bf16")])
def test_float32_logits_match_transformers(hf_models, name):
  model = ej.from_pretrained(hf_models / name, dtype="float32", show_progress=False)
  for prompt, ref in zip(PROMPTS, _reference_logits(hf_models, name)):
    ours = np.asarray(model.logits(prompt))[0]
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() <= 1e-4, (name, len(prompt), np.abs(ours - ref).max())
    # The test is only meaningful if the logits are not all near zero.
    assert np.abs(ref).max() > 1.0


def test_sharded_checkpoint_really_is_sharded(hf_models):
  files = os.listdir(hf_models / "llama3_untied_bias_sharded")
  assert "model.safetensors.index.json" in files
  assert sum(f.endswith(".safetensors") for f in files) > 1


@pytest.mark.parametrize("name", ["qwen3_bf16", "llama3_bf16"])
def test_bfloat16_logits_close_to_transformers(hf_models, name):
  model = ej.from_pretrained(hf_models / name, dtype="auto", show_progress=False)
  assert model.dtype == "bfloat16"
  for prompt, ref in zip(PROMPTS, _reference_logits(hf_models, name)):
    ours = np.asarray(model.logits(prompt))[0]
    assert np.abs(ours - ref).max() <= 0.04 * np.abs(ref).max(), (name, len(prompt))


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_matches_single_prompts(hf_models, side):
  """Uneven prompts in one padded batch give each prompt's own logits."""
  name = "llama3"
  model = ej.from_pretrained(hf_models / name, dtype="float32", show_progress=False)
  t = max(len(p) for p in PROMPTS)
  ids = np.zeros((len(PROMPTS), t), np.int32)
  mask = np.zeros((len(PROMPTS), t), np.int32)
  for i, p in enumerate(PROMPTS):
    sl = slice(0, len(p)) if side == "right" else slice(t - len(p), t)
    ids[i, sl], mask[i, sl] = p, 1
  logits = np.asarray(model.logits(ids, attention_mask=mask))
  for i, (p, ref) in enumerate(zip(PROMPTS, _reference_logits(hf_models, name))):
    sl = slice(0, len(p)) if side == "right" else slice(t - len(p), t)
    assert np.abs(logits[i, sl] - ref).max() <= 1e-4


def test_small_attention_chunks_change_nothing(hf_models, monkeypatch):
  """The memory-safe attention with tiny tiles (many chunks, ragged edges) keeps parity."""
  import functools
  monkeypatch.setitem(attention.IMPLS, "reference_tiny_tiles",
                      functools.partial(causal_attention, q_chunk=16, kv_chunk=24))
  model = ej.from_pretrained(hf_models / "qwen3", dtype="float32", show_progress=False)
  ref = _reference_logits(hf_models, "qwen3")[-1]
  ours = np.asarray(model.logits(PROMPTS[-1], attn_impl="reference_tiny_tiles"))[0]
  assert np.abs(ours - ref).max() <= 1e-4


ROUND_TRIP = ["llama3", "qwen3_tied_bias", "llama3_untied_bias_sharded", "qwen3_bf16"]


def test_round_trips_are_bit_exact(hf_models, torch_reference, tmp_path):
  """HF -> ours -> HF, in-process and through the CLI (HF -> orbax -> HF).

  transformers loads every export and finds every tensor identical to the original; the
  orbax checkpoint gives the same logits as loading the HF directory directly.
  """
  jobs = []
  for name in ROUND_TRIP:
    model = ej.from_pretrained(hf_models / name, dtype="auto", show_progress=False)
    out = tmp_path / f"export_{name}"
    ej.save_pretrained(model, out, max_shard_size=30_000)
    jobs.append({"op": "same_weights", "a": str(hf_models / name), "b": str(out)})

  src = hf_models / "llama3_untied_bias_sharded"
  ours_dir, back_dir = tmp_path / "converted", tmp_path / "back"
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  for args in ([str(src), str(ours_dir), "--dtype", "float32"],
               [str(ours_dir), str(back_dir), "--to-hf", "--dtype", "auto"]):
    proc = subprocess.run([sys.executable, "-m", "elastic_jax.convert", *args, "--quiet"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "converted llama" in proc.stdout
  jobs.append({"op": "same_weights", "a": str(src), "b": str(back_dir)})
  direct = ej.from_pretrained(src, dtype="float32", show_progress=False)
  restored = ej.from_pretrained(ours_dir, show_progress=False, dtype="auto")
  assert restored.dtype == "float32"
  for prompt in PROMPTS:
    np.testing.assert_array_equal(np.asarray(restored.logits(prompt)),
                                  np.asarray(direct.logits(prompt)))
  torch_reference(jobs)
