"""The run configuration of train.py: a YAML file plus dotted overrides -> frozen dataclasses.

    cfg = load_run_config("configs/tiny.yaml", ["train.steps=300", "mesh.fsdp=4"])

The file has one mapping per section (model, router, objective, train, mesh, data, checkpoint,
log, export) and the top-level keys seed and run_dir. Every key is optional except
model.path; defaults come from the dataclasses (the paper's recipe, docs/method.md §7).
Overrides are `section.key=value`, the value read as YAML (`objective.targets=[0.7,0.7,1,1,1]`,
`data.train_path=null`). An unknown key, a value of the wrong type or a malformed file fails
with one ElasticJaxError naming the file or override and the dotted key.

Three fields of the reused dataclasses are not keys of their own, so they cannot disagree:
Each setting has one key: how the backbone runs is model.attn_impl and model.remat, the
segment slots of a row are data.max_segments. Keys that moved or went away are named with
where they went (`MOVED`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
import types
import typing
from typing import Any, Literal, Mapping, Sequence

import yaml

from elastic_jax.errors import ElasticJaxError
from elastic_jax.files import atomic_write_text
from elastic_jax.resources import CONFIGS_DIR, PACKAGE_DIR
from elastic_jax.router import RouterConfig
from elastic_jax.sharding import MESH_AXES
from elastic_jax.train.objective import ObjectiveConfig
from elastic_jax.train.step import TrainConfig

# Path keys that name inputs. In a config file they are relative to the file's folder (or
# "package:REL", inside the installed elastic_jax package); on the command line, to the
# working directory. Outputs (run_dir, *.dir) are relative to the working directory.
INPUT_PATHS = ("model.path", "data.train_path", "data.eval_path", "data.tokenizer")
PACKAGE_PREFIX = "package:"

# Must match the keys of `elastic_jax.attention.IMPLS | HYBRID_IMPLS` (a test checks).
AttnImpl = Literal["auto", "reference", "dense", "pallas_gpu", "mosaic_gpu", "pallas_tpu"]


@dataclasses.dataclass(frozen=True)
class ModelSource:
  """The frozen backbone."""
  path: str                          # HF or converted model dir, or a config JSON (e.g.
                                     # tiny_qwen3.json, looked up in configs/) for random init
  dtype: Literal["bfloat16", "float32", "float16", "auto"] = "auto"  # backbone parameters;
                                     # auto: the checkpoint's own dtype
  attn_impl: AttnImpl = "auto"       # attention kernels (elastic_jax.attention); auto = fused
  remat: bool = True                 # rematerialise each layer in the backward pass

  def __post_init__(self):
    if not self.path:
      raise ValueError("model path must not be empty")

  @property
  def random_init(self) -> bool:
    """A config JSON names a randomly initialised model; anything else is a checkpoint dir."""
    return self.path.endswith(".json")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Device mesh axis sizes (elastic_jax.sharding); -1 on one axis = the remaining devices."""
  data: int = 1                      # pure data parallelism (parameters replicated)
  fsdp: int = -1                     # batch split, parameters sharded (ZeRO-3 style)
  sequence: int = 1                  # tokens split (sequence parallelism for long rows)
  tensor: int = 1                    # heads / MLP split

  def __post_init__(self):
    sizes = dataclasses.asdict(self)
    bad = [a for a, n in sizes.items() if n < 1 and n != -1]
    if bad:
      raise ValueError(f"mesh axis '{bad[0]}' must be a positive size or -1, got {sizes[bad[0]]}")
    if sum(n == -1 for n in sizes.values()) > 1:
      raise ValueError("at most one mesh axis may be -1 (the remaining devices)")


