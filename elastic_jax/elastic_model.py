"""The user-facing model: `ElasticModel` (a backbone, its routers, where it came from) with
`from_pretrained` / `save_pretrained` / `save_converted`, and `logits` / `generate`.

    model = ElasticModel.from_pretrained("Qwen3-8B", routers="runs/x/export/elastic_jax")
    out = model.generate(["Where did the river hide the number?"], max_new_tokens=32)
    model.save_pretrained("out")            # the authors' full-model layout (it has routers)
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from elastic_jax.convert import native
from elastic_jax.attention import get_attention
from elastic_jax.config import (ARCHITECTURES, AUTHORS_KEYS, ModelConfig, config_from_hf_dict,
                                is_authors_config, read_hf_config)
from elastic_jax.convert import authors, hf
from elastic_jax.errors import ElasticJaxError
from elastic_jax.heads import FORWARD, check_attention
from elastic_jax.model import (Params, abstract_params, check_shapes, forward,
                               forward_routed_jit, positions_and_segments)
from elastic_jax.router import RouterConfig, esr, init_router_params, msr
from elastic_jax.router_io import Routers, load_routers
from elastic_jax.files import atomic_directory

DTYPES = ("bfloat16", "float32", "float16")


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
  lambdas: Params | None = None                # task multipliers {"l1", "l2"} [5], if any
  objective_targets: tuple[float, ...] | None = None   # target MSR per task type the routers
                                                       # were trained for, when known
  authors_extras: authors.AuthorsExtras | None = None  # kept from an authors' directory

  @property
  def dtype(self) -> str:
    return str(jax.tree.leaves(self.params)[0].dtype)

  @classmethod
  def from_pretrained(cls, path: str | os.PathLike, routers=None, dtype: str = "bfloat16",
                      **kwargs) -> "ElasticModel":
    """`elastic_jax.from_pretrained(path, dtype, routers=...)`: a model directory (HF, ours,
    or the authors' with its routers), with routers attached (a train.py export or a
    `Routers`) when given."""
    return from_pretrained(path, dtype=dtype, routers=routers, **kwargs)

  def save_pretrained(self, directory: str | os.PathLike, **kwargs) -> None:
    """`elastic_jax.save_pretrained(self, directory, ...)`: an HF directory; the authors'
    full-model layout when the model carries routers."""
    save_pretrained(self, directory, **kwargs)

  @property
  def tokenizer(self):
    """The tokenizer of the model's directory (loaded once), for text prompts."""
    if getattr(self, "_tokenizer", None) is None:
      if self.source_dir is None:
        raise ElasticJaxError("this model has no directory to read a tokenizer from: pass "
                              "token ids, or tokenizer=")
      from elastic_jax.tokenizer import load_tokenizer
      self._tokenizer = load_tokenizer(self.source_dir)
    return self._tokenizer

  def _check_ids(self, input_ids) -> np.ndarray:
    ids = np.asarray(input_ids)
    if ids.ndim == 1:
      ids = ids[None]
    if ids.size == 0:
      raise ElasticJaxError("input_ids is empty: a sequence needs at least one token")
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
      raise ElasticJaxError(f"input_ids must be integer token ids shaped [T] or [B, T], got "
                            f"{ids.dtype} {list(ids.shape)}")
    if ids.shape[1] > self.config.max_length:
      raise ElasticJaxError(f"sequence of {ids.shape[1]} tokens is longer than the model's "
                            f"{self.config.max_length_text()}")
    bad = ids[(ids < 0) | (ids >= self.config.vocab_size)]
    if bad.size:
      raise ElasticJaxError(f"input_ids hold token {int(bad[0])} outside the vocabulary "
                            f"[0, {self.config.vocab_size})")
    return ids.astype(np.int32)

  def logits(self, input_ids, attention: str = "full", attention_mask=None, *,
             prompt_lengths=None, gates=None, attn_impl: str | None = None,
             return_routing: bool = False):
    """Float32 logits [B, T, V] for token ids [B, T] (or [T]).

    attention: "full" runs the unmodified backbone; "elastic" lets the routers choose FA or
      SSA per (input, layer, KV head) at prefill (needs `router_params`); "forced" takes the
      choice from `gates`; "sparse" sends every head to SSA.
    attention_mask: optional [B, T], 1 for real tokens and 0 for padding (left or right).
    prompt_lengths: [B] prompt tokens per row (the router pools over the prompt); default:
      the whole input is the prompt.
    gates: for "forced", [L, B, K] or [L, K] with 1 = full attention.
    attn_impl: attention implementation (default: the model's `attn_impl`); "auto" runs the fused
      kernel of this backend for unpadded batches (the reference on CPU).
    return_routing: also return {"gates": [L, B, K], "msr": [B], "esr": [B]}.
    """
    check_attention(attention, FORWARD)
    attn_impl = attn_impl or self.attn_impl
    get_attention(attn_impl)
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
                     attn_impl=attn_impl)
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
    # One input per row: segment slot 1 holds the row, slot 0 the padding (num_segments 2).
    rcfg = self.router_config
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
        cfg=self.config, rcfg=rcfg, attention=attention, router_params=self.router_params,
        forced_gates=forced, attn_impl=attn_impl, packed=not bool(mask.all()))
    if not return_routing:
      return logits
    gates_lbk = (stats["gate"][:, :, 1] if "gate" in stats
                 else jnp.zeros((l, b, k), jnp.float32))
    lengths = jnp.asarray(mask.sum(1))
    report = {"gates": gates_lbk, "msr": msr(gates_lbk[:, :, None])[:, 0],
              "esr": esr(gates_lbk[-1], lengths, rcfg.streaming, patterns=rcfg.patterns,
                         xa_kept_bsk=stats["xa_kept"][-1] if "xa_kept" in stats else None)}
    return logits, report


