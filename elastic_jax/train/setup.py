"""Setting up a router-training run: preflight checks, the mesh and its shardings, the frozen
backbone placed on it, the data (our JSONL, the authors' parquet, or synthetic rows) and the
batch layout. train/loop.py runs the loop on what this builds.
"""

from __future__ import annotations

import os
from typing import Iterator

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from elastic_jax import router_io, sharding
from elastic_jax.config import ModelConfig, read_config_file, read_hf_config
from elastic_jax.errors import ElasticJaxError
from elastic_jax.files import check_apart, check_creatable
from elastic_jax.model import abstract_params, init_params
from elastic_jax.train.config_schema import RunConfig
from elastic_jax.train.step import init_train_state
from elastic_jax.train.synthetic import synthetic_batch


def preflight(cfg: RunConfig) -> ModelConfig:
  """Checks what can be checked before the backbone loads and before anything is written:
  the model's config, the logging backend, the tokenizer against the model's vocabulary,
  outputs apart from the inputs, the full-model export. Returns the model config."""
  path = cfg.model.resolved_path
  mcfg = (read_config_file(path) if cfg.model.random_init else read_hf_config(path))[0]
  if cfg.log.tensorboard:
    try:
      import tensorboardX  # noqa: F401 - only whether it is installed
    except ImportError:
      raise ElasticJaxError("log.tensorboard needs tensorboardX: pip install "
                            "'elastic-jax[tensorboard]', or set log.tensorboard=false") from None
  for data_path, key in ((cfg.data.train_path, "data.train_path"),
                         (cfg.data.eval_path, "data.eval_path")):
    if data_path is not None and not os.path.exists(data_path):
      raise ElasticJaxError(f"{key} '{data_path}': no such file or directory")
  for out, key in ((cfg.run_dir, "run_dir"), (cfg.log_dir, "log.dir"),
                   (cfg.export_dir, "export.dir"), (cfg.checkpoint_dir, "checkpoint.dir")):
    if "://" not in out:   # every output folder can be made: found before any work is done
      check_creatable(out, key)
  uses_tokenizer = cfg.data.train_path is not None
  if uses_tokenizer and cfg.tokenizer_dir is not None:
    from elastic_jax.tokenizer import check_vocabulary, load_tokenizer
    check_vocabulary(load_tokenizer(cfg.tokenizer_dir), mcfg.vocab_size, cfg.tokenizer_dir)
  inputs = [None if cfg.model.random_init else path, cfg.data.train_path, cfg.data.eval_path,
            cfg.data.tokenizer]
  for out, what in ((cfg.export_dir, "export.dir"), (cfg.checkpoint_dir, "checkpoint.dir"),
                    (cfg.log_dir, "log.dir"), (cfg.run_dir, "run_dir")):
    try:
      check_apart(out, inputs, "an input of the run (model, data or tokenizer)")
    except ElasticJaxError as e:
      raise ElasticJaxError(f"{what} {e}") from None
  for layout, target in export_targets(cfg).items():
    check_export_target(cfg, layout, target, read_export_manifest(cfg.export_dir))
  if cfg.export.full_model:
    if jax.process_count() > 1:
      raise ElasticJaxError("export.full_model runs in a single process; on many hosts, merge "
                            "the exported routers afterwards with python -m elastic_jax.convert "
                            "MODEL OUT --to-hf --routers EXPORT_DIR/elastic_jax")
  return mcfg


# EXPORT_DIR/.exports.json: the files each export folder received from a train run, so that a
# later run replaces its own exports (a resumed run exports again) but not what a user keeps
# there.
EXPORT_MANIFEST = ".exports.json"
# What exports wrote before the record was kept, recognised by their files.
_EXPORT_FILES = {"ours": {"routers.json", "routers.safetensors"},
                 "authors": {"routers.safetensors", "config_extra.json"}}