@dataclasses.dataclass(frozen=True)
class SyntheticConfig:
  """Synthetic two-task batches (train/synthetic.py), used when data.train_path is null."""
  prompt_frac: float = 0.75          # share of each row that is prompt (the rest is answer)
  eval_batches: int = 4              # held-out batches for the before/after MSR report

  def __post_init__(self):
    if not 0.0 < self.prompt_frac < 1.0:
      raise ValueError(f"synthetic prompt_frac must lie in (0, 1), got {self.prompt_frac}")
    if self.eval_batches < 0:
      raise ValueError(f"synthetic eval_batches must be >= 0, got {self.eval_batches}")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Training and evaluation data, packed into rows of seq_len tokens."""
  train_path: str | None = None      # JSONL of task-tagged samples, or the authors' parquet
                                     # data (a file or a directory); null = synthetic batches
  eval_path: str | None = None       # the same, for held-out evaluation; null = none
  tokenizer: str | None = None       # tokenizer dir; null = the model dir
  seq_len: int = 65536               # tokens per packed row
  global_batch: int = 48             # rows per optimizer step
  micro_batch: int | None = None     # rows per forward/backward pass, gradients accumulated
                                     # over global_batch / micro_batch passes; null = all
  max_segments: int = 8              # segment slots per row, slot 0 being padding: a row
                                     # packs up to max_segments - 1 samples
  overlong: Literal["truncate_middle", "skip"] = "truncate_middle"  # a sample > seq_len
  shuffle_seed: int = 0              # order of the samples
  use_chat_template: bool | Literal["auto"] = "auto"  # auto: if the tokenizer has one
  synthetic: SyntheticConfig = dataclasses.field(default_factory=SyntheticConfig)  # no data

  def __post_init__(self):
    if self.seq_len < 2:
      raise ValueError(f"seq_len must be >= 2, got {self.seq_len}")
    if self.global_batch < 1 or self.max_segments < 2:
      raise ValueError(f"global_batch must be >= 1 and max_segments >= 2 (slot 0 is padding), "
                       f"got {self.global_batch} and {self.max_segments}")
    if self.micro_batch is not None and (self.micro_batch < 1
                                         or self.global_batch % self.micro_batch):
      raise ValueError(f"micro_batch ({self.micro_batch}) must be a positive divisor of "
                       f"global_batch ({self.global_batch})")

  @property
  def rows_per_pass(self) -> int:
    return self.micro_batch or self.global_batch


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """Periodic checkpoints of what trains (routers, multipliers, optimizer state, step)."""
  dir: str | None = None             # null = RUN_DIR/checkpoints
  every_steps: int = 50              # save every this many steps (and at the end); 0 = end only
  keep: int = 2                      # most recent checkpoints kept
  async_save: bool = True            # write in the background while training continues
  resume: Literal["auto", "require", "fresh"] = "auto"  # auto: from the latest if any;
                                     # require: fail if none; fresh: refuse a dir that has some

  def __post_init__(self):
    if self.every_steps < 0 or self.keep < 1:
      raise ValueError(f"checkpoint every_steps must be >= 0 and keep >= 1, got "
                       f"{self.every_steps} and {self.keep}")


@dataclasses.dataclass(frozen=True)
class LogConfig:
  """Progress lines and metric files."""
  every_steps: int = 10              # print and record metrics every this many steps
  jsonl: bool = True                 # append metrics to LOG_DIR/metrics.jsonl
  tensorboard: bool = False          # also write TensorBoard event files
  dir: str | None = None             # null = RUN_DIR

  def __post_init__(self):
    if self.every_steps < 1:
      raise ValueError(f"log every_steps must be >= 1, got {self.every_steps}")


@dataclasses.dataclass(frozen=True)
class ExportConfig:
  """What is written at the end of training."""
  ours: bool = True                  # routers + multipliers + router config, our format
  authors: bool = True               # the same under the authors' names (docs/method.md §9),
                                     # when their layout can express the router
  full_model: bool = False           # also the backbone with the routers merged in, the
                                     # authors' full-model layout (EXPORT_DIR/full_model)
  dir: str | None = None             # null = RUN_DIR/export
  overwrite: bool = False            # replace an export folder holding files that no train
                                     # run exported there (else the run refuses it up front)


# Fields of the reused dataclasses that follow another key (dotted key -> the key it follows).
# Keys of earlier versions and where their setting lives now.
MOVED = {"train.attn_impl": "set model.attn_impl", "train.remat": "set model.remat",
         "router.max_segments": "set data.max_segments",
         "router.setting": "renamed router.patterns",
         "log.eval_every_steps": "removed: the held-out MSR is reported at the end of a run",
         "data.mixture": "removed: write the task mixture with python -m elastic_jax.eval.mixture "
                         "OUT_DIR and name OUT_DIR/train.jsonl in data.train_path"}


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Everything one training run needs."""
  model: ModelSource                 # the frozen backbone
  router: RouterConfig = RouterConfig()          # routing and the SSA pattern
  objective: ObjectiveConfig = ObjectiveConfig()  # target MSR per task type
  train: TrainConfig = TrainConfig()  # optimizer, schedules
  mesh: MeshConfig = MeshConfig()    # device mesh
  data: DataConfig = DataConfig()    # data and batch layout
  checkpoint: CheckpointConfig = CheckpointConfig()  # periodic checkpoints and resuming
  log: LogConfig = LogConfig()       # progress and metrics
  export: ExportConfig = ExportConfig()  # final router export
  seed: int = 0                      # router/multiplier init and Gumbel noise
  run_dir: str = "runs/train"        # everything the run writes, unless a section says else

  @property
  def log_dir(self) -> str:
    return self.log.dir or self.run_dir

  @property
  def checkpoint_dir(self) -> str:
    return self.checkpoint.dir or os.path.join(self.run_dir, "checkpoints")

  @property
  def export_dir(self) -> str:
    return self.export.dir or os.path.join(self.run_dir, "export")

  @property
  def tokenizer_dir(self) -> str | None:
    """data.tokenizer, else the model dir; None for a random model with no tokenizer named."""
    return self.data.tokenizer or (None if self.model.random_init else self.model.path)


