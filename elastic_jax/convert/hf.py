"""Hugging Face checkpoint <-> elastic_jax parameters, through one name table.

Each row of the table names one of our parameters, the HF tensor it comes from (per layer for
the stacked [L, ...] parameters) and how the layout changes:
  copy    same shape;
  flat    HF keeps a flat vector of our [heads, head_dim] bias;
  linear  HF `nn.Linear.weight` is [out, in]; ours is [in..., out...] with `in_dims` leading
          input axes (e.g. q: HF [N*H, E] -> ours [E, N, H]; o: HF [E, N*H] -> ours [N, H, E]).
Every transform is a transpose plus a reshape, so a round trip is bit-exact.

Loading reads one tensor at a time (safetensors are memory-mapped), fills one of our leaves,
moves it to the device and frees the host copy: peak host memory is about one model copy.
Before any tensor is read, the whole checkpoint is checked: missing, unmapped, duplicated or
mis-shaped tensors are reported by name.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import warnings
from typing import Any, Callable

import jax
import ml_dtypes
import numpy as np

from elastic_jax.config import ModelConfig
from elastic_jax.errors import ElasticJaxError
from elastic_jax.model import Params, abstract_params
from elastic_jax.progress import progress

SAFE_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
# Buffers some older checkpoints carry; they are recomputed from the config.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)

_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


@dataclasses.dataclass(frozen=True)
class Row:
  path: tuple[str, ...]   # key path in our parameter tree
  hf: str                 # HF tensor name; "{i}" is the layer index of stacked parameters
  kind: str = "copy"      # copy | flat | linear
  in_dims: int = 1        # linear only: number of leading input axes in our layout

  @property
  def stacked(self) -> bool:
    return "{i}" in self.hf

  def hf_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
    """The HF shape of one tensor whose layout in our tree (one layer) is `ours`."""
    if self.kind == "copy":
      return ours
    if self.kind == "flat":
      return (math.prod(ours),)
    return (math.prod(ours[self.in_dims:]), math.prod(ours[:self.in_dims]))

  def to_ours(self, x: np.ndarray, ours: tuple[int, ...]) -> np.ndarray:
    if self.kind == "linear":
      x = x.T
    return x.reshape(ours)

  def to_hf(self, x: np.ndarray) -> np.ndarray:
    if self.kind == "flat":
      return x.reshape(-1)
    if self.kind == "linear":
      return np.ascontiguousarray(
          x.reshape(math.prod(x.shape[:self.in_dims]), -1).T)
    return x


def name_table(cfg: ModelConfig) -> list[Row]:
  """The rows that `cfg` needs, in the order HF lists tensors."""
  p = "model.layers.{i}."
  rows = [Row(("embed",), "model.embed_tokens.weight")]
  rows.append(Row(("layers", "attn_norm", "scale"), p + "input_layernorm.weight"))
  for name, heads in (("q", None), ("k", None), ("v", None)):
    rows.append(Row(("layers", "attn", f"{name}_kernel"), p + f"self_attn.{name}_proj.weight",
                    "linear", 1))
    if cfg.attention_bias:
      rows.append(Row(("layers", "attn", f"{name}_bias"), p + f"self_attn.{name}_proj.bias",
                      "flat"))
  rows.append(Row(("layers", "attn", "o_kernel"), p + "self_attn.o_proj.weight", "linear", 2))
  if cfg.attention_bias:
    rows.append(Row(("layers", "attn", "o_bias"), p + "self_attn.o_proj.bias"))
  if cfg.qk_norm:
    rows.append(Row(("layers", "attn", "q_norm", "scale"), p + "self_attn.q_norm.weight"))
    rows.append(Row(("layers", "attn", "k_norm", "scale"), p + "self_attn.k_norm.weight"))
  rows.append(Row(("layers", "mlp_norm", "scale"), p + "post_attention_layernorm.weight"))
  for name in ("gate", "up", "down"):
    rows.append(Row(("layers", "mlp", f"{name}_kernel"), p + f"mlp.{name}_proj.weight",
                    "linear", 1))
    if cfg.mlp_bias:
      rows.append(Row(("layers", "mlp", f"{name}_bias"), p + f"mlp.{name}_proj.bias"))
  rows.append(Row(("final_norm", "scale"), "model.norm.weight"))
  if not cfg.tie_word_embeddings:
    rows.append(Row(("lm_head",), "lm_head.weight", "linear", 1))
  return rows


def _hf_names(row: Row, cfg: ModelConfig) -> list[str]:
  return [row.hf.format(i=i) for i in range(cfg.num_layers)] if row.stacked else [row.hf]


def _get_path(tree: Params, path: tuple[str, ...]):
  for key in path:
    tree = tree[key]
  return tree


def _set_path(tree: Params, path: tuple[str, ...], value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


# ----------------------------------------------------------------------------------------------
# Reading checkpoints


class TensorSource:
  """Name -> tensor access over the weight files of one HF directory, read lazily."""

  def __init__(self, directory: str, allow_pickle: bool = False):
    self.directory = directory
    self._files: dict[str, str] = {}  # tensor name -> file
    self._handles: dict[str, Any] = {}
    self._pickled: dict[str, dict] = {}
    safetensors = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    bins = sorted(glob.glob(os.path.join(directory, "*.bin")))
    if safetensors:
      self._open_safetensors(safetensors)
    elif bins and not allow_pickle:
      raise ElasticJaxError(
          f"{directory}: holds only PyTorch pickle weights (*.bin), which can execute code "
          "when loaded; convert them to safetensors, or pass allow_pickle=True "
          "(--allow-pickle) to load them with torch.load(weights_only=True)")
    elif bins:
      self._open_pickles(bins)
    else:
      raise ElasticJaxError(f"{directory}: no *.safetensors weight files found")
    self._check_index()

  def _register(self, name: str, path: str) -> None:
    if name in self._files:
      raise ElasticJaxError(
          f"{self.directory}: tensor '{name}' appears twice, in "
          f"{os.path.basename(self._files[name])} and {os.path.basename(path)}")
    self._files[name] = path

  def _open_safetensors(self, paths: list[str]) -> None:
    from safetensors import safe_open
    for path in paths:
      try:
        handle = safe_open(path, framework="np")
        names = list(handle.keys())
      except Exception as e:  # the library raises several types for corrupt files
        raise ElasticJaxError(f"{path}: not a readable safetensors file ({e})") from None
      self._handles[path] = handle
      for name in names:
        self._register(name, path)

  def _open_pickles(self, paths: list[str]) -> None:
    try:
      import torch
    except ImportError:
      raise ElasticJaxError("loading *.bin weights needs PyTorch: pip install "
                            "'elastic-jax[torch]', or convert the checkpoint to safetensors "
                            "instead") from None
    for path in paths:
      try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
      except Exception as e:
        raise ElasticJaxError(f"{path}: could not be read as a weights-only pickle ({e})"
                              ) from None
      self._pickled[path] = state
      for name in state:
        self._register(name, path)

  def _check_index(self) -> None:
    for index_name in (SAFE_INDEX, BIN_INDEX):
      index_path = os.path.join(self.directory, index_name)
      if not os.path.exists(index_path):
        continue
      try:
        with open(index_path) as f:
          weight_map = json.load(f)["weight_map"]
      except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ElasticJaxError(f"{index_path}: not a valid index file ({e!r})") from None
      for name, fname in weight_map.items():
        actual = self._files.get(name)
        if actual is None:
          raise ElasticJaxError(
              f"{index_path}: lists tensor '{name}' in {fname}, but no weight file holds it")
        if os.path.basename(actual) != fname:
          raise ElasticJaxError(
              f"{index_path}: lists tensor '{name}' in {fname}, but it is in "
              f"{os.path.basename(actual)}")

  @property
  def names(self) -> set[str]:
    return set(self._files)

  def shape(self, name: str) -> tuple[int, ...]:
    path = self._files[name]
    if path in self._handles:
      return tuple(self._handles[path].get_slice(name).get_shape())
    return tuple(self._pickled[path][name].shape)

  def get(self, name: str) -> np.ndarray:
    path = self._files[name]
    if path in self._handles:
      return self._handles[path].get_tensor(name)
    t = self._pickled[path][name]
    import torch
    if t.dtype == torch.bfloat16:
      return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()

  def dtype(self) -> str:
    """The checkpoint's dtype name, read from its embedding table."""
    name = "model.embed_tokens.weight"
    name = name if name in self._files else sorted(self._files)[0]
    path = self._files[name]
    if path in self._handles:
      code = self._handles[path].get_slice(name).get_dtype()
      return {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(code, code)
    return str(self._pickled[path][name].dtype).removeprefix("torch.")


def _check_names_and_shapes(src: TensorSource, cfg: ModelConfig, shapes: Params,
                            ignore: Callable[[str], bool] | None = None) -> list[Row]:
  rows = name_table(cfg)
  expected: dict[str, tuple[int, ...]] = {}
  for row in rows:
    ours = _get_path(shapes, row.path).shape
    per_layer = ours[1:] if row.stacked else ours
    for name in _hf_names(row, cfg):
      expected[name] = row.hf_shape(per_layer)
  missing = sorted(set(expected) - src.names)
  if missing:
    more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
    raise ElasticJaxError(f"{src.directory}: tensor '{missing[0]}' is missing{more}")
  unused = sorted(n for n in src.names - set(expected)
                  if not n.endswith(_IGNORED_SUFFIXES) and not (ignore and ignore(n)))
  if cfg.tie_word_embeddings and "lm_head.weight" in unused:
    # Some tied checkpoints store the shared matrix twice; accept it only if it is the same.
    if not np.array_equal(src.get("lm_head.weight"), src.get("model.embed_tokens.weight")):
      raise ElasticJaxError(f"{src.directory}: tie_word_embeddings is true but "
                            "'lm_head.weight' differs from 'model.embed_tokens.weight'")
    unused.remove("lm_head.weight")
  if unused:
    more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
    raise ElasticJaxError(f"{src.directory}: tensor '{unused[0]}' is not used by a "
                          f"{cfg.family} model with this config{more}")
  for name, shape in expected.items():
    got = src.shape(name)
    if got != shape:
      raise ElasticJaxError(f"{src.directory}: tensor '{name}' has shape {list(got)}, "
                            f"expected {list(shape)}")
  return rows


def load_hf_params(directory: str | TensorSource, cfg: ModelConfig, dtype: str, *,
                   allow_pickle: bool = False, show_progress: bool = True,
                   put: Callable[[tuple[str, ...], np.ndarray], jax.Array] | None = None,
                   ignore: Callable[[str], bool] | None = None) -> Params:
  """Reads an HF checkpoint directory (or an open TensorSource) into our parameter tree.

  `put(path, host_array)` places one leaf on the device(s); the default is `jax.device_put`.
  `ignore(name)` marks tensors another reader takes (the authors' routers), which are then
  neither loaded nor refused as unused.
  """
  src = (directory if isinstance(directory, TensorSource)
         else TensorSource(directory, allow_pickle=allow_pickle))
  directory = src.directory
  if dtype == "auto":
    dtype = src.dtype()
    if dtype not in _DTYPES:
      raise ElasticJaxError(f"{directory}: checkpoint dtype {dtype} is not supported "
                            f"(pass dtype= one of {', '.join(_DTYPES)})")
  np_dtype = _DTYPES[dtype]
  shapes, _ = abstract_params(cfg, dtype)
  rows = _check_names_and_shapes(src, cfg, shapes, ignore)
  put = put or (lambda _, x: jax.device_put(x))
  params: Params = {}
  for row in progress(rows, desc="loading tensors", unit="param", enabled=show_progress):
    ours = _get_path(shapes, row.path).shape
    if row.stacked:
      host = np.empty(ours, np_dtype)
      for i, name in enumerate(_hf_names(row, cfg)):
        host[i] = row.to_ours(src.get(name), ours[1:])
    else:
      host = row.to_ours(src.get(row.hf), ours).astype(np_dtype)
    if not np.isfinite(host).all():
      bad = [n for i, n in enumerate(_hf_names(row, cfg))
             if not np.isfinite(host[i] if row.stacked else host).all()]
      warnings.warn(f"{directory}: tensor '{bad[0]}' holds NaN or inf values"
                    + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
                    + "; the model's outputs will not be finite", stacklevel=2)
    _set_path(params, row.path, put(row.path, host))
    del host
  return params


# ----------------------------------------------------------------------------------------------
# Writing checkpoints


_SAFETENSORS_CODES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def write_hf_safetensors(params: Params, cfg: ModelConfig, directory: str, dtype: str,
                         max_shard_bytes: int, show_progress: bool = False,
                         extra: dict[str, np.ndarray] | None = None) -> list[str]:
  """Writes `model.safetensors`, or numbered shards plus an index when over `max_shard_bytes`.

  Streamed: every header is planned from the shapes first, then each of our leaves is fetched
  from the device once, converted, and its tensors written in place; host memory holds one
  leaf at a time, whatever the model size. `extra`: more tensors (name -> host array, in its
  own dtype; e.g. the authors' routers) written after the backbone's.
  """
  np_dtype = np.dtype(_DTYPES[dtype])
  extra = extra or {}
  clash = sorted(set(extra) & {n for row in name_table(cfg) for n in _hf_names(row, cfg)})
  if clash:
    raise ElasticJaxError(f"tensor '{clash[0]}' would be written twice")
  bad = sorted(n for n, x in extra.items() if str(x.dtype) not in _SAFETENSORS_CODES)
  if bad:
    raise ElasticJaxError(f"tensor '{bad[0]}' has dtype {extra[bad[0]].dtype}, which this "
                          "writer does not support")
  plan: list[tuple[str, tuple[int, ...], int, str]] = []   # name, shape, itemsize, dtype
  for row in name_table(cfg):
    ours = _get_path(params, row.path).shape
    for name in _hf_names(row, cfg):
      plan.append((name, row.hf_shape(ours[1:] if row.stacked else ours), np_dtype.itemsize,
                   dtype))
  for name, x in extra.items():
    plan.append((name, tuple(x.shape), x.dtype.itemsize, str(x.dtype)))
  shards: list[dict[str, tuple[tuple[int, ...], int, int, str]]] = [{}]
  size = 0
  for name, shape, itemsize, code in plan:
    nbytes = math.prod(shape) * itemsize
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = (shape, size, size + nbytes, code)
    size += nbytes
  n = len(shards)
  files = ["model.safetensors" if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"
           for k in range(n)]
  where: dict[str, tuple[int, int]] = {}  # name -> (shard, absolute file offset)
  handles = []
  try:
    for k, shard in enumerate(shards):
      header = {name: {"dtype": _SAFETENSORS_CODES[code], "shape": list(shape),
                       "data_offsets": [begin, end]}
                for name, (shape, begin, end, code) in shard.items()}
      header["__metadata__"] = {"format": "pt"}
      blob = json.dumps(header, separators=(",", ":")).encode()
      blob += b" " * (-len(blob) % 8)
      f = open(os.path.join(directory, files[k]), "wb")
      handles.append(f)
      f.write(len(blob).to_bytes(8, "little") + blob)
      for name, (_, begin, _, _) in shard.items():
        where[name] = (k, 8 + len(blob) + begin)
    rows = progress(name_table(cfg), desc="writing tensors", unit="param",
                    enabled=show_progress)
    for row in rows:
      leaf = np.asarray(jax.device_get(_get_path(params, row.path)))
      leaf = leaf.astype(np_dtype, copy=False)
      for i, name in enumerate(_hf_names(row, cfg)):
        arr = np.ascontiguousarray(row.to_hf(leaf[i] if row.stacked else leaf))
        k, offset = where[name]
        handles[k].seek(offset)
        handles[k].write(arr.tobytes())
      del leaf
    for name, x in extra.items():
      k, offset = where[name]
      handles[k].seek(offset)
      handles[k].write(np.ascontiguousarray(x).tobytes())
  finally:
    for f in handles:
      f.close()
  if n > 1:
    total = sum(end - begin for shard in shards for _, begin, end, _ in shard.values())
    weight_map = {name: files[k] for k, shard in enumerate(shards) for name in shard}
    with open(os.path.join(directory, SAFE_INDEX), "w") as f:
      json.dump({"metadata": {"total_size": total},
                 "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
  return files