def export_targets(cfg: RunConfig) -> dict[str, str]:
  """{layout: folder} of what cfg.export writes at the end of the run."""
  targets = {}
  if cfg.export.ours:
    targets["ours"] = os.path.join(cfg.export_dir, "elastic_jax")
  if cfg.export.authors and router_io.authors_layout_problem(cfg.router) is None:
    targets["authors"] = os.path.join(cfg.export_dir, "authors")
  if cfg.export.full_model:
    targets["full_model"] = os.path.join(cfg.export_dir, "full_model")
  return targets


def files_under(directory: str) -> list[str]:
  """The files under `directory`, as sorted paths relative to it."""
  out = []
  for root, dirs, files in os.walk(directory):
    for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
      out.append(os.path.relpath(os.path.join(root, name), directory))
  return sorted(out)


def read_export_manifest(export_dir: str) -> dict[str, list[str]]:
  """{folder name: its files} of the exports a train run wrote in `export_dir`."""
  import json
  try:
    with open(os.path.join(export_dir, EXPORT_MANIFEST), encoding="utf-8") as f:
      manifest = json.load(f)
  except (OSError, ValueError):
    return {}
  return manifest if isinstance(manifest, dict) else {}


def check_export_target(cfg: RunConfig, layout: str, target: str,
                        manifest: dict[str, list[str]]) -> None:
  """Refuses an export folder that holds files no train run exported there (a user's), unless
  export.overwrite: the export replaces its folder whole."""
  if not os.path.lexists(target) or cfg.export.overwrite:
    return
  if os.path.isdir(target) and not os.path.islink(target):
    files = set(files_under(target))
    ours = set(manifest.get(os.path.basename(target), ())) | _EXPORT_FILES.get(layout, set())
    if files <= ours:
      return
    example = f" (e.g. {sorted(files - ours)[0]})"
  else:
    example = " (not a folder)"
  key = "export.ours" if layout == "ours" else f"export.{layout}"
  raise ElasticJaxError(f"{key}: {target} holds what no train run exported there{example}; "
                        "move it away, or set export.overwrite=true to replace it")


def mesh_layout(cfg: RunConfig, devices=None):
  """The run's mesh over `devices` (default: all): (axis sizes, mesh, sharding rules, number of
  micro-batch passes per step or None). Checks that the batch splits over it."""
  mesh_shape = cfg.mesh_shape(jax.device_count() if devices is None else len(devices))
  mesh = sharding.make_mesh(mesh_shape, devices)
  return mesh_shape, mesh, sharding.rules_for(mesh), cfg.data.micro_steps


def backbone_shardings(mcfg: ModelConfig, dtype: str, mesh):
  """(abstract parameter shapes, their logical axes, their shardings on `mesh`)."""
  shapes, axes = abstract_params(mcfg, dtype)
  return shapes, axes, sharding.param_shardings(axes, mesh, shapes)


def abstract_train_state(cfg: RunConfig, mcfg: ModelConfig, mesh):
  """The train state's shapes, replicated on `mesh` as the run keeps it."""
  replicated = NamedSharding(mesh, PartitionSpec())
  abstract = jax.eval_shape(lambda key: init_train_state(mcfg, cfg.router, cfg.train, key),
                            jax.random.key(0))
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
                      abstract)


def load_backbone(cfg: RunConfig, mesh) -> tuple[ModelConfig, dict]:
  """The frozen backbone, placed on the mesh by its logical axes (random for a config JSON)."""
  path = cfg.model.resolved_path
  if cfg.model.random_init:
    mcfg, raw = read_config_file(path)
    dtype = cfg.model.dtype
    if dtype == "auto":            # the config's own dtype, else float32
      named = raw.get("torch_dtype") or raw.get("dtype")
      dtype = named if named in ("bfloat16", "float32", "float16") else "float32"
    _, _, shardings = backbone_shardings(mcfg, dtype, mesh)
    init = jax.jit(lambda key: init_params(mcfg, key, dtype), out_shardings=shardings)
    return mcfg, init(jax.random.key(cfg.seed + 7919))
  from elastic_jax.elastic_model import from_pretrained
  model = from_pretrained(path, dtype=cfg.model.dtype, show_progress=jax.process_index() == 0)
  _, _, shardings = backbone_shardings(model.config, model.dtype, mesh)
  return model.config, jax.device_put(model.params, shardings)


