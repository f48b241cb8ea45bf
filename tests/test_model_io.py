"""Saving and loading a model with its routers, the loaders' signature and the API's own
errors: the shipped backbone with the shipped routers (boundary 100, SSA block 16: the
authors' layout cannot hold them) and the static gate round-trip through every saving path
with the same gates and logits; hub ids resolve from a local cache laid out here."""

import json
import os
import shutil
import warnings

import numpy as np
import pytest

import elastic_jax as ej
from elastic_jax.convert.__main__ import main as convert_main
from elastic_jax.resources import PACKAGE_DIR

BACKBONE = os.path.join(PACKAGE_DIR, "repro", "backbone")
ROUTERS = os.path.join(PACKAGE_DIR, "repro", "routers")
STATIC = os.path.join(PACKAGE_DIR, "repro", "routers_static")
IDS = np.array([[5, 9, 14, 3, 22, 7, 41, 8, 2, 17, 30, 11]], np.int32)


@pytest.fixture(scope="module")
def model():
  return ej.from_pretrained(BACKBONE, dtype="float32", routers=ROUTERS, show_progress=False)


def _same(a, b):
  la, ra = a.logits(IDS, "elastic", return_routing=True)
  lb, rb = b.logits(IDS, "elastic", return_routing=True)
  np.testing.assert_array_equal(np.asarray(ra["gates"]), np.asarray(rb["gates"]))
  np.testing.assert_allclose(np.asarray(la), np.asarray(lb), rtol=0, atol=1e-5)
  assert a.router_config == b.router_config
  assert b.objective_targets == a.objective_targets


@pytest.mark.parametrize("how", ["save_pretrained", "save_converted", "convert", "convert-hf"])
def test_shipped_routers_round_trip_in_our_layout(model, tmp_path, how):
  out = str(tmp_path / "out")
  if how == "save_pretrained":
    model.save_pretrained(out)
  elif how == "save_converted":
    ej.save_converted(model, out)
  else:
    assert convert_main([BACKBONE, out, "--routers", ROUTERS, "--dtype", "float32", "--quiet"]
                        + (["--to-hf"] if how == "convert-hf" else [])) == 0
  assert os.path.isfile(os.path.join(out, "routers", "routers.json"))
  with open(os.path.join(out, "config.json")) as f:   # a plain backbone config for transformers
    assert "Paw" not in json.load(f)["architectures"][0]
  back = ej.from_pretrained(out, show_progress=False)   # no other argument
  assert back.dtype == "float32" and back.router_params is not None
  _same(model, back)


def test_static_gate_and_authors_layout_refusal(tmp_path):
  static = ej.from_pretrained(BACKBONE, dtype="float32", routers=STATIC, show_progress=False)
  with pytest.raises(ej.ElasticJaxError, match="cannot be written in the authors' layout.*static"):
    static.save_pretrained(str(tmp_path / "a"), layout="authors")
  assert not os.path.exists(tmp_path / "a")
  static.save_pretrained(str(tmp_path / "b"))
  back = ej.from_pretrained(str(tmp_path / "b"), show_progress=False)
  assert back.router_config.static
  _same(static, back)
  with pytest.raises(ej.ElasticJaxError, match="layout 'hf' is not one of"):
    static.save_pretrained(str(tmp_path / "c"), layout="hf")
  # routers=False: the backbone alone, loaded back without routers
  static.save_pretrained(str(tmp_path / "d"), routers=False)
  assert ej.from_pretrained(str(tmp_path / "d"), show_progress=False).router_params is None


def test_authors_layout_still_written_when_it_fits(model, tmp_path):
  """Routers the authors' layout can hold keep going there under layout='auto'; 'elastic_jax'
  asks for ours."""
  import dataclasses
  from elastic_jax.convert import authors
  fits = dataclasses.replace(model, router_config=dataclasses.replace(
      model.router_config, block=authors.BLOCK, boundary=authors.BOUNDARY))
  fits.save_pretrained(str(tmp_path / "a"))
  with open(tmp_path / "a" / "config.json") as f:
    assert json.load(f)["architectures"][0].startswith("Paw")
  assert not os.path.exists(tmp_path / "a" / "routers")
  fits.save_pretrained(str(tmp_path / "b"), layout="elastic_jax")
  assert os.path.isfile(tmp_path / "b" / "routers" / "routers.json")
  for d in ("a", "b"):
    back = ej.from_pretrained(str(tmp_path / d), show_progress=False)
    assert back.router_config.block == authors.BLOCK
    for name, value in fits.router_params.items():
      np.testing.assert_allclose(np.asarray(back.router_params[name]), np.asarray(value),
                                 atol=1e-6, err_msg=name)


def test_saving_over_a_directory_speaks_python(model, tmp_path):
  (tmp_path / "x").mkdir()
  with pytest.raises(ej.ElasticJaxError, match=r"overwrite=True") as e:
    model.save_pretrained(str(tmp_path / "x"))
  assert "--overwrite" not in str(e.value)
  with pytest.raises(ej.ElasticJaxError, match=r"overwrite=True"):
    ej.save_converted(model, str(tmp_path / "x"))