# ----------------------------------------------------------------------------------------------
# YAML: floats such as 5e-4 are numbers (YAML 1.1 wants 5.0e-4), dates stay strings, and a
# key given twice in one mapping is an error instead of a silent overwrite.

_TIMESTAMP = "tag:yaml.org,2002:timestamp"
_EXP_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$")


def _configure(cls):
  cls.yaml_implicit_resolvers = {
      first: [(tag, rx) for tag, rx in resolvers if tag != _TIMESTAMP]
      for first, resolvers in cls.yaml_implicit_resolvers.items()}
  cls.add_implicit_resolver("tag:yaml.org,2002:float", _EXP_FLOAT, list("-+0123456789."))
  return cls


@_configure
class _Loader(yaml.SafeLoader):

  def construct_mapping(self, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
      key = self.construct_object(key_node, deep=deep)
      if isinstance(key, typing.Hashable):
        if key in seen:
          raise yaml.constructor.ConstructorError(
              None, None, f"key {key!r} appears twice in one mapping", key_node.start_mark)
        seen.add(key)
    return super().construct_mapping(node, deep)


@_configure
class _Dumper(yaml.SafeDumper):

  def represent_list(self, data):
    return self.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True)


_Dumper.add_representer(list, _Dumper.represent_list)


# ----------------------------------------------------------------------------------------------
# The typed builder


class _Mismatch(Exception):
  """A value that does not fit its annotation (turned into an ElasticJaxError by the caller)."""

  def __init__(self, key: str, tp: Any, value: Any):
    super().__init__(key)
    self.key, self.tp, self.value = key, tp, value


