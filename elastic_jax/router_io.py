"""Trained routers on disk, apart from any backbone, in two layouts.

ours     `routers.safetensors` (router params stacked over layers, [L, ...], and the task
         multipliers) plus `routers.json` (router config, objective targets, backbone shape):
         what `load_routers` reads back and `ElasticModel.from_pretrained(..., routers=)`
         attaches.
authors  `routers.safetensors` under the authors' tensor names (convert/authors.py), one set
         per layer, PyTorch Linear layout (weight [out, in]), plus `config_extra.json` with
         the keys their config adds; written only when their layout can express the router.
A model with routers is saved (`save_pretrained`, `save_converted`) in the authors'
full-model layout when theirs can hold the routers, else in ours: the backbone with this
export in its `routers/` folder. Each directory is written whole or
not at all.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file

from elastic_jax.config import AUTHORS_ARCHITECTURES, ModelConfig
from elastic_jax.convert import authors
from elastic_jax.errors import ElasticJaxError
from elastic_jax.files import atomic_directory
from elastic_jax.router import RouterConfig, router_param_names

FORMAT = "elastic_jax.routers"
# Router-config keys of exports written before a rename, and their names now.
_RENAMED = {"patterns": "patterns"}


@dataclasses.dataclass
class Routers:
  """A set of trained routers: their parameters (stacked over layers), their config, the task
  multipliers trained with them (or None), and the export's metadata."""
  params: dict[str, Any]
  config: RouterConfig
  lambdas: dict[str, Any] | None = None
  meta: dict[str, Any] = dataclasses.field(default_factory=dict)


def _meta(rcfg: RouterConfig, mcfg: ModelConfig, targets, recipe) -> dict[str, Any]:
  return {"format": FORMAT, "version": 1, "router": dataclasses.asdict(rcfg),
          "objective_targets": None if targets is None else list(targets),
          "backbone": {"family": mcfg.family, "num_layers": mcfg.num_layers,
                       "num_kv_heads": mcfg.num_kv_heads, "head_dim": mcfg.head_dim},
          **({"recipe": recipe} if recipe else {})}


def save_routers(directory: str, routers: Routers, mcfg: ModelConfig, *,
                 targets=None, overwrite: bool = True, recipe: str | None = None) -> str:
  """Writes `routers` in our layout to `directory`; returns it. recipe: what trained them
  where it is not train.py's objective (a baseline's name, repro/baselines.py)."""
  with atomic_directory(directory, overwrite=overwrite) as tmp:
    write_routers(tmp, routers, mcfg, targets=targets, recipe=recipe)
  return directory


def write_routers(directory: str, routers: Routers, mcfg: ModelConfig, *, targets=None,
                  recipe: str | None = None) -> None:
  """`save_routers` without its atomic rename: into a new folder of a directory that is
  being written whole (our full-model layout's `routers/`)."""
  tensors = {f"router.{k}": np.asarray(v, np.float32) for k, v in routers.params.items()}
  tensors.update({f"lambdas.{k}": np.asarray(v, np.float32)
                  for k, v in (routers.lambdas or {}).items()})
  os.makedirs(directory, exist_ok=True)
  save_file(tensors, os.path.join(directory, "routers.safetensors"))
  with open(os.path.join(directory, "routers.json"), "w") as f:
    json.dump(_meta(routers.config, mcfg, targets, recipe), f, indent=1)


def authors_layout_problem(rcfg: RouterConfig) -> str | None:
  """Why the authors' layout cannot hold routers of this config, or None if it can."""
  try:
    authors.authors_keys(rcfg, lambdas=True)
  except ElasticJaxError as e:
    return str(e)
  return None


def save_routers_authors(directory: str, routers: Routers, mcfg: ModelConfig, *,
                         overwrite: bool = True) -> str:
  """Writes `routers` in the authors' routers-only layout; refuses what it cannot express."""
  keys = authors.authors_keys(routers.config, lambdas=routers.lambdas is not None)
  extra = {"architectures": [AUTHORS_ARCHITECTURES[mcfg.family]], **keys}
  tensors = authors.authors_tensors(routers.params, routers.lambdas, mcfg.num_layers)
  with atomic_directory(directory, overwrite=overwrite) as tmp:
    save_file(tensors, os.path.join(tmp, "routers.safetensors"))
    with open(os.path.join(tmp, "config_extra.json"), "w") as f:
      json.dump(extra, f, indent=1)
  return directory


def load_routers(directory: str | os.PathLike) -> Routers:
  """The routers `save_routers` (train.py's export/elastic_jax) wrote, checked: readable,
  every tensor a router or multiplier tensor, finite values, a usable router config."""
  directory = os.fspath(directory)
  meta_path = os.path.join(directory, "routers.json")
  tensors_path = os.path.join(directory, "routers.safetensors")
  try:
    with open(meta_path) as f:
      meta = json.load(f)
  except (OSError, ValueError) as e:
    raise ElasticJaxError(f"{directory}: not a router export ({e})") from None
  if not isinstance(meta, dict) or meta.get("format") != FORMAT:
    raise ElasticJaxError(f"{meta_path}: not a router export (format "
                          f"{meta.get('format') if isinstance(meta, dict) else meta!r})")
  try:
    tensors = load_file(tensors_path)
  except Exception as e:  # noqa: BLE001 - safetensors raises its own types for damaged files
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise ElasticJaxError(f"{tensors_path}: unreadable, truncated or damaged ({first})"
                          ) from None
  groups: dict[str, dict] = {"router": {}, "lambdas": {}}
  for k, v in tensors.items():
    group, _, name = k.partition(".")
    if group not in groups or not name:
      raise ElasticJaxError(f"{tensors_path}: tensor '{k}' is not a router or multiplier tensor")
    if not np.all(np.isfinite(v)):
      raise ElasticJaxError(f"{tensors_path}: tensor '{k}' holds NaN or inf values")
    groups[group][name] = v
  router = dict(meta.get("router") or {})
  for old, new in _RENAMED.items():
    if old in router:
      router.setdefault(new, router.pop(old))
  try:
    rcfg = RouterConfig(**router)
  except (TypeError, ValueError) as e:
    raise ElasticJaxError(f"{meta_path}: holds an unusable router config ({e})") from None
  want = router_param_names(rcfg)
  have = set(groups["router"])
  if have != want:
    told = [f"{what} {', '.join(sorted(names))}" for what, names in
            (("missing", want - have), ("unexpected", have - want)) if names]
    raise ElasticJaxError(f"{tensors_path}: its router tensors do not match its config "
                          f"(static {rcfg.static}, task_mlp {rcfg.task_mlp}): "
                          f"{'; '.join(told)}")
  return Routers(groups["router"], rcfg, groups["lambdas"] or None, meta)
