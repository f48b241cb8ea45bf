"""Bad input gets one clear sentence naming what is wrong, and leaves nothing behind."""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import elastic_jax as ej
from elastic_jax.errors import ElasticJaxError
from elastic_jax.model import init_params

TINY = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=61,
            hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            max_position_embeddings=64)


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
  cfg = ej.config_from_hf_dict(TINY)
  model = ej.ElasticModel(cfg, init_params(cfg, jax.random.key(0), "float32"), dict(TINY))
  path = tmp_path_factory.mktemp("good") / "hf"
  ej.save_pretrained(model, path)
  return path


@pytest.fixture
def broken(good_dir, tmp_path):
  """A fresh copy of the good checkpoint to damage."""
  path = tmp_path / "broken"
  shutil.copytree(good_dir, path)
  return path


def _edit_tensors(path, fn):
  file = path / "model.safetensors"
  tensors = load_file(file)
  fn(tensors)
  save_file(tensors, file, metadata={"format": "pt"})


def _edit_config(path, **changes):
  cfg = json.loads((path / "config.json").read_text())
  for k, v in changes.items():
    if v is None:
      cfg.pop(k, None)
    else:
      cfg[k] = v
  (path / "config.json").write_text(json.dumps(cfg))


def _convert(src, out, *extra):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, "-m", "elastic_jax.convert", str(src), str(out),
                         "--quiet", *extra], capture_output=True, text=True, env=env)


def _assert_loading_fails(path, *fragments):
  with pytest.raises(ElasticJaxError) as err:
    ej.from_pretrained(path, dtype="float32", show_progress=False)
  msg = str(err.value)
  assert "\n" not in msg
  for f in fragments:
    assert f in msg, msg


def test_good_checkpoint_loads(good_dir):
  model = ej.from_pretrained(good_dir, dtype="auto", show_progress=False)
  assert model.dtype == "float32"
  assert model.logits([1, 2, 3]).shape == (1, 3, 61)


def test_missing_tensor(broken):
  _edit_tensors(broken, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
  _assert_loading_fails(broken, "'model.layers.1.mlp.up_proj.weight'", "missing")


def test_mis_shaped_tensor(broken):
  def fn(t):
    t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 32), np.float32)
  _edit_tensors(broken, fn)
  _assert_loading_fails(broken, "'model.layers.0.self_attn.k_proj.weight'", "[8, 32]",
                        "[16, 32]")


def test_unmapped_tensor(broken):
  def fn(t):
    t["model.layers.0.self_attn.mystery.weight"] = np.zeros((2,), np.float32)
  _edit_tensors(broken, fn)
  _assert_loading_fails(broken, "'model.layers.0.self_attn.mystery.weight'", "not used")


def test_duplicate_tensor_across_files(broken):
  save_file({"model.norm.weight": np.ones(32, np.float32)}, broken / "extra.safetensors")
  _assert_loading_fails(broken, "'model.norm.weight'", "twice")


def test_index_pointing_to_wrong_file(broken):
  index = {"metadata": {}, "weight_map": {"model.norm.weight": "model-00002.safetensors"}}
  (broken / "model.safetensors.index.json").write_text(json.dumps(index))
  _assert_loading_fails(broken, "model-00002.safetensors", "'model.norm.weight'")