@dataclasses.dataclass
class _Context:
  """Where keys came from, for error messages."""
  path: str | None
  overrides: list[tuple[str, str]]   # (dotted key, override text), in order

  def override_text(self, key: str) -> str | None:
    """The raw value text of the last override that set exactly `key`."""
    texts = [text for k, text in self.overrides if k == key]
    return texts[-1].partition("=")[2].strip() if texts else None

  def where(self, key: str) -> str:
    """The override that set `key` (or a section above it), else the file, noting overrides
    below `key`."""
    owner = [text for k, text in self.overrides
             if k == key or key.startswith((k + ".", k + "["))]
    if owner:
      return f"override '{owner[-1]}'"
    base = self.path or "run config"
    below = [text for k, text in self.overrides if not key or k.startswith(key + ".")]
    return f"{base} (with override '{below[-1]}')" if below else base

  def error(self, key: str, msg: str) -> ElasticJaxError:
    return ElasticJaxError(f"{self.where(key)}: {msg}")


def _join(prefix: str, name: str) -> str:
  return f"{prefix}.{name}" if prefix else name


@functools.cache
def _hints(cls) -> dict[str, Any]:
  return typing.get_type_hints(cls)


def _describe(tp) -> str:
  origin, args = typing.get_origin(tp), typing.get_args(tp)
  if origin in (typing.Union, types.UnionType):
    return " or ".join(_describe(a) for a in args)
  if origin is Literal:
    if len(args) == 1:
      return repr(args[0])
    return "one of " + ", ".join(
        ("true" if a else "false") if isinstance(a, bool) else repr(a) for a in args)
  if origin is tuple:
    if len(args) == 2 and args[1] is Ellipsis:
      return {int: "a list of integers", float: "a list of numbers",
              str: "a list of strings"}.get(args[0], "a list")
    return f"a list of {len(args)} values"
  if dataclasses.is_dataclass(tp):
    return "a mapping of keys to values"
  return {int: "an integer", float: "a number", bool: "true or false", str: "a string",
          type(None): "null"}.get(tp, str(tp))


def _convert(tp, value: Any, key: str, ctx: _Context) -> Any:
  """`value` as annotation `tp` demands, with no coercion other than int -> float."""
  origin, args = typing.get_origin(tp), typing.get_args(tp)
  if dataclasses.is_dataclass(tp):
    return _build(tp, value, key, ctx)
  if origin in (typing.Union, types.UnionType):
    for arm in args:
      try:
        return _convert(arm, value, key, ctx)
      except _Mismatch:
        pass
    raise _Mismatch(key, tp, value)
  if origin is Literal:
    if any(type(value) is type(a) and value == a for a in args):
      return value
    raise _Mismatch(key, tp, value)
  if origin is tuple:
    if not isinstance(value, (list, tuple)):
      raise _Mismatch(key, tp, value)
    if len(args) == 2 and args[1] is Ellipsis:
      args = (args[0],) * len(value)
    elif len(args) != len(value):
      raise _Mismatch(key, tp, value)
    return tuple(_convert(a, v, f"{key}[{i}]", ctx) for i, (a, v) in enumerate(zip(args, value)))
  if tp is type(None):
    ok = value is None
  elif tp is float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    value = float(value) if ok else value
  elif tp is int:
    ok = isinstance(value, int) and not isinstance(value, bool)
  elif tp is str:
    # `run_dir=1e3` means the text: a string key set by an override keeps what was typed.
    text = ctx.override_text(key)
    if isinstance(value, (int, float)) and text is not None:
      value = text
    ok = isinstance(value, str)
  elif tp is bool:
    ok = isinstance(value, bool)
  else:
    raise TypeError(f"run_config cannot read the annotation {tp!r} of '{key}'")
  if not ok:
    raise _Mismatch(key, tp, value)
  return value


