"""The run configuration: shipped YAMLs load, overrides apply, bad input names its key."""

import dataclasses
import glob
import os
import typing

import jax
import pytest

from elastic_jax import attention
from elastic_jax.errors import ElasticJaxError
from elastic_jax.sharding import MESH_AXES, make_mesh
from elastic_jax.train.run_config import (AttnImpl, MeshConfig, ModelSource,
                                          RunConfig, check_batch_layout, dump_run_config,
                                          load_run_config, resolve_mesh_shape,
                                          resolve_model_path, run_config_to_dict)
from elastic_jax.train.step import TrainConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")


def write(tmp_path, text, name="run.yaml"):
  path = tmp_path / name
  path.write_text(text)
  return str(path)


def fails(match, path, overrides=()):
  with pytest.raises(ElasticJaxError, match=match) as e:
    load_run_config(path, list(overrides))
  return str(e.value)


@pytest.mark.parametrize("path", SHIPPED, ids=os.path.basename)
def test_shipped_configs_load(path):
  cfg = load_run_config(path, [])
  name = os.path.basename(path)
  # The CPU default runs on one device; the others are laid out for 8.
  shape = resolve_mesh_shape(cfg.mesh, 1 if name == "mixture_cpu.yaml" else 8)
  check_batch_layout(cfg, shape)
  if name.startswith("mixture"):                 # the reproduction (docs/results.md)
    assert os.path.isdir(resolve_model_path(cfg.model))          # the shipped backbone
    if name == "mixture_cpu.yaml":                               # and its shipped data
      assert os.path.isfile(cfg.data.train_path) and os.path.isfile(cfg.data.eval_path)
    # The paper's targets in the CPU default; the GPU recipe asks 0.6 of the sensitive tasks
    # (docs/results.md 4b: 0.7 left them above the claims' MSR 0.75).
    sensitive = 0.7 if name == "mixture_cpu.yaml" else 0.6
    assert cfg.objective.targets == (sensitive, sensitive, 1.0, 1.0, 1.0)
    assert cfg.router.streaming.block * cfg.router.local_blocks == 64
  elif name != "tiny.yaml":                      # the recipe: docs/method.md §7, 8 GPUs
    assert shape == {"data": 1, "fsdp": 4, "sequence": 2, "tensor": 1}
    assert (cfg.data.seq_len, cfg.data.global_batch, cfg.train.steps) == (65536, 48, 300)
    assert (cfg.train.lr, cfg.train.lambda_lr) == (5e-4, 1e-3)
    assert cfg.objective.targets == (0.7, 0.7, 1.0, 1.0, 1.0)
    assert cfg.router.streaming.block * cfg.router.local_blocks == 2048
    assert cfg.data.train_path is not None and not cfg.model.random_init


def test_tiny_is_the_cpu_smoke_run():
  cfg = load_run_config(TINY, [])
  assert cfg.model.random_init and cfg.data.train_path is None
  assert resolve_model_path(cfg.model) == os.path.join(ROOT, "configs", "tiny_qwen3.json")
  assert cfg.tokenizer_dir is None
  assert (cfg.data.seq_len, cfg.data.global_batch, cfg.data.max_segments) == (128, 8, 2)
  assert cfg.checkpoint_dir == os.path.join("runs/tiny", "checkpoints")


def test_overrides_apply():
  cfg = load_run_config(TINY, [
      "train.steps=300", "train.lr=5e-4", "mesh={fsdp: 4, sequence: 2}",
      "objective.targets=[0.7,0.7,1,1,1]", "log.tensorboard=true", "data.train_path=x.jsonl",
      "data.train_path=null", "data.synthetic.prompt_frac=0.5", "data.use_chat_template=true",
      "data.micro_batch=4", "seed=3", "model.attn_impl=dense", "data.max_segments=4",
      "model.dtype=auto", "export.overwrite=true"])
  assert cfg.train.steps == 300 and cfg.train.lr == 5e-4
  assert dataclasses.asdict(cfg.mesh) == {"data": 1, "fsdp": 4, "sequence": 2, "tensor": 1}
  assert cfg.objective.targets == (0.7, 0.7, 1.0, 1.0, 1.0)
  assert all(type(t) is float for t in cfg.objective.targets)
  assert cfg.log.tensorboard is True and cfg.data.train_path is None
  assert cfg.data.synthetic.prompt_frac == 0.5 and cfg.data.synthetic.eval_batches == 4
  assert cfg.data.use_chat_template is True and cfg.data.micro_batch == 4 and cfg.seed == 3
  assert cfg.model.attn_impl == "dense" and cfg.data.max_segments == 4
  assert cfg.model.dtype == "auto" and cfg.export.overwrite is True   # the checkpoint's dtype
  assert cfg.router.block == 8                   # untouched keys keep the file's values
  defaults = load_run_config(None, ["model.path=m"])
  assert defaults == RunConfig(ModelSource(os.path.abspath("m")))   # inputs made absolute
  assert defaults.train.lr == TrainConfig().lr


