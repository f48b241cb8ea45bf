"""The trained routers, written out at the end of a run, in two layouts.

ours     `routers.safetensors` (router params stacked over layers, [L, ...], and the
         multipliers) plus `routers.json` (router config, objective targets, backbone shape):
         what `load_routers` reads back.
authors  `routers.safetensors` under the authors' tensor names (SPEC.md section 9), one set per
         layer, PyTorch Linear layout (weight [out, in]), plus `config_extra.json` with the
         keys their config adds. Not written for a static router (the authors' layout has no
         place for its per-head logits).
Each directory is written whole or not at all.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file

from elastic_jax.config import ModelConfig
from elastic_jax.errors import ElasticJaxError
from elastic_jax.router import RouterConfig
from elastic_jax.utils import atomic_directory

# Our stacked router tensors -> (authors' module, Linear index) per layer.
AUTHORS_LINEARS = {
    "task_w1": ("cls_feat_extractor", 0), "task_w2": ("cls_feat_extractor", 2),
    "route_w1": ("cls_router_head_agnostic", 0), "route_w2": ("cls_router_head_agnostic", 2),
    "route_w3": ("cls_router_head_agnostic", 4),
}
_PREFIX = "model.layers.{i}.self_attn.mask_allocator.{module}.{index}.{kind}"


def authors_tensors(trainable: dict[str, Any], num_layers: int) -> dict[str, np.ndarray]:
  """The router and multipliers under the authors' names (float32)."""
  router = {k: np.asarray(v, np.float32) for k, v in trainable["router"].items()}
  out = {}
  for name, (module, index) in AUTHORS_LINEARS.items():
    bias = router[name.replace("w", "b")]
    for i in range(num_layers):
      out[_PREFIX.format(i=i, module=module, index=index, kind="weight")] = np.ascontiguousarray(
          router[name][i].T)
      out[_PREFIX.format(i=i, module=module, index=index, kind="bias")] = bias[i].copy()
  lam = trainable["lambdas"]
  out["model.sparsity_lambda1_task"] = np.asarray(lam["l1"], np.float32)
  out["model.sparsity_lambda2_task"] = np.asarray(lam["l2"], np.float32)
  return out


def export_routers(cfg, mcfg: ModelConfig, trainable: dict[str, Any]) -> dict[str, str]:
  """Writes the layouts `cfg.export` asks for under `cfg.export_dir`; returns their paths."""
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
  if cfg.export.authors and not rcfg.static:
    target = os.path.join(cfg.export_dir, "authors")
    extra = {"architectures": [f"Paw{'Qwen3' if mcfg.family == 'qwen3' else 'Llama'}ForCausalLM"],
             "toggle_type": "streaming", "sink_size": rcfg.sink_blocks * rcfg.block,
             "local_window_size": rcfg.local_blocks * rcfg.block, "retrieval_mode": "full",
             "pooling_mode": rcfg.pooling, "use_softmax": rcfg.relaxation == "softmax",
             "enable_ada_sparsity": True}
    with atomic_directory(target, overwrite=True) as tmp:
      save_file(authors_tensors(trainable, mcfg.num_layers),
                os.path.join(tmp, "routers.safetensors"))
      with open(os.path.join(tmp, "config_extra.json"), "w") as f:
        json.dump(extra, f, indent=1)
    paths["authors"] = target
  return paths


def load_routers(directory: str) -> tuple[dict[str, Any], dict[str, Any]]:
  """Reads what `export_routers` wrote in our layout: ({"router", "lambdas"}, metadata)."""
  meta_path = os.path.join(directory, "routers.json")
  try:
    with open(meta_path) as f:
      meta = json.load(f)
    tensors = load_file(os.path.join(directory, "routers.safetensors"))
  except (OSError, ValueError) as e:
    raise ElasticJaxError(f"{directory}: not a router export ({e})") from None
  if meta.get("format") != "elastic_jax.routers":
    raise ElasticJaxError(f"{meta_path}: not a router export (format {meta.get('format')!r})")
  trainable: dict[str, dict] = {"router": {}, "lambdas": {}}
  for k, v in tensors.items():
    group, name = k.split(".", 1)
    trainable[group][name] = v
  return trainable, meta