def _build(cls, raw: Any, key: str, ctx: _Context):
  """An instance of dataclass `cls` from the mapping `raw` found at dotted `key`."""
  if raw is None:
    raw = {}
  if not isinstance(raw, dict):
    raise ctx.error(key, f"'{key}' should be a mapping of keys to values, got {raw!r}")
  hints = _hints(cls)
  fields = {f.name: f for f in dataclasses.fields(cls)
            if f.init}
  kwargs = {}
  for name, value in raw.items():
    dotted = _join(key, str(name))
    if dotted in MOVED or any(dotted.startswith(m + ".") for m in MOVED):
      moved = next(m for m in MOVED if dotted == m or dotted.startswith(m + "."))
      raise ctx.error(dotted, f"key '{dotted}' is no longer read ({MOVED[moved]})")
    if name not in fields:
      close = difflib.get_close_matches(str(name), list(fields), n=3, cutoff=0.6)
      hint = (f"did you mean {', '.join(repr(_join(key, c)) for c in close)}?" if close
              else f"valid keys{f' in {key!r}' if key else ''}: {', '.join(fields)}")
      raise ctx.error(dotted, f"unknown key '{dotted}' ({hint})")
    try:
      kwargs[name] = _convert(hints[name], value, dotted, ctx)
    except _Mismatch as e:
      raise ctx.error(e.key, f"key '{e.key}' should be {_describe(e.tp)}, got {e.value!r}"
                      ) from None
  for name, f in fields.items():
    if (name not in kwargs and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING):
      if dataclasses.is_dataclass(hints[name]):   # a section: name the key missing inside it
        kwargs[name] = _build(hints[name], {}, _join(key, name), ctx)
      else:
        raise ctx.error(_join(key, name), f"required key '{_join(key, name)}' is missing")
  try:
    return cls(**kwargs)
  except ElasticJaxError:
    raise
  except ValueError as e:
    raise ctx.error(key, f"section '{key}': {e}" if key else str(e)) from None


# ----------------------------------------------------------------------------------------------
# Public API


def _yaml_problem(e: yaml.YAMLError) -> str:
  mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
  problem = getattr(e, "problem", None) or str(e).splitlines()[0]
  return f"line {mark.line + 1}: {problem}" if mark is not None else problem


def _read_yaml(path: str) -> dict:
  if not os.path.isfile(path):
    raise ElasticJaxError(f"{path}: no such config file")
  try:
    with open(path, encoding="utf-8") as f:
      raw = yaml.load(f, Loader=_Loader)
  except yaml.YAMLError as e:
    raise ElasticJaxError(f"{path}: not valid YAML ({_yaml_problem(e)})") from None
  except UnicodeDecodeError:
    raise ElasticJaxError(f"{path}: not a UTF-8 text file") from None
  if raw is None:
    return {}
  if not isinstance(raw, dict):
    raise ElasticJaxError(f"{path}: the top level should be a mapping of sections, got "
                          f"{type(raw).__name__}")
  return raw


def _apply_override(raw: dict, text: str) -> str:
  """Sets one `section.key=value` in the raw tree; returns the dotted key."""
  key, sep, value_text = text.partition("=")
  key = key.strip()
  parts = key.split(".")
  if not sep or not all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", p) for p in parts):
    raise ElasticJaxError(f"override '{text}': expected section.key=value, e.g. train.steps=300")
  try:
    value = yaml.load(value_text, Loader=_Loader)
  except yaml.YAMLError as e:
    raise ElasticJaxError(f"override '{text}': the value is not valid YAML "
                          f"({_yaml_problem(e)})") from None
  node = raw
  for i, part in enumerate(parts[:-1]):
    if node.get(part) is None:
      node[part] = {}
    if not isinstance(node[part], dict):
      raise ElasticJaxError(f"override '{text}': '{'.'.join(parts[:i + 1])}' is not a section")
    node = node[part]
  if isinstance(value, dict) and isinstance(node.get(parts[-1]), dict):
    _merge(node[parts[-1]], value)
  else:
    node[parts[-1]] = value
  return key


def _merge(dst: dict, src: dict) -> None:
  for k, v in src.items():
    if isinstance(v, dict) and isinstance(dst.get(k), dict):
      _merge(dst[k], v)
    else:
      dst[k] = v