def test_unknown_keys(tmp_path):
  path = write(tmp_path, "model: {path: m}\ntrain:\n  stpes: 3\n")
  msg = fails(r"unknown key 'train\.stpes' \(did you mean 'train\.steps'\?\)", path)
  assert msg.startswith(path)
  fails(r"^run config \(with override 'trian\.steps=3'\): unknown key 'trian' "
        r"\(did you mean 'train'\?\)", None, ["model.path=m", "trian.steps=3"])
  msg = fails(r"^override 'data\.synthetic\.zzz=1': unknown key 'data\.synthetic\.zzz' "
              r"\(valid keys in 'data\.synthetic': prompt_frac, eval_batches\)", None,
              ["model.path=m", "data.synthetic.zzz=1"])
  # Keys of earlier versions say where their setting went.
  fails(r"key 'train\.remat' is no longer read \(set model\.remat\)", None,
        ["model.path=m", "train.remat=false"])
  fails(r"'router\.max_segments' is no longer read \(set data\.max_segments\)", None,
        ["model.path=m", "router.max_segments=3"])
  fails(r"'router\.setting' is no longer read \(renamed router\.patterns\)", None,
        ["model.path=m", "router.setting=fa-xa"])
  fails(r"'data\.mixture' is no longer read \(removed: write the task mixture", None,
        ["model.path=m", "data.mixture.per_task=3"])
  fails(r"required key 'model\.path' is missing", None)


@pytest.mark.parametrize("text,match", [
    ("train: {steps: '300'}", r"key 'train\.steps' should be an integer, got '300'"),
    ("train: {steps: 3.5}", r"key 'train\.steps' should be an integer, got 3\.5"),
    ("train: {lr: true}", r"key 'train\.lr' should be a number, got True"),
    ("log: {jsonl: 1}", r"key 'log\.jsonl' should be true or false, got 1"),
    ("objective: {targets: [0.7, x]}", r"key 'objective\.targets\[1\]' should be a number"),
    ("objective: {targets: 0.7}", r"key 'objective\.targets' should be a list of numbers"),
    ("data: {micro_batch: '4'}", r"key 'data\.micro_batch' should be an integer or null"),
    ("data: {overlong: trim}",
     r"key 'data\.overlong' should be one of 'truncate_middle', 'skip', got 'trim'"),
    ("data: {use_chat_template: maybe}",
     r"key 'data\.use_chat_template' should be true or false or 'auto', got 'maybe'"),
    ("seed: 1\nseed: 2", r"not valid YAML \(line 3: key 'seed' appears twice"),
    ("mesh: 8", r"'mesh' should be a mapping of keys to values, got 8"),
    ("router: {pooling: max}", r"section 'router': router pooling 'max' is unknown"),
    ("mesh: {fsdp: -1, data: -1}", r"section 'mesh': at most one mesh axis may be -1"),
    ("data: {global_batch: 48, micro_batch: 5}", r"section 'data': micro_batch \(5\)"),
])
def test_wrong_values_name_the_key(tmp_path, text, match):
  path = write(tmp_path, "model: {path: m}\n" + text + "\n")
  assert fails(match, path).startswith(path + ": ")


def test_wrong_override_values():
  fails(r"^override 'train\.steps=abc': key 'train\.steps' should be an integer, got 'abc'",
        TINY, ["train.steps=abc"])
  fails(r"tiny\.yaml \(with override 'router\.pooling=max'\): section 'router': router "
        r"pooling 'max' is unknown", TINY, ["router.pooling=max"])
  fails(r"^override 'model\.attn_impl=flash': key 'model\.attn_impl' should be one of "
        r"'auto', 'reference', 'dense', 'pallas_gpu', 'mosaic_gpu', 'pallas_tpu', "
        r"got 'flash'$", TINY, ["model.attn_impl=flash"])
  fails(r"override 'train\.steps': expected section\.key=value", TINY, ["train.steps"])
  fails(r"override 'train\.lr=\[1': the value is not valid YAML", TINY, ["train.lr=[1"])
  fails(r"override 'seed\.x=1': 'seed' is not a section", TINY, ["seed=1", "seed.x=1"])