def test_loaders_share_one_signature(tmp_path):
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    m = ej.ElasticModel.from_pretrained(BACKBONE, show_progress=False)
  from safetensors import safe_open
  with safe_open(os.path.join(BACKBONE, "model.safetensors"), "np") as f:
    stored = f.get_tensor(next(iter(f.keys()))).dtype.name
  assert m.dtype == stored            # "auto": the checkpoint's own dtype
  for load in (ej.from_pretrained, ej.ElasticModel.from_pretrained):
    with pytest.warns(DeprecationWarning, match="by keyword"):
      m = load(BACKBONE, "bfloat16", show_progress=False)
    assert m.dtype == "bfloat16"
  with pytest.warns(DeprecationWarning):   # the class method's old order: (path, routers)
    m = ej.ElasticModel.from_pretrained(BACKBONE, ROUTERS, show_progress=False)
  assert m.router_params is not None
  with pytest.raises(TypeError):
    ej.from_pretrained(BACKBONE, dtype="float32", dtyp="x")


def test_generate_takes_arrays_and_names_its_keywords(model):
  g1 = model.generate(IDS, max_new_tokens=3, attention="full")
  g2 = model.generate(IDS[0], max_new_tokens=3, attention="full")
  g3 = model.generate([IDS[0].tolist()], max_new_tokens=3, attention="full")
  assert g1.tokens == g2.tokens == g3.tokens and len(g1.tokens[0]) <= 3
  g4 = model.generate(np.concatenate([IDS, IDS]), max_new_tokens=2, attention="full")
  assert len(g4.tokens) == 2 and g4.tokens[0] == g4.tokens[1]
  with pytest.raises(ej.ElasticJaxError, match=r"unknown keyword do_sample; it takes .*max_new_tokens"):
    model.generate(IDS, do_sample=True)
  with pytest.raises(ej.ElasticJaxError, match="integer token ids"):
    model.generate(np.zeros((1, 2, 3), np.int32))
  with pytest.raises(ej.ElasticJaxError, match="mixing texts and token ids"):
    model.generate(["a", [1, 2]])


def test_per_call_max_new_tokens_wins_over_sampling(model):
  cfg = ej.SamplingConfig(max_new_tokens=6)
  g = model.generate(IDS, attention="full", sampling=cfg, max_new_tokens=2, eos_ids=())
  assert len(g.tokens[0]) == 2
  g = model.generate(IDS, attention="full", sampling=cfg, eos_ids=())
  assert len(g.tokens[0]) == 6


def test_logits_refuse_nan_gates_and_mask_holes(model):
  l, k = model.config.num_layers, model.config.num_kv_heads
  gates = np.ones((l, k), np.float32)
  gates[0, 0] = np.nan
  with pytest.raises(ej.ElasticJaxError, match="NaN or inf"):
    model.logits(IDS, "forced", gates=gates)
  mask = np.ones_like(IDS)
  mask[0, 4] = 0
  with pytest.raises(ej.ElasticJaxError, match="padding between real tokens"):
    model.logits(IDS, attention_mask=mask)
  mask = np.ones_like(IDS)
  mask[0, :3] = 0                      # left padding stays fine
  assert np.isfinite(np.asarray(model.logits(IDS, attention_mask=mask))).all()


def test_hub_id_from_the_local_cache(tmp_path, monkeypatch):
  cache = tmp_path / "hub"
  snap = cache / "models--tiny-org--tiny-qwen" / "snapshots" / ("ab" * 20)
  shutil.copytree(BACKBONE, snap)
  (cache / "models--tiny-org--tiny-qwen" / "refs").mkdir()
  (cache / "models--tiny-org--tiny-qwen" / "refs" / "main").write_text("ab" * 20)
  monkeypatch.setenv("HF_HUB_CACHE", str(cache))
  monkeypatch.chdir(tmp_path)
  m = ej.from_pretrained("tiny-org/tiny-qwen", show_progress=False)
  ref = ej.from_pretrained(BACKBONE, show_progress=False)
  np.testing.assert_array_equal(np.asarray(m.logits(IDS)), np.asarray(ref.logits(IDS)))
  assert ej.from_pretrained("tiny-org/tiny-qwen", revision="ab" * 20,
                            show_progress=False).config == ref.config
  with pytest.raises(ej.ElasticJaxError, match="local Hugging Face cache.*nothing is downloaded"):
    ej.from_pretrained("tiny-org/other", show_progress=False)
  with pytest.raises(ej.ElasticJaxError, match="revision 'v2'"):
    ej.from_pretrained("tiny-org/tiny-qwen", revision="v2", show_progress=False)


def test_convert_layout_flag_and_more_bad_input(tmp_path, capsys):
  from elastic_jax.cli import run_cli
  rc = run_cli(lambda: convert_main([BACKBONE, str(tmp_path / "a"), "--routers", ROUTERS,
                                     "--layout", "authors", "--quiet"]))
  err = capsys.readouterr().err.strip().splitlines()
  assert rc != 0 and len(err) == 1 and "its SSA block is 128 tokens" in err[0]
  assert not os.path.exists(tmp_path / "a")
  (tmp_path / "b").mkdir()              # the command speaks its own flags, the API Python
  rc = run_cli(lambda: convert_main([BACKBONE, str(tmp_path / "b"), "--quiet"]))
  err = capsys.readouterr().err
  assert rc != 0 and "pass --overwrite" in err and "overwrite=True" not in err
  # the attention operator: positions without segment_ids, a gate as a plain list
  import jax.numpy as jnp
  q = jnp.ones((1, 8, 2, 4), jnp.float32)
  with pytest.raises(ej.ElasticJaxError, match="pass segment_ids with them"):
    ej.hybrid_attention(q, q, q, jnp.ones((1, 2)), positions=jnp.arange(8)[None])
  out = ej.hybrid_attention(q, q, q, [[1.0, 0.0]])
  assert out.shape == q.shape
  from elastic_jax.repro.report import parse_kernel_times
  with pytest.raises(ej.ElasticJaxError, match="finite"):
    parse_kernel_times("0:nan,1:8")