def load_run_config(path: str | os.PathLike | None, overrides: Sequence[str] = ()) -> RunConfig:
  """The RunConfig of YAML file `path` (None: defaults only) with `overrides` applied in order.

  Raises ElasticJaxError naming the file or override and the dotted key at fault.
  """
  path = os.fspath(path) if path is not None else None
  raw = _read_yaml(path) if path is not None else {}
  from_file = {key: _get_dotted(raw, key) for key in INPUT_PATHS}
  applied = [(_apply_override(raw, text), text) for text in overrides]
  overridden = {k for k, _ in applied}
  for key in INPUT_PATHS:
    value = _get_dotted(raw, key)
    if not isinstance(value, str) or not value:
      continue
    from_the_file = key not in overridden and from_file.get(key) == value
    base = os.path.dirname(os.path.abspath(path)) if from_the_file else os.getcwd()
    _set_dotted(raw, key, resolve_input_path(value, base))
  return _build(RunConfig, raw, "", _Context(path, applied))


def resolve_input_path(value: str, base: str) -> str:
  """An input path of a config, made absolute: "package:REL" inside the package, absolute as
  is, else relative to `base`. A bare model-config name (tiny_qwen3.json) is left for the
  lookup in the shipped configs."""
  if value.startswith(PACKAGE_PREFIX):
    return os.path.join(PACKAGE_DIR, value[len(PACKAGE_PREFIX):])
  if os.path.isabs(value) or value.endswith(".json") and os.sep not in value:
    return value      # absolute; or a named model config, looked up in configs/ later
  return os.path.normpath(os.path.join(base, value))


def _get_dotted(raw: dict, key: str):
  node = raw
  for part in key.split("."):
    if not isinstance(node, dict) or part not in node:
      return None
    node = node[part]
  return node


def _set_dotted(raw: dict, key: str, value) -> None:
  *parents, last = key.split(".")
  node = raw
  for part in parents:
    node = node[part]
  node[last] = value


def _to_plain(obj: Any, key: str) -> Any:
  if dataclasses.is_dataclass(obj):
    return {f.name: _to_plain(getattr(obj, f.name), _join(key, f.name))
            for f in dataclasses.fields(obj) if f.init}
  if isinstance(obj, (tuple, list)):
    return [_to_plain(v, key) for v in obj]
  return obj


def run_config_to_dict(cfg: RunConfig) -> dict[str, Any]:
  """Plain nested dicts/lists/scalars, the keys `load_run_config` reads."""
  return _to_plain(cfg, "")


def dump_run_config(cfg: RunConfig, path: str | os.PathLike) -> None:
  """Writes `cfg` as YAML that `load_run_config` reads back equal; atomically (temp + rename)."""
  path = os.path.abspath(os.fspath(path))
  text = ("# Resolved run configuration, written by elastic_jax; train.py --config reads it.\n"
          + yaml.dump(run_config_to_dict(cfg), Dumper=_Dumper, sort_keys=False,
                      default_flow_style=False, width=100, allow_unicode=True))
  os.makedirs(os.path.dirname(path), exist_ok=True)
  atomic_write_text(path, text)


def resolve_mesh_shape(mesh: MeshConfig, n_devices: int) -> dict[str, int]:
  """Axis sizes for `sharding.make_mesh`, the -1 axis taking the remaining devices."""
  sizes = {a: getattr(mesh, a) for a in MESH_AXES}
  fixed = 1
  for n in sizes.values():
    fixed *= n if n != -1 else 1
  text = " ".join(f"{a}={n}" for a, n in sizes.items())
  free = [a for a, n in sizes.items() if n == -1]
  if free:
    if n_devices % fixed:
      raise ElasticJaxError(f"mesh {text}: the fixed axes use {fixed} devices, which does not "
                            f"divide the {n_devices} available")
    sizes[free[0]] = n_devices // fixed
  elif fixed != n_devices:
    raise ElasticJaxError(f"mesh {text} uses {fixed} devices but {n_devices} are available "
                          "(set one axis to -1 to take the rest)")
  return sizes


