"""The authors' released Elastic-Attention models: load, route, export back, refuse bad ones.

Tiny "Paw" checkpoints are built by the PyTorch harness the way the authors' model saves
itself (a transformers Qwen3 / Llama model with their router modules and task multipliers
registered under their names, their config keys and architecture name): Qwen3 with YaRN
RoPE and a two-logit (softmax) router, Llama 3.x with llama3 RoPE, a one-logit (sigmoid)
router and the XA-SSA setting. Routing decisions are checked against a NumPy transcription
of the authors' evaluation router, fed with the keys transformers computes (hooked after
k_norm / k_proj, before RoPE): it shares no code with ours.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import elastic_jax as ej
from elastic_jax.errors import ElasticJaxError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=8, num_key_value_heads=4, head_dim=16)
PAW_KEYS = dict(toggle_type="streaming", retrieval_mode="full", sink_size=128,
                local_window_size=256, pooling_mode="ctx_q", use_softmax=True,
                enable_ada_sparsity=True, enable_lambda_task=True, suggested_sparsity=None,
                topk_k=32, disable_linear_regularization_term=False, pooling_seq=True,
                layerwise_sparsity_schedule="high-low-high", enable_layerwise_sparsity=False,
                layerwise_sparsity_min_ratio=0.5, triangle_n_last=128,
                use_task_emb_for_mask=False, enable_contrastive_loss=False)
MODELS = {
    "qwen3_yarn": dict(family="qwen3", config=dict(
        BASE, max_position_embeddings=1024,
        rope_scaling={"rope_type": "yarn", "factor": 4.0,
                      "original_max_position_embeddings": 64}),
        paw=PAW_KEYS, router_logits=2, extras=True),
    "llama3_sigmoid_xa": dict(family="llama", config=dict(
        BASE, max_position_embeddings=1024, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        paw=dict(PAW_KEYS, use_softmax=False, retrieval_mode="xattn", sink_size=256,
                 local_window_size=512, enable_lambda_task=False), router_logits=1,
        lambdas=False),
}
_rng = np.random.default_rng(7)
# Shorter than, between, and longer than the two 100-token pooling spans.
PROMPTS = [_rng.integers(0, 97, size=n).tolist() for n in (37, 150, 333)]


@pytest.fixture(scope="module")
def paw(torch_reference, tmp_path_factory):
  root = tmp_path_factory.mktemp("paw")
  jobs = []
  for seed, (name, spec) in enumerate(MODELS.items()):
    jobs.append({"op": "make_paw", **spec, "seed": seed, "out": str(root / name),
                 "prompts": PROMPTS, "logits": str(root / f"{name}.npz")})
    jobs.append({"op": "keys", "dir": str(root / name), "prompts": PROMPTS,
                 "out": str(root / f"{name}_keys.npz")})
  torch_reference(jobs)
  return root


def _tensors(directory):
  out = {}
  for f in sorted(os.listdir(directory)):
    if f.endswith(".safetensors"):
      out.update(load_file(os.path.join(directory, f)))
  return out


def _authors_router(keys_thd, tensors, layer, use_softmax):
  """The authors' evaluation router, transcribed to NumPy from their code's description:
  mean of concat(k[:100], k[-100:]) over tokens, task MLP, router MLP, then the argmax of a
  softmax (two logits; index 1 = full) or, with one logit, a LayerNorm over the layer's KV
  heads (no affine weights, eps 1e-5) and sigmoid > 0.5. Returns (full? [K], margin [K])."""
  k = keys_thd.astype(np.float64)
  pooled = np.concatenate([k[:100], k[-100:]], axis=0).mean(0)            # [K, H]

  def linear(x, module, index):
    p = f"model.layers.{layer}.self_attn.mask_allocator.{module}.{index}."
    return x @ tensors[p + "weight"].astype(np.float64).T + tensors[p + "bias"]

  def silu(x):
    return x / (1 + np.exp(-x))

  x = linear(silu(linear(pooled, "cls_feat_extractor", 0)), "cls_feat_extractor", 2)
  x = silu(linear(x, "cls_router_head_agnostic", 0))
  x = silu(linear(x, "cls_router_head_agnostic", 2))
  z = linear(x, "cls_router_head_agnostic", 4)                            # [K, C]
  if use_softmax:
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.argmax(p, -1) == 1, np.abs(z[:, 1] - z[:, 0])
  z = z[:, 0]
  normed = (z - z.mean()) / np.sqrt(z.var() + 1e-5)
  return 1 / (1 + np.exp(-normed)) > 0.5, np.abs(normed)


@pytest.mark.parametrize("name", list(MODELS))
def test_full_attention_logits_match_transformers(paw, name):
  model = ej.from_pretrained(paw / name, dtype="float32", show_progress=False)
  ref = np.load(paw / f"{name}.npz")
  for i, prompt in enumerate(PROMPTS):
    ours = np.asarray(model.logits(prompt))[0]
    assert np.abs(ref[str(i)]).max() > 1.0
    assert np.abs(ours - ref[str(i)]).max() <= 1e-4, (name, len(prompt))


@pytest.mark.parametrize("name", list(MODELS))
def test_routing_decisions_are_the_authors(paw, name):
  """Every (prompt, layer, KV head) decision equals the NumPy transcription's."""
  spec = MODELS[name]
  model = ej.from_pretrained(paw / name, dtype="float32", show_progress=False)
  rcfg = model.router_config
  assert (rcfg.patterns, rcfg.sink_blocks, rcfg.local_blocks, rcfg.block) == (
      ("fa-ssa", 1, 2, 128) if spec["paw"]["retrieval_mode"] == "full" else ("xa-ssa", 2, 4, 128))
  assert rcfg.relaxation == ("softmax" if spec["paw"]["use_softmax"] else "sigmoid")
  if rcfg.uses_xattention:
    assert (rcfg.xa_threshold, rcfg.xa_stride, rcfg.xa_block) == (0.8, 16, 128)
  tensors = _tensors(paw / name)
  keys = np.load(paw / f"{name}_keys.npz")
  decisions = []
  for i, prompt in enumerate(PROMPTS):
    _, routing = model.logits(prompt, attention="elastic", return_routing=True)
    ours = np.asarray(routing["gates"])[:, 0]                          # [L, K]
    for layer in range(BASE["num_hidden_layers"]):
      want, margin = _authors_router(keys[f"{i}_{layer}"], tensors, layer,
                                     spec["paw"]["use_softmax"])
      assert margin.min() > 1e-4, "too close to a tie to compare decisions"
      np.testing.assert_array_equal(ours[layer], want.astype(np.float32),
                                    err_msg=f"{name} prompt {len(prompt)} layer {layer}")
      decisions.extend(want.tolist())
  # The check means something only if both decisions occur.
  assert 0 < sum(decisions) < len(decisions)