ROUTERS_FILE = "routers.safetensors"   # our format: the routers under the authors' names


def _generate(self: "ElasticModel", prompts, attention: str | None = None, *,
              max_new_tokens=None, sampling=None, eos_ids=None, tokenizer=None,
              gates=None, attn_impl: str | None = None, return_logits: bool = False,
              tokens_per_sync: int = 32, layer_loop: str = "auto",
              prefill_chunk: int | None = 8192, pack: bool | None = None):
  """Generates after each prompt: texts (tokenized with the model directory's tokenizer, or
  `tokenizer`) or lists of token ids. attention: how heads attend (default elastic when the
  model has routers, else full); the rest as `elastic_jax.generate.generate`. EOS ids are the
  tokenizer's by default. max_new_tokens: one limit for every prompt, or a list of one per
  prompt. Returns a `Generation` (`.texts` when a tokenizer is at hand)."""
  from elastic_jax.generate import SamplingConfig, generate
  texts = isinstance(prompts, str) or (
      isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], str))
  if isinstance(prompts, str):
    prompts = [prompts]
  if texts or tokenizer is None and self.source_dir is not None and eos_ids is None:
    try:
      tokenizer = tokenizer or self.tokenizer
    except ElasticJaxError:
      if texts:
        raise
  if texts:
    prompts = [tokenizer(p)["input_ids"] for p in prompts]
  if eos_ids is None:
    eos = getattr(tokenizer, "eos_token_id", None)
    eos_ids = () if eos is None else tuple(int(x) for x in np.atleast_1d(eos))
  if attention is None:
    attention = "elastic" if self.router_params is not None else "full"
  per_request = None
  if isinstance(max_new_tokens, (list, tuple, np.ndarray)):
    per_request, max_new_tokens = max_new_tokens, None
  if sampling is None:
    sampling = SamplingConfig(**({} if max_new_tokens is None
                                 else {"max_new_tokens": max_new_tokens}))
  elif max_new_tokens is not None:
    sampling = dataclasses.replace(sampling, max_new_tokens=max_new_tokens)
  return generate(self.params, self.config, prompts, attention=attention,
                  rcfg=self.router_config, router_params=self.router_params, gates=gates,
                  sampling=sampling, eos_ids=eos_ids, tokenizer=tokenizer,
                  attn_impl=attn_impl or ("auto" if self.attn_impl == "reference"
                                          else self.attn_impl),
                  return_logits=return_logits, max_new_tokens=per_request,
                  tokens_per_sync=tokens_per_sync, layer_loop=layer_loop,
                  prefill_chunk=prefill_chunk, pack=pack)


ElasticModel.generate = _generate


