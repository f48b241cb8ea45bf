"""Reading and writing train.py's run configuration: a YAML file plus dotted overrides ->
the frozen dataclasses of train/config_schema.py, and back to YAML.

    cfg = load_run_config("configs/tiny.yaml", ["train.steps=300", "mesh.fsdp=4"])

The file has one mapping per section (model, router, objective, train, mesh, data, checkpoint,
log, export) and the top-level keys seed and run_dir. Every key is optional except
model.path; defaults come from the dataclasses. Overrides are `section.key=value`, the value
read as YAML (`objective.targets=[0.7,0.7,1,1,1]`, `data.train_path=null`). An unknown key, a
value of the wrong type or a malformed file fails with one ElasticJaxError naming the file or
override and the dotted key. Input paths are made absolute here, once (`INPUT_PATHS`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import os
import re
import textwrap
import types
import typing
from typing import Any, Literal, Mapping, Sequence

import yaml

from elastic_jax.errors import ElasticJaxError
from elastic_jax.files import atomic_write_text
from elastic_jax.resources import PACKAGE_DIR
from elastic_jax.train.config_schema import MOVED, RunConfig

# Path keys that name inputs. In a config file they are relative to the file's folder (or
# "package:REL", inside the installed elastic_jax package); on the command line, to the
# working directory. Outputs (run_dir, *.dir) are relative to the working directory.
INPUT_PATHS = ("model.path", "data.train_path", "data.eval_path", "data.tokenizer")
PACKAGE_PREFIX = "package:"

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
# The typed builder: a raw tree of YAML values -> the schema's dataclasses


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
  return _convert_scalar(tp, value, key, ctx)


def _convert_scalar(tp, value: Any, key: str, ctx: _Context) -> Any:
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


def _check_key(fields: Mapping[str, Any], name: str, key: str, ctx: _Context) -> str:
  """The dotted key of `name` under section `key`; fails for a moved or unknown key."""
  dotted = _join(key, str(name))
  moved = next((m for m in MOVED if dotted == m or dotted.startswith(m + ".")), None)
  if moved is not None:
    raise ctx.error(dotted, f"key '{dotted}' is no longer read ({MOVED[moved]})")
  if name not in fields:
    close = difflib.get_close_matches(str(name), list(fields), n=3, cutoff=0.6)
    hint = (f"did you mean {', '.join(repr(_join(key, c)) for c in close)}?" if close
            else f"valid keys{f' in {key!r}' if key else ''}: {', '.join(fields)}")
    raise ctx.error(dotted, f"unknown key '{dotted}' ({hint})")
  return dotted


def _build(cls, raw: Any, key: str, ctx: _Context):
  """An instance of dataclass `cls` from the mapping `raw` found at dotted `key`."""
  if raw is None:
    raw = {}
  if not isinstance(raw, dict):
    raise ctx.error(key, f"'{key}' should be a mapping of keys to values, got {raw!r}")
  hints = _hints(cls)
  fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
  kwargs = {}
  for name, value in raw.items():
    dotted = _check_key(fields, name, key, ctx)
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
# The file and the overrides


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


def resolve_input_path(value: str, base: str) -> str:
  """An input path of a config, made absolute: "package:REL" inside the package, absolute as
  is, else relative to `base`. A bare model-config name (tiny_qwen3.json) is left for the
  lookup in the shipped configs."""
  if value.startswith(PACKAGE_PREFIX):
    return os.path.join(PACKAGE_DIR, value[len(PACKAGE_PREFIX):])
  if os.path.isabs(value) or value.endswith(".json") and os.sep not in value:
    return value      # absolute; or a named model config, looked up in configs/ later
  return os.path.normpath(os.path.join(base, value))


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


# ----------------------------------------------------------------------------------------------
# Writing a config back: plain values, a YAML file, the commented listing of --print-config


def _to_plain(obj: Any) -> Any:
  if dataclasses.is_dataclass(obj):
    return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
  if isinstance(obj, (tuple, list)):
    return [_to_plain(v) for v in obj]
  return obj


def run_config_to_dict(cfg: RunConfig) -> dict[str, Any]:
  """Plain nested dicts/lists/scalars, the keys `load_run_config` reads."""
  return _to_plain(cfg)


def dump_run_config(cfg: RunConfig, path: str | os.PathLike) -> None:
  """Writes `cfg` as YAML that `load_run_config` reads back equal; atomically (temp + rename)."""
  path = os.path.abspath(os.fspath(path))
  text = ("# Resolved run configuration, written by elastic_jax; train.py --config reads it.\n"
          + yaml.dump(run_config_to_dict(cfg), Dumper=_Dumper, sort_keys=False,
                      default_flow_style=False, width=100, allow_unicode=True))
  os.makedirs(os.path.dirname(path), exist_ok=True)
  atomic_write_text(path, text)


_FIELD_LINE = re.compile(r"^\s{2}(\w+)\s*:[^#]*?(?:#\s*(.*))?$")
_CONTINUATION = re.compile(r"^\s{3,}#\s*(.*)$")


def _field_comments(cls) -> dict[str, str]:
  """The trailing comment of each field of a dataclass, continuation lines joined."""
  comments: dict[str, str] = {}
  try:
    lines = inspect.getsource(cls).splitlines()
  except (OSError, TypeError):
    return comments
  current = None
  for line in lines[1:]:
    m = _FIELD_LINE.match(line)
    if m and not line.strip().startswith(("def ", "@", '"""')):
      current = m.group(1)
      comments[current] = (m.group(2) or "").strip()
    elif current and (more := _CONTINUATION.match(line)):
      comments[current] += " " + more.group(1).strip()
    else:
      current = None if line.strip() and not line.strip().startswith("#") else current
  return comments


def describe_config(cfg: RunConfig, command: str = "train.py") -> str:
  """`cfg` as YAML with each key's comment on a `#` line above it (train.py --print-config):
  `load_run_config` reads the text back to the same config."""
  out = [f"# The resolved run configuration; {command} --config FILE reads it back."]

  def comment(note: str, indent: str) -> None:
    if note:
      out.extend(textwrap.wrap(note, 98 - len(indent), initial_indent=indent + "# ",
                               subsequent_indent=indent + "# ", break_on_hyphens=False))

  def walk(obj, indent):
    notes = _field_comments(type(obj))
    for f in dataclasses.fields(obj):
      if not f.init:
        continue
      value = getattr(obj, f.name)
      comment(notes.get(f.name, ""), indent)
      if dataclasses.is_dataclass(value):
        out.append(f"{indent}{f.name}:")
        walk(value, indent + "  ")
      else:
        line = yaml.dump({f.name: _to_plain(value)}, Dumper=_Dumper, sort_keys=False,
                         default_flow_style=False, width=10**6, allow_unicode=True)
        out.extend(indent + text for text in line.rstrip("\n").split("\n"))

  walk(cfg, "")
  return "\n".join(out) + "\n"