def _same_directory_tensors(a, b):
  ta, tb = _tensors(a), _tensors(b)
  assert sorted(ta) == sorted(tb), sorted(set(ta) ^ set(tb))
  for name in ta:
    assert ta[name].dtype == tb[name].dtype and ta[name].shape == tb[name].shape, name
    assert ta[name].tobytes() == tb[name].tobytes(), f"tensor {name} differs"


def test_round_trip_is_bit_exact_and_loads_in_transformers(paw, tmp_path, torch_reference):
  """Paw -> ours -> Paw, in-process and through the CLI (Paw -> orbax -> Paw): every tensor
  identical, the config keys kept; transformers loads the export with the same logits."""
  name = "qwen3_yarn"
  src = paw / name
  model = ej.from_pretrained(src, dtype="auto", show_progress=False)
  assert model.lambdas is not None and model.authors_extras.tensors
  out = tmp_path / "export"
  ej.save_pretrained(model, out)
  _same_directory_tensors(src, out)
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  ours_dir, back = tmp_path / "ours", tmp_path / "back"
  for args in ([src, ours_dir, "--dtype", "auto"], [ours_dir, back, "--to-hf", "--dtype", "auto"]):
    proc = subprocess.run([sys.executable, "-m", "elastic_jax.convert", *map(str, args),
                           "--quiet"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "routers: 3 layers x 4 KV heads, patterns fa-ssa" in proc.stdout
  _same_directory_tensors(src, back)
  original = json.loads((src / "config.json").read_text())
  for directory in (out, back):
    written = json.loads((directory / "config.json").read_text())
    for key in ("architectures", "rope_parameters", *PAW_KEYS):
      assert written.get(key) == original.get(key), key
  # Our own format routes exactly as the directory it came from.
  converted = ej.from_pretrained(ours_dir, dtype="float32", show_progress=False)
  direct = ej.from_pretrained(src, dtype="float32", show_progress=False)
  for prompt in PROMPTS[1:]:
    a = direct.logits(prompt, attention="elastic", return_routing=True)
    b = converted.logits(prompt, attention="elastic", return_routing=True)
    np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))
    np.testing.assert_array_equal(np.asarray(a[1]["gates"]), np.asarray(b[1]["gates"]))
  torch_reference([{"op": "logits", "dir": str(out), "prompts": PROMPTS,
                    "logits": str(tmp_path / "reloaded.npz")}])
  reloaded, ref = np.load(tmp_path / "reloaded.npz"), np.load(paw / f"{name}.npz")
  for i in range(len(PROMPTS)):
    np.testing.assert_array_equal(reloaded[str(i)], ref[str(i)])


