"""The trained routers, written out at the end of a run, in up to three layouts.

ours        `routers.safetensors` (router params stacked over layers, [L, ...], and the
            multipliers) plus `routers.json` (router config, objective targets, backbone
            shape): what `load_routers` reads back.
authors     `routers.safetensors` under the authors' tensor names (convert/authors.py), one
            set per layer, PyTorch Linear layout (weight [out, in]), plus `config_extra.json`
            with the keys their config adds. Written when their layout can express the
            router (not a static one, not FA-XA, blocks of 128 tokens, ...); otherwise a note
            says why not.
full_model  (export.full_model) the backbone with these routers merged in, in the authors'
            full-model layout: a directory their code, transformers and `from_pretrained`
            load (`python -m elastic_jax.convert MODEL OUT --routers EXPORT` does the same
            afterwards).
Each directory is written whole or not at all.
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
from elastic_jax.router import RouterConfig
from elastic_jax.utils import atomic_directory

AUTHORS_LINEARS = authors.ROUTER_LINEARS


def authors_layout_problem(rcfg: RouterConfig) -> str | None:
  """Why the authors' layout cannot hold routers of this config, or None if it can."""
  try:
    authors.authors_keys(rcfg, lambdas=True)
  except ElasticJaxError as e:
    return str(e)
  return None


def export_routers(cfg, mcfg: ModelConfig, trainable: dict[str, Any]) -> dict[str, str]:
  """Writes the router layouts `cfg.export` asks for under `cfg.export_dir`; returns their
  paths (and, under "notes", why a layout was left out)."""
  rcfg: RouterConfig = cfg.router
  meta = {"format": "elastic_jax.routers", "version": 1,
          "router": dataclasses.asdict(rcfg),
          "objective_targets": list(cfg.objective.targets),
          "backbone": {"family": mcfg.family, "num_layers": mcfg.num_layers,
                       "num_kv_heads": mcfg.num_kv_heads, "head_dim": mcfg.head_dim}}
  paths = {}
  if cfg.export.ours:
    target = os.path.join(cfg.export_dir, "elastic_jax")
    tensors = {f"router.{k}": np.asarray(v, np.float32) for k, v in trainable["router"].items()}
    tensors.update({f"lambdas.{k}": np.asarray(v, np.float32)
                    for k, v in trainable["lambdas"].items()})
    with atomic_directory(target, overwrite=True) as tmp:
      save_file(tensors, os.path.join(tmp, "routers.safetensors"))
      with open(os.path.join(tmp, "routers.json"), "w") as f:
        json.dump(meta, f, indent=1)
    paths["ours"] = target
  problem = authors_layout_problem(rcfg)
  if cfg.export.authors and problem:
    paths["notes"] = f"export.authors skipped: {problem}"
  elif cfg.export.authors:
    target = os.path.join(cfg.export_dir, "authors")
    extra = {"architectures": [AUTHORS_ARCHITECTURES[mcfg.family]],
             **authors.authors_keys(rcfg, lambdas=True)}
    tensors = authors.authors_tensors(trainable["router"], trainable["lambdas"],
                                      mcfg.num_layers)
    with atomic_directory(target, overwrite=True) as tmp:
      save_file(tensors, os.path.join(tmp, "routers.safetensors"))
      with open(os.path.join(tmp, "config_extra.json"), "w") as f:
        json.dump(extra, f, indent=1)
    paths["authors"] = target
  return paths


def export_full_model(cfg, mcfg: ModelConfig, backbone, trainable: dict[str, Any]) -> str:
  """The backbone (on this process's devices) with the trained routers, in the authors'
  full-model layout under EXPORT_DIR/full_model; returns the path."""
  from elastic_jax.api import ElasticModel, save_pretrained
  from elastic_jax.config import read_config_file, read_hf_config
  from elastic_jax.train.run_config import resolve_model_path
  path = resolve_model_path(cfg.model)
  raw = (read_config_file(path) if cfg.model.random_init else read_hf_config(path))[1]
  model = ElasticModel(mcfg, backbone, raw,
                       source_dir=None if cfg.model.random_init else path,
                       router_params=trainable["router"], router_config=cfg.router,
                       lambdas=trainable["lambdas"])
  target = os.path.join(cfg.export_dir, "full_model")
  save_pretrained(model, target, overwrite=True)
  return target


def load_routers(directory: str) -> tuple[dict[str, Any], dict[str, Any]]:
  """Reads what `export_routers` wrote in our layout: ({"router", "lambdas"}, metadata)."""
  meta_path = os.path.join(directory, "routers.json")
  tensors_path = os.path.join(directory, "routers.safetensors")
  try:
    with open(meta_path) as f:
      meta = json.load(f)
  except (OSError, ValueError) as e:
    raise ElasticJaxError(f"{directory}: not a router export ({e})") from None
  if not isinstance(meta, dict) or meta.get("format") != "elastic_jax.routers":
    raise ElasticJaxError(f"{meta_path}: not a router export (format "
                          f"{meta.get('format') if isinstance(meta, dict) else meta!r})")
  try:
    tensors = load_file(tensors_path)
  except Exception as e:  # noqa: BLE001 - safetensors raises its own types for damaged files
    raise ElasticJaxError(f"{tensors_path}: unreadable, truncated or damaged "
                          f"({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__})"
                          ) from None
  trainable: dict[str, dict] = {"router": {}, "lambdas": {}}
  for k, v in tensors.items():
    group, _, name = k.partition(".")
    if group not in trainable or not name:
      raise ElasticJaxError(f"{tensors_path}: tensor '{k}' is not a router or multiplier tensor")
    if not np.all(np.isfinite(v)):
      raise ElasticJaxError(f"{tensors_path}: tensor '{k}' holds NaN or inf values")
    trainable[group][name] = v
  return trainable, meta