def from_pretrained(path: str | os.PathLike, dtype: str = "bfloat16", *,
                    allow_pickle: bool = False, attn_impl: str = "reference",
                    show_progress: bool = True, routers: str | os.PathLike | None = None
                    ) -> ElasticModel:
  """Loads a model from an HF directory (safetensors) or from one that `convert` wrote.

  The authors' released Elastic-Attention directories (PawQwen3ForCausalLM /
  PawLlamaForCausalLM) load with their routers, task multipliers and router config
  (convert/authors.py), ready for `logits(..., attention="elastic")`.
  dtype: "bfloat16", "float32", "float16", or "auto" (the checkpoint's own dtype).
  allow_pickle: also read PyTorch `*.bin` weights (with `torch.load(weights_only=True)`).
  routers: a router export of train.py (its export/elastic_jax directory) to attach; it
    replaces any routers the directory holds.
  """
  if path is None or not isinstance(path, (str, os.PathLike)):
    raise ElasticJaxError(f"from_pretrained needs a directory path, got {path!r}")
  path = os.fspath(path)
  dtype = _check_dtype(dtype)
  get_attention(attn_impl)
  if not os.path.isdir(path):
    raise ElasticJaxError(f"{path}: not a directory")
  cfg, raw = read_hf_config(path)
  rcfg = (authors.router_config_from_authors(raw, os.path.join(path, "config.json"))
          if is_authors_config(raw) else None)
  router = lambdas = extras = None
  if native.is_our_checkpoint(path):
    meta = native.read_marker(path)
    if rcfg is not None:
      if not os.path.isfile(os.path.join(path, ROUTERS_FILE)):
        raise ElasticJaxError(f"{path}: its config names the authors' architecture but it has "
                              f"no {ROUTERS_FILE}")
      router, lambdas, extras = authors.read_routers(hf.TensorSource(path), cfg, rcfg)
    dtype = meta["dtype"] if dtype == "auto" else dtype
    shapes, _ = abstract_params(cfg, dtype)
    params = native.restore_params(path, shapes)
  else:
    src = hf.TensorSource(path, allow_pickle=allow_pickle)
    if rcfg is not None:   # read (and check) the routers before the large backbone
      router, lambdas, extras = authors.read_routers(src, cfg, rcfg)
    params = hf.load_hf_params(src, cfg, dtype, show_progress=show_progress,
                               ignore=authors.is_authors_name if rcfg is not None else None)
  model = ElasticModel(cfg, params, raw, source_dir=path, attn_impl=attn_impl,
                       router_params=router, router_config=rcfg or RouterConfig(),
                       lambdas=lambdas, authors_extras=extras)
  return attach_routers(model, routers) if routers is not None else model


def attach_routers(model: ElasticModel, routers: Routers | str | os.PathLike) -> ElasticModel:
  """`model` with these routers (their config and multipliers too): a `Routers` or the
  directory of a train.py export. Refuses routers made for another backbone shape."""
  where = "the routers" if isinstance(routers, Routers) else os.fspath(routers)
  if not isinstance(routers, Routers):
    routers = load_routers(routers)
  want = routers.meta.get("backbone", {})
  have = {"family": model.config.family, "num_layers": model.config.num_layers,
          "num_kv_heads": model.config.num_kv_heads, "head_dim": model.config.head_dim}
  wrong = [k for k, v in have.items() if k in want and want[k] != v]
  if wrong:
    raise ElasticJaxError(f"{where}: routers trained for a backbone with {wrong[0]} "
                          f"{want[wrong[0]]}, this model has {have[wrong[0]]}")
  shapes = jax.eval_shape(lambda: init_router_params(model.config, routers.config,
                                                     jax.random.key(0)))
  check_shapes({k: np.shape(v) for k, v in routers.params.items()},
               {k: v.shape for k, v in shapes.items()}, f"{where}: router tensor",
               f" (head_dim {model.config.head_dim}, {model.config.num_layers} layers)")
  extras = model.authors_extras
  if extras is not None:   # float32 routers replace the directory's: keep their precision
    extras = dataclasses.replace(extras, router_dtype="float32")
  targets = routers.meta.get("objective_targets")
  return dataclasses.replace(model, router_params=routers.params, router_config=routers.config,
                             lambdas=routers.lambdas, authors_extras=extras,
                             objective_targets=tuple(targets) if targets else None)