# A batch's fields (train/step.py) and their types: [rows, T] per token, [rows, slots] task ids.
BATCH_DTYPES = {"input_ids": "int32", "targets": "int32", "loss_mask": "bool",
                "segment_ids": "int32", "positions": "int32", "prompt_mask": "bool",
                "task_ids": "int32"}


def batch_sharding(mesh, micro: bool) -> dict[str, NamedSharding]:
  """Rows over data x fsdp, tokens over sequence; task ids follow the rows."""
  rows = tuple(a for a in ("data", "fsdp") if mesh.shape[a] > 1) or None
  seq = "sequence" if mesh.shape["sequence"] > 1 else None
  lead = (None,) if micro else ()
  tokens = NamedSharding(mesh, PartitionSpec(*lead, rows, seq))
  slots = NamedSharding(mesh, PartitionSpec(*lead, rows, None))
  return {k: slots if k == "task_ids" else tokens for k in BATCH_DTYPES}


def to_global(local: dict[str, np.ndarray], shardings, micro: int | None) -> dict:
  """This process's rows -> global arrays; micro-batched as [M, rows/M, ...] when asked."""
  out = {}
  for k, x in local.items():
    if micro:
      x = x.reshape(micro, x.shape[0] // micro, *x.shape[1:])
      global_shape = (micro, x.shape[1] * jax.process_count(), *x.shape[2:])
    else:
      global_shape = (x.shape[0] * jax.process_count(), *x.shape[1:])
    out[k] = jax.make_array_from_process_local_data(shardings[k], x, global_shape)
  return out


class SyntheticData:
  """Synthetic two-task rows (train/synthetic.py) with the TrainData interface."""

  def __init__(self, cfg: RunConfig, vocab: int, seed_offset: int = 0):
    self.cfg, self.vocab, self.seed = cfg, vocab, cfg.data.shuffle_seed + seed_offset
    self.step = 0
    self.stats = {"source": "synthetic"}

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    d = self.cfg.data
    b = synthetic_batch(self.step, d.global_batch, d.seq_len, self.vocab,
                        prompt_frac=d.synthetic.prompt_frac, max_segments=d.max_segments,
                        seed=self.seed)
    self.step += 1
    per = d.global_batch // jax.process_count()
    lo = jax.process_index() * per
    return {k: v[lo:lo + per] for k, v in b.items()}

  def state(self) -> dict:
    return {"synthetic_step": self.step, "fingerprint": f"synthetic-{self.seed}"}

  def restore(self, state: dict) -> "SyntheticData":
    if state.get("fingerprint") != f"synthetic-{self.seed}":
      raise ElasticJaxError("the checkpoint's data state is not this run's synthetic data")
    self.step = int(state["synthetic_step"])
    return self

  @property
  def fingerprint(self) -> str:
    return f"synthetic-{self.seed}"


def make_data(cfg: RunConfig, vocab: int, path: str | None, *, eval_split: bool = False):
  if path is None:
    return SyntheticData(cfg, vocab, seed_offset=1000 if eval_split else 0)
  from elastic_jax.train.data import TrainData
  if cfg.tokenizer_dir is None:
    raise ElasticJaxError("data.tokenizer must name a tokenizer dir when the model is a random "
                          "config and data.train_path is set")
  d = cfg.data
  data = TrainData(path, cfg.tokenizer_dir, d.seq_len, d.global_batch, d.max_segments,
                   overlong=d.overlong, seed=d.shuffle_seed + (1 if eval_split else 0),
                   use_chat_template=d.use_chat_template, process_index=jax.process_index(),
                   process_count=jax.process_count(), num_epochs=1 if eval_split else None)
  tokens = data.encoded.tokens
  bad = tokens[(tokens < 0) | (tokens >= vocab)]
  if bad.size:
    raise ElasticJaxError(f"{path}: holds token ids outside the model's vocabulary [0, {vocab}) "
                          f"(e.g. {int(bad[0])}, {bad.size} in all)")
  return data


def data_fingerprint(data) -> str:
  return data.fingerprint if isinstance(data, SyntheticData) else data.state()["fingerprint"]