def check_batch_layout(cfg: RunConfig, mesh_shape: Mapping[str, int]) -> None:
  """Rows per pass must split over data x fsdp, and seq_len over the sequence axis."""
  rows = mesh_shape.get("data", 1) * mesh_shape.get("fsdp", 1)
  if cfg.data.rows_per_pass % rows:
    which = "micro_batch" if cfg.data.micro_batch else "global_batch"
    raise ElasticJaxError(f"data.{which} ({cfg.data.rows_per_pass}) must be a multiple of "
                          f"mesh data x fsdp ({rows})")
  seq = mesh_shape.get("sequence", 1)
  if cfg.data.seq_len % seq:
    raise ElasticJaxError(f"data.seq_len ({cfg.data.seq_len}) must be a multiple of "
                          f"mesh.sequence ({seq})")


def resolve_model_path(model: ModelSource) -> str:
  """The existing file (random init) or directory (checkpoint) that `model.path` names.

  A config JSON that is not found as given is looked up in the repository's configs/.
  """
  if model.random_init:
    for candidate in (model.path, os.path.join(CONFIGS_DIR, model.path)):
      if os.path.isfile(candidate):
        return candidate
    raise ElasticJaxError(f"model.path '{model.path}': no such config JSON (looked here and "
                          f"in {CONFIGS_DIR})")
  if not os.path.isdir(model.path):
    raise ElasticJaxError(f"model.path '{model.path}': no such model directory (download or "
                          "convert the checkpoint there, or pass model.path=DIR)")
  return model.path


def _field_comments(cls) -> dict[str, str]:
  """The trailing comment of each field of a dataclass, continuation lines joined."""
  import inspect
  import re
  comments: dict[str, str] = {}
  try:
    lines = inspect.getsource(cls).splitlines()
  except (OSError, TypeError):
    return comments
  current = None
  for line in lines[1:]:
    m = re.match(r"^\s{2}(\w+)\s*:[^#]*?(?:#\s*(.*))?$", line)
    if m and not line.strip().startswith(("def ", "@", '"""')):
      current = m.group(1)
      comments[current] = (m.group(2) or "").strip()
    elif current and re.match(r"^\s{3,}#\s*(.*)$", line):
      comments[current] += " " + re.match(r"^\s{3,}#\s*(.*)$", line).group(1).strip()
    else:
      current = None if line.strip() and not line.strip().startswith("#") else current
  return comments


def describe_config(cfg: RunConfig, command: str = "train.py") -> str:
  """`cfg` as YAML with each key's comment on a `#` line above it (train.py --print-config):
  `load_run_config` reads the text back to the same config."""
  import textwrap
  out = [f"# The resolved run configuration; {command} --config FILE reads it back."]

  def comment(note: str, indent: str) -> None:
    if note:
      out.extend(textwrap.wrap(note, 98 - len(indent), initial_indent=indent + "# ",
                               subsequent_indent=indent + "# ", break_on_hyphens=False))

  def walk(obj, prefix, indent):
    notes = _field_comments(type(obj))
    for f in dataclasses.fields(obj):
      if not f.init:
        continue
      value = getattr(obj, f.name)
      comment(notes.get(f.name, ""), indent)
      if dataclasses.is_dataclass(value):
        out.append(f"{indent}{f.name}:")
        walk(value, _join(prefix, f.name), indent + "  ")
      else:
        line = yaml.dump({f.name: _to_plain(value, _join(prefix, f.name))}, Dumper=_Dumper,
                         sort_keys=False, default_flow_style=False, width=10**6,
                         allow_unicode=True)
        out.extend(indent + text for text in line.rstrip("\n").split("\n"))

  walk(cfg, "", "")
  return "\n".join(out) + "\n"
