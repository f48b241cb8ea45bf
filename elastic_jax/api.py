"""The user-facing model object: `from_pretrained`, `save_pretrained`, `ElasticModel.logits`."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from elastic_jax import checkpoint
from elastic_jax.attention import get_attention
from elastic_jax.config import ModelConfig, config_from_hf_dict, read_hf_config
from elastic_jax.convert import hf
from elastic_jax.errors import ElasticJaxError
from elastic_jax.model import (Params, abstract_params, forward, forward_routed_jit,
                               positions_and_segments)
from elastic_jax.router import RouterConfig, esr, msr
from elastic_jax.utils import atomic_directory

DTYPES = ("bfloat16", "float32", "float16")
ATTENTION_MODES = ("full", "elastic", "forced", "sparse")


def _check_dtype(dtype: str, allow_auto: bool = True) -> str:
  if not isinstance(dtype, str):
    dtype = jnp.dtype(dtype).name
  allowed = DTYPES + (("auto",) if allow_auto else ())
  if dtype not in allowed:
    raise ElasticJaxError(f"dtype '{dtype}' is not supported (use one of {', '.join(allowed)})")
  return dtype


@dataclasses.dataclass
class ElasticModel:
  """A backbone: its config, its parameters (a plain pytree) and where it came from."""
  config: ModelConfig
  params: Params
  hf_config: dict[str, Any]
  source_dir: str | None = None
  attn_impl: str = "reference"
  router_params: Params | None = None          # stacked over layers; see router.py
  router_config: RouterConfig = dataclasses.field(default_factory=RouterConfig)

  @property
  def dtype(self) -> str:
    return str(jax.tree.leaves(self.params)[0].dtype)

  def _check_ids(self, input_ids) -> np.ndarray:
    ids = np.asarray(input_ids)
    if ids.ndim == 1:
      ids = ids[None]
    if ids.size == 0:
      raise ElasticJaxError("input_ids is empty: a sequence needs at least one token")
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
      raise ElasticJaxError(f"input_ids must be integer token ids shaped [T] or [B, T], got "
                            f"{ids.dtype} {list(ids.shape)}")
    limit = self.config.max_position_embeddings
    if ids.shape[1] > limit:
      raise ElasticJaxError(
          f"sequence of {ids.shape[1]} tokens is longer than the model's "
          f"max_position_embeddings ({limit})")
    bad = ids[(ids < 0) | (ids >= self.config.vocab_size)]
    if bad.size:
      raise ElasticJaxError(f"input_ids hold token {int(bad[0])} outside the vocabulary "
                            f"[0, {self.config.vocab_size})")
    return ids.astype(np.int32)

  def logits(self, input_ids, attention: str = "full", attention_mask=None, *,
             prompt_lengths=None, gates=None, impl: str | None = None,
             return_routing: bool = False):
    """Float32 logits [B, T, V] for token ids [B, T] (or [T]).

    attention: "full" runs the unmodified backbone; "elastic" lets the routers choose FA or
      SSA per (input, layer, KV head) at prefill (needs `router_params`); "forced" takes the
      choice from `gates`; "sparse" sends every head to SSA.
    attention_mask: optional [B, T], 1 for real tokens and 0 for padding (left or right).
    prompt_lengths: [B] prompt tokens per row (the router pools over the prompt); default:
      the whole input is the prompt.
    gates: for "forced", [L, B, K] or [L, K] with 1 = full attention.
    impl: attention implementation (default: the model's `attn_impl`); "auto" runs the fused
      kernel of this backend for unpadded batches (the reference on CPU).
    return_routing: also return {"gates": [L, B, K], "msr": [B], "esr": [B]}.
    """
    if attention not in ATTENTION_MODES:
      raise ElasticJaxError(f"attention='{attention}' is not available (available: "
                            f"{', '.join(ATTENTION_MODES)})")
    impl = impl or self.attn_impl
    get_attention(impl)
    ids = self._check_ids(input_ids)
    if attention_mask is None:
      attention_mask = np.ones_like(ids)
    mask = np.asarray(attention_mask)
    if mask.ndim == 1:
      mask = mask[None]
    if mask.shape != ids.shape:
      raise ElasticJaxError(f"attention_mask has shape {list(mask.shape)}, input_ids has "
                            f"{list(ids.shape)}")
    positions, segments = positions_and_segments(mask)
    if attention == "full":
      if return_routing:
        raise ElasticJaxError("attention='full' has no routing to return")
      return forward(self.params, jnp.asarray(ids), positions, segments, cfg=self.config,
                     attn_impl=impl)
    b, t = ids.shape
    l, k = self.config.num_layers, self.config.num_kv_heads
    if prompt_lengths is None:
      prompt_mask = mask.astype(bool)
    else:
      plen = np.asarray(prompt_lengths).reshape(-1)
      if plen.shape != (b,) or (plen < 1).any():
        raise ElasticJaxError(f"prompt_lengths must hold one positive length per row ({b}), "
                              f"got {plen.tolist()}")
      prompt_mask = (np.asarray(positions) < plen[:, None]) & mask.astype(bool)
    # One input per row: segment slot 1 holds the row, slot 0 the padding.
    rcfg = dataclasses.replace(self.router_config, max_segments=2)
    forced = None
    if attention == "elastic" and self.router_params is None:
      raise ElasticJaxError("attention='elastic' needs trained routers (model.router_params "
                            "is None)")
    if attention == "forced":
      if gates is None:
        raise ElasticJaxError("attention='forced' needs gates [L, B, K] or [L, K]")
      g = np.asarray(gates, np.float32)
      g = np.broadcast_to(g[:, None], (l, b, k)) if g.shape == (l, k) else g
      if g.shape != (l, b, k) or (g < 0).any() or (g > 1).any():
        raise ElasticJaxError(f"gates must be [L, B, K] = {[l, b, k]} or [L, K] with values "
                              f"in [0, 1], got shape {list(np.shape(gates))}")
      forced = jnp.asarray(np.stack([np.zeros_like(g), g], axis=2))  # [L, B, S=2, K]
    logits, stats = forward_routed_jit(
        self.params, jnp.asarray(ids), positions, segments, jnp.asarray(prompt_mask),
        cfg=self.config, rcfg=rcfg, mode=attention, router_params=self.router_params,
        forced_gates=forced, attn_impl=impl, packed=not bool(mask.all()))
    if not return_routing:
      return logits
    gates_lbk = (stats["gate"][:, :, 1] if "gate" in stats
                 else jnp.zeros((l, b, k), jnp.float32))
    lengths = jnp.asarray(mask.sum(1))
    report = {"gates": gates_lbk, "msr": msr(gates_lbk[:, :, None])[:, 0],
              "esr": esr(gates_lbk[-1], lengths, rcfg.streaming, setting=rcfg.setting,
                         xa_kept_bsk=stats["xa_kept"][-1] if "xa_kept" in stats else None)}
    return logits, report


def from_pretrained(path: str | os.PathLike, dtype: str = "bfloat16", *,
                    allow_pickle: bool = False, attn_impl: str = "reference",
                    show_progress: bool = True) -> ElasticModel:
  """Loads a model from an HF directory (safetensors) or from one that `convert` wrote.

  dtype: "bfloat16", "float32", "float16", or "auto" (the checkpoint's own dtype).
  allow_pickle: also read PyTorch `*.bin` weights (with `torch.load(weights_only=True)`).
  """
  path = os.fspath(path)
  dtype = _check_dtype(dtype)
  get_attention(attn_impl)
  if not os.path.isdir(path):
    raise ElasticJaxError(f"{path}: not a directory")
  cfg, raw = read_hf_config(path)
  if checkpoint.is_our_checkpoint(path):
    meta = checkpoint.read_marker(path)
    dtype = meta["dtype"] if dtype == "auto" else dtype
    shapes, _ = abstract_params(cfg, dtype)
    params = checkpoint.restore_params(path, shapes)
  else:
    params = hf.load_hf_params(path, cfg, dtype, allow_pickle=allow_pickle,
                               show_progress=show_progress)
  return ElasticModel(cfg, params, raw, source_dir=path, attn_impl=attn_impl)


def _hf_config_for_export(model: ElasticModel, dtype: str) -> dict[str, Any]:
  raw = copy.deepcopy(model.hf_config) if model.hf_config else model.config.to_hf_dict()
  # The stored config must still describe this model exactly.
  if config_from_hf_dict(raw, source="the model's config") != model.config:
    raw = model.config.to_hf_dict()
  raw["dtype"] = dtype
  if "torch_dtype" in raw:
    raw["torch_dtype"] = dtype
  return raw


def save_pretrained(model: ElasticModel, directory: str | os.PathLike, *,
                    dtype: str | None = None, max_shard_size: int = 5 * 2**30,
                    overwrite: bool = False, show_progress: bool = False) -> None:
  """Writes an HF directory (config.json + safetensors) that `transformers` loads.

  With `dtype=None` the tensors keep the model's dtype, so HF -> ours -> HF is bit-exact.
  Written atomically: on failure nothing is left at `directory`.
  """
  dtype = _check_dtype(dtype or model.dtype, allow_auto=False)
  with atomic_directory(os.fspath(directory), overwrite=overwrite) as tmp:
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(_hf_config_for_export(model, dtype), f, indent=2, sort_keys=True)
    checkpoint.copy_side_files(model.source_dir, tmp)
    hf.write_hf_safetensors(model.params, model.config, tmp, dtype, max_shard_size,
                            show_progress=show_progress)


def save_converted(model: ElasticModel, directory: str | os.PathLike, *,
                   overwrite: bool = False) -> None:
  """Writes our own format (orbax params + config), atomically."""
  with atomic_directory(os.fspath(directory), overwrite=overwrite) as tmp:
    checkpoint.copy_side_files(model.source_dir, tmp)
    checkpoint.save_params(tmp, model.params, model.hf_config or model.config.to_hf_dict(),
                           model.dtype)