def test_routers_trained_here_export_in_the_authors_layout(paw, tmp_path):
  """A backbone with routers attached from a train.py export writes the authors' layout;
  reading it back gives the same routers, and the backbone alone drops them."""
  import jax
  from elastic_jax.router import RouterConfig, init_router_params
  from elastic_jax.router_io import Routers, save_routers
  from elastic_jax.train.objective import init_lambdas
  plain = ej.from_pretrained(paw / "qwen3_yarn", dtype="float32", show_progress=False)
  rcfg = RouterConfig(sink_blocks=2, local_blocks=3)
  trainable = {"router": init_router_params(plain.config, rcfg, jax.random.key(3)),
               "lambdas": init_lambdas(jax.random.key(4))}
  save_routers(str(tmp_path / "export" / "elastic_jax"),
               Routers(trainable["router"], rcfg, trainable["lambdas"]), plain.config)
  merged = ej.from_pretrained(paw / "qwen3_yarn", dtype="float32", show_progress=False,
                              routers=tmp_path / "export" / "elastic_jax")
  ej.save_pretrained(merged, tmp_path / "merged")
  config = json.loads((tmp_path / "merged" / "config.json").read_text())
  assert (config["sink_size"], config["local_window_size"]) == (256, 384)
  back = ej.from_pretrained(tmp_path / "merged", dtype="float32", show_progress=False)
  for key, value in trainable["router"].items():
    np.testing.assert_array_equal(np.asarray(back.router_params[key]), np.asarray(value))
  ej.save_pretrained(merged, tmp_path / "backbone", routers=False)
  alone = json.loads((tmp_path / "backbone" / "config.json").read_text())
  assert alone["architectures"] == ["Qwen3ForCausalLM"] and "sink_size" not in alone
  assert not any("mask_allocator" in n for n in _tensors(tmp_path / "backbone"))
  static = ej.ElasticModel(plain.config, plain.params, plain.hf_config,
                           router_params={"static_logits": np.zeros((3, 4, 2), np.float32)},
                           router_config=RouterConfig(static=True))
  with pytest.raises(ElasticJaxError, match="static router"):
    ej.save_pretrained(static, tmp_path / "static", layout="authors")
  assert not (tmp_path / "static").exists()
  ej.save_pretrained(static, tmp_path / "static")   # layout "auto": ours
  assert json.loads((tmp_path / "static" / "config.json").read_text())["architectures"] == [
      "Qwen3ForCausalLM"]
  assert ej.from_pretrained(tmp_path / "static", show_progress=False).router_config.static


def _broken_copy(paw, tmp_path, edit_tensors=None, edit_config=None):
  src, dst = paw / "qwen3_yarn", tmp_path / "broken"
  shutil.copytree(src, dst)
  if edit_tensors:
    tensors = load_file(dst / "model.safetensors")
    edit_tensors(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
  if edit_config:
    config = json.loads((dst / "config.json").read_text())
    edit_config(config)
    (dst / "config.json").write_text(json.dumps(config))
  return dst


R = "model.layers.{i}.self_attn.mask_allocator."
BAD = {
    "missing layer": (lambda t: [t.pop(k) for k in list(t) if k.startswith(R.format(i=2))],
                      None, "router tensor 'model.layers.2.self_attn.mask_allocator"),
    "wrong shape": (lambda t: t.update({R.format(i=1) + "cls_feat_extractor.0.weight":
                                        np.zeros((64, 8), np.float32)}), None,
                    "'model.layers.1.self_attn.mask_allocator.cls_feat_extractor.0.weight' has "
                    "shape [64, 8], expected [64, 16]"),
    "multipliers": (lambda t: t.update({"model.sparsity_lambda1_task": np.zeros(4, np.float32)}),
                    None, "'model.sparsity_lambda1_task' has shape [4], expected [5]"),
    "unknown tensor": (lambda t: t.update({R.format(i=0) + "gate.weight": np.zeros(2)}), None,
                       "'model.layers.0.self_attn.mask_allocator.gate.weight' is not part"),
    "toggle": (None, lambda c: c.update(toggle_type="local"), "'toggle_type' is 'local'"),
    "window": (None, lambda c: c.update(local_window_size=1000),
               "'local_window_size' is 1000; elastic_jax needs a positive multiple"),
    "static masks": (None, lambda c: c.update(enable_ada_sparsity=False),
                     "'enable_ada_sparsity' is not true"),
    "pooling": (None, lambda c: c.update(pooling_mode="first_token"),
                "'pooling_mode' is 'first_token'"),
    "unknown key": (None, lambda c: c.update(sparse_heads_first=True),
                    "field 'sparse_heads_first' is not implemented"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_authors_directories_are_refused(paw, tmp_path, case):
  """One sentence naming the tensor or key, from the API and from the CLI (exit 2, nothing
  written)."""
  edit_tensors, edit_config, words = BAD[case]
  broken = _broken_copy(paw, tmp_path, edit_tensors, edit_config)
  with pytest.raises(ElasticJaxError, match=None) as err:
    ej.from_pretrained(broken, dtype="float32", show_progress=False)
  assert words in str(err.value)
  if case in ("missing layer", "toggle"):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "elastic_jax.convert", str(broken), str(out),
                           "--quiet"], capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 2 and words in proc.stderr
    assert proc.stderr.count("\n") == 1 and not out.exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".out")]