def test_malformed_files(tmp_path):
  path = write(tmp_path, "model:\n  path: m\ntrain:\n  steps: [1, 2\n  lr: 3\n")
  msg = fails(r"not valid YAML \(line \d+", path)
  assert msg.startswith(path)
  path = write(tmp_path, "model: {path: m}\ntrain:\n  steps: 1\n  steps: 2\n", "dup.yaml")
  fails(r"dup\.yaml: not valid YAML \(line 4: key 'steps' appears twice", path)
  fails(r"top level should be a mapping", write(tmp_path, "- 1\n", "list.yaml"))
  fails(r"no such config file", str(tmp_path / "absent.yaml"))
  # Plain YAML 1.1 would read these as a string and a date.
  cfg = load_run_config(write(tmp_path, "model: {path: m}\ntrain: {lr: 1e-3}\n"
                                        "run_dir: 2024-01-01\n", "ok.yaml"), [])
  assert cfg.train.lr == 1e-3 and cfg.run_dir == "2024-01-01"


@pytest.mark.parametrize("path", SHIPPED, ids=os.path.basename)
def test_dump_load_round_trip(tmp_path, path):
  cfg = load_run_config(path, ["run_dir=1e3", "data.tokenizer='true'", "train.lr=1e-7",
                               "data.use_chat_template=false", "log.dir=2024-01-01"])
  out = tmp_path / "sub" / "config.yaml"
  dump_run_config(cfg, out)
  dump_run_config(cfg, out)                      # replaces the file in place
  assert load_run_config(str(out), []) == cfg
  assert os.listdir(out.parent) == ["config.yaml"]
  plain = run_config_to_dict(cfg)
  assert "attn_impl" in plain["model"] and "max_segments" in plain["data"]
  assert plain["objective"]["targets"] == list(cfg.objective.targets)


def test_mesh_resolution():
  assert resolve_mesh_shape(MeshConfig(), 8) == {"data": 1, "fsdp": 8, "sequence": 1,
                                                 "tensor": 1}
  assert list(resolve_mesh_shape(MeshConfig(), 1)) == list(MESH_AXES)
  assert resolve_mesh_shape(MeshConfig(data=2, fsdp=2, sequence=2), 8)["tensor"] == 1
  shape = resolve_mesh_shape(MeshConfig(tensor=-1, fsdp=2), 8)
  assert shape["tensor"] == 4
  assert make_mesh(shape, jax.devices()[:8]).shape["tensor"] == 4
  with pytest.raises(ElasticJaxError, match=r"fixed axes use 3 devices.*8 available"):
    resolve_mesh_shape(MeshConfig(sequence=3), 8)
  with pytest.raises(ElasticJaxError, match=r"uses 4 devices but 8 are available"):
    resolve_mesh_shape(MeshConfig(fsdp=2, sequence=2), 8)
  assert [f.name for f in dataclasses.fields(MeshConfig)] == list(MESH_AXES)


def test_batch_layout():
  cfg = load_run_config(TINY, ["data.global_batch=6"])
  with pytest.raises(ElasticJaxError, match=r"data\.global_batch \(6\).*data x fsdp \(4\)"):
    check_batch_layout(cfg, {"fsdp": 4})
  cfg = load_run_config(TINY, ["data.seq_len=100"])
  with pytest.raises(ElasticJaxError, match=r"data\.seq_len \(100\).*mesh\.sequence \(8\)"):
    check_batch_layout(cfg, {"sequence": 8})


def test_input_paths_are_relative_to_the_config_file(tmp_path, monkeypatch):
  """In a file, input paths are relative to the file (or package:); on the command line, to
  the working directory; outputs stay relative to the working directory."""
  sub = tmp_path / "cfgs"
  sub.mkdir()
  path = write(sub, "model: {path: ../models/m}\ndata: {train_path: d/train.jsonl}\n"
                    "run_dir: runs/x\n")
  monkeypatch.chdir(tmp_path)
  cfg = load_run_config(path, [])
  assert cfg.model.path == str(tmp_path / "models" / "m")
  assert cfg.data.train_path == str(sub / "d" / "train.jsonl")
  assert cfg.run_dir == "runs/x"
  cfg = load_run_config(path, ["data.train_path=here.jsonl", "model.path=package:repro/backbone"])
  assert cfg.data.train_path == str(tmp_path / "here.jsonl")
  assert cfg.model.path == os.path.join(ROOT, "elastic_jax", "repro", "backbone")


def test_model_paths(tmp_path):
  assert load_run_config(None, [f"model.path={tmp_path}"]).tokenizer_dir == str(tmp_path)
  assert resolve_model_path(ModelSource(str(tmp_path))) == str(tmp_path)
  with pytest.raises(ElasticJaxError, match=r"model\.path '.*absent': no such model directory"):
    resolve_model_path(ModelSource(str(tmp_path / "absent")))
  with pytest.raises(ElasticJaxError, match=r"no such config JSON"):
    resolve_model_path(ModelSource("absent.json"))


def test_attn_impl_choices_match_the_kernels():
  known = set(attention.IMPLS) | set(attention.HYBRID_IMPLS)
  assert set(typing.get_args(AttnImpl)) == known