def test_corrupt_safetensors_file(broken):
  data = (broken / "model.safetensors").read_bytes()
  (broken / "model.safetensors").write_bytes(data[: len(data) // 3])
  _assert_loading_fails(broken, "model.safetensors", "not a readable safetensors file")


def test_pickle_weights_refused_without_flag(broken):
  os.remove(broken / "model.safetensors")
  (broken / "pytorch_model.bin").write_bytes(b"not even a pickle")
  _assert_loading_fails(broken, "pickle", "allow_pickle")


@pytest.mark.parametrize("changes,fragment", [
    ({"model_type": "mistral"}, "model_type 'mistral' is not supported"),
    ({"architectures": ["Qwen3ForSequenceClassification"]}, "architectures"),
    ({"sliding_window_pattern": 4}, "'sliding_window_pattern'"),
    ({"use_sliding_window": True, "sliding_window": 16}, "'use_sliding_window'"),
    ({"hidden_act": "gelu"}, "'hidden_act'"),
    ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0}}, "rope type 'longrope'"),
    ({"num_key_value_heads": 3}, "not a multiple"),
    ({"hidden_size": "32"}, "'hidden_size' should be int"),
    ({"vocab_size": None}, "'vocab_size' is missing"),
])
def test_config_fields_refused(broken, changes, fragment):
  _edit_config(broken, **changes)
  _assert_loading_fails(broken, "config.json", fragment)


def test_malformed_config_json(broken):
  (broken / "config.json").write_text("{not json")
  _assert_loading_fails(broken, "config.json", "not valid JSON")


def test_cli_reports_one_line_and_leaves_nothing(broken, tmp_path):
  _edit_tensors(broken, lambda t: t.pop("model.norm.weight"))
  out = tmp_path / "out"
  proc = _convert(broken, out)
  assert proc.returncode == 2
  assert proc.stderr.strip().startswith("error:") and "'model.norm.weight'" in proc.stderr
  assert len(proc.stderr.strip().splitlines()) == 1
  assert not out.exists()
  assert not [p for p in os.listdir(tmp_path) if ".partial" in p]


def test_cli_refuses_existing_output_and_keeps_it(good_dir, tmp_path):
  out = tmp_path / "out"
  out.mkdir()
  (out / "keep.txt").write_text("mine")
  proc = _convert(good_dir, out)
  assert proc.returncode == 2 and "already exists" in proc.stderr
  assert (out / "keep.txt").read_text() == "mine"


def test_failed_write_leaves_no_output(good_dir, tmp_path, monkeypatch):
  """A failure in the middle of writing (here: the disk 'fills up') publishes nothing."""
  from elastic_jax.convert import hf
  model = ej.from_pretrained(good_dir, dtype="float32", show_progress=False)

  real_write = hf.write_hf_safetensors

  def exploding(params, cfg, directory, *args, **kwargs):
    real_write(params, cfg, directory, *args, **kwargs)  # writes everything, then fails
    raise OSError("No space left on device")
  monkeypatch.setattr(hf, "write_hf_safetensors", exploding)
  with pytest.raises(OSError):
    ej.save_pretrained(model, tmp_path / "export")
  assert os.listdir(tmp_path) == []


def test_our_checkpoint_with_mismatched_config(good_dir, tmp_path):
  out = tmp_path / "ours"
  assert _convert(good_dir, out, "--dtype", "float32").returncode == 0
  _edit_config(out, intermediate_size=64)
  _assert_loading_fails(out, "['mlp']['down_kernel']", "[2, 48, 32]", "[2, 64, 32]")


@pytest.mark.parametrize("ids,fragment", [
    ([], "empty"),
    (list(range(60)) + [1] * 10, "longer than the model's max_position_embeddings (64)"),
    ([1, 2, 61], "token 61 outside the vocabulary [0, 61)"),
    ([[1.5, 2.0]], "integer token ids"),
])
def test_bad_sequences(good_dir, ids, fragment):
  model = ej.from_pretrained(good_dir, dtype="float32", show_progress=False)
  with pytest.raises(ElasticJaxError) as err:
    model.logits(np.asarray(ids))
  assert fragment in str(err.value)


def test_unknown_attention_mode_and_dtype(good_dir):
  with pytest.raises(ElasticJaxError, match="dtype 'int8'"):
    ej.from_pretrained(good_dir, dtype="int8")
  model = ej.from_pretrained(good_dir, dtype="float32", show_progress=False)
  with pytest.raises(ElasticJaxError, match="attention 'banana' is not available"):
    model.logits([1, 2], attention="banana")