def _hf_config_for_export(model: ElasticModel, dtype: str, with_routers: bool) -> dict[str, Any]:
  raw = copy.deepcopy(model.hf_config) if model.hf_config else model.config.to_hf_dict()
  # The stored config must still describe this model exactly.
  if config_from_hf_dict(raw, source="the model's config") != model.config:
    raw = model.config.to_hf_dict()
  if with_routers:
    raw = authors.authors_config(raw, model.config.family, model.router_config,
                                 lambdas=model.lambdas is not None)
  elif is_authors_config(raw):   # the backbone alone: a plain HF config
    raw = {k: v for k, v in raw.items() if k not in AUTHORS_KEYS}
    raw["architectures"] = [ARCHITECTURES[model.config.family]]
  raw["dtype"] = dtype
  if "torch_dtype" in raw:
    raw["torch_dtype"] = dtype
  return raw


def _router_tensors(model: ElasticModel) -> dict[str, np.ndarray]:
  """The routers, multipliers and kept extras under the authors' names and dtypes."""
  extras = model.authors_extras or authors.AuthorsExtras({})
  out = authors.authors_tensors(jax.device_get(model.router_params), model.lambdas,
                                model.config.num_layers, extras.router_dtype)
  out.update(extras.tensors)
  return out


def _check_params(model: ElasticModel) -> None:
  """Every parameter has the shape the config gives it: a changed tree would otherwise be
  written as a checkpoint that does not load."""
  shapes, _ = abstract_params(model.config, model.dtype)
  check_shapes({jax.tree_util.keystr(p): np.shape(x)
                for p, x in jax.tree_util.tree_leaves_with_path(model.params)},
               {jax.tree_util.keystr(p): x.shape
                for p, x in jax.tree_util.tree_leaves_with_path(shapes)},
               "parameter", "; nothing was written")


def _writes_routers(model: ElasticModel, routers: bool) -> bool:
  if not routers or model.router_params is None:
    return False
  authors.authors_keys(model.router_config, lambdas=False)   # refuses what cannot be written
  return True


def save_pretrained(model: ElasticModel, directory: str | os.PathLike, *,
                    dtype: str | None = None, max_shard_size: int = 5 * 2**30,
                    overwrite: bool = False, show_progress: bool = False,
                    routers: bool = True) -> None:
  """Writes an HF directory (config.json + safetensors) that `transformers` loads.

  A model that carries routers is written in the authors' full-model layout (their
  architecture name and config keys, routers and multipliers beside the backbone), which
  their code and `transformers` both load; `routers=False` writes the backbone alone.
  With `dtype=None` the tensors keep the model's dtype, so HF -> ours -> HF is bit-exact.
  Written atomically: on failure nothing is left at `directory`.
  """
  dtype = _check_dtype(dtype or model.dtype, allow_auto=False)
  _check_params(model)
  with_routers = _writes_routers(model, routers)
  config = _hf_config_for_export(model, dtype, with_routers)
  extra = _router_tensors(model) if with_routers else None
  with atomic_directory(os.fspath(directory), overwrite=overwrite,
                        protect=[model.source_dir]) as tmp:
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(config, f, indent=2, sort_keys=True)
    native.copy_side_files(model.source_dir, tmp)
    hf.write_hf_safetensors(model.params, model.config, tmp, dtype, max_shard_size,
                            show_progress=show_progress, extra=extra)


def save_converted(model: ElasticModel, directory: str | os.PathLike, *,
                   overwrite: bool = False, routers: bool = True) -> None:
  """Writes our own format (orbax params + config; routers, if any, in routers.safetensors
  under the authors' names), atomically."""
  from safetensors.numpy import save_file
  _check_params(model)
  with_routers = _writes_routers(model, routers)
  config = _hf_config_for_export(model, model.dtype, with_routers)
  extra = _router_tensors(model) if with_routers else None
  with atomic_directory(os.fspath(directory), overwrite=overwrite,
                        protect=[model.source_dir]) as tmp:
    native.copy_side_files(model.source_dir, tmp)
    if extra:
      save_file({k: np.array(v, order="C") for k, v in extra.items()},
                os.path.join(tmp, ROUTERS_FILE), metadata={"format": "pt"})
    native.save_params(tmp, model.params, config, model.dtype)
