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
import re
import warnings
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
from elastic_jax import router_io
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


def _legacy_positional(where: str, args: tuple, kwargs: dict, order: tuple[str, ...]) -> dict:
  """Old positional arguments of the loaders, mapped to their keywords with a warning (they
  are keyword-only now, as in transformers). A dtype name in the first place is read as the
  dtype whatever the old order was, since that is what such a call meant."""
  if len(args) > len(order):
    raise ElasticJaxError(f"{where} takes the path and keywords only, got {1 + len(args)} "
                          "positional arguments")
  names = list(order)
  if args and isinstance(args[0], str) and args[0] in DTYPES + ("auto",) and names[0] != "dtype":
    names.remove("dtype")
    names.insert(0, "dtype")
  mapped = dict(zip(names, args))
  twice = sorted(set(mapped) & set(kwargs))
  if twice:
    raise ElasticJaxError(f"{where}: {twice[0]} is given both by position and by keyword")
  warnings.warn(f"{where}: pass {', '.join(f'{k}=' for k in mapped)} by keyword; positional "
                "arguments after the path stop working in the next release",
                DeprecationWarning, stacklevel=3)
  return {**kwargs, **mapped}


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
  def from_pretrained(cls, path: str | os.PathLike, *args, **kwargs) -> "ElasticModel":
    """The same as `elastic_jax.from_pretrained(path, *, dtype=..., routers=..., ...)`."""
    if args:   # the old order of this method: (path, routers, dtype)
      kwargs = _legacy_positional("ElasticModel.from_pretrained", args, kwargs,
                                  ("routers", "dtype"))
    return from_pretrained(path, **kwargs)

  def save_pretrained(self, directory: str | os.PathLike, **kwargs) -> None:
    """The same as `elastic_jax.save_pretrained(self, directory, ...)`: an HF directory with
    the routers, if the model has any (the authors' layout when theirs can hold them, else
    ours: a router export in `routers/` beside the backbone)."""
    save_pretrained(self, directory, **kwargs)

  def generate(self, prompts, attention: str | None = None, **kwargs):
    """Generates after each prompt; returns a `Generation` (`.texts` when a tokenizer is at
    hand, `.tokens` always).

    prompts: a text, a list of texts (tokenized with the model directory's tokenizer, or
      `tokenizer`), token ids as an array [T] or [B, T], or a list of token-id lists.
    attention: "elastic" (the default when the model has routers), "full" (the default
      otherwise), "forced" (with `gates`) or "sparse".
    max_new_tokens: one limit for every prompt, or one per prompt. It takes precedence over
      `sampling.max_new_tokens`, as every argument of the call does over the config.
    sampling: a `SamplingConfig` (temperature, top_p, seed, stop strings, ...).
    eos_ids: token ids that end a sequence (default: the tokenizer's EOS).
    The other keywords (attn_impl, return_logits, tokens_per_sync, layer_loop, prefill_chunk,
    pack, gates) are `elastic_jax.generation.generate.generate`'s.
    """
    unknown = sorted(set(kwargs) - set(_GENERATE_KEYWORDS))
    if unknown:
      raise ElasticJaxError(f"generate() got unknown keyword{'s' if len(unknown) > 1 else ''} "
                            f"{', '.join(unknown)}; it takes {', '.join(_GENERATE_KEYWORDS)}")
    return _generate(self, prompts, attention, **kwargs)

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
    ids = _array(input_ids, "input_ids", "integer token ids shaped [T] or [B, T]")
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
    mask = _array(attention_mask, "attention_mask", "0s and 1s shaped like input_ids")
    if mask.ndim == 1:
      mask = mask[None]
    if mask.shape != ids.shape:
      raise ElasticJaxError(f"attention_mask has shape {list(mask.shape)}, input_ids has "
                            f"{list(ids.shape)}")
    _check_mask(mask)
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
      plen = _array(prompt_lengths, "prompt_lengths", "one positive length per row").reshape(-1)
      if plen.shape != (b,) or not np.issubdtype(plen.dtype, np.integer) or (plen < 1).any():
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
      g = _array(gates, "gates", f"[L, B, K] = {[l, b, k]} or [L, K] with values in [0, 1]"
                 ).astype(np.float32)
      g = np.broadcast_to(g[:, None], (l, b, k)) if g.shape == (l, k) else g
      if g.shape == (l, b, k) and not np.all(np.isfinite(g)):
        raise ElasticJaxError("gates hold NaN or inf values; they must be finite, in [0, 1]")
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


def _array(x, name: str, what: str) -> np.ndarray:
  """`x` as a numeric numpy array, or one sentence saying what `name` must be."""
  try:
    a = np.asarray(x)
  except (TypeError, ValueError):   # ragged lists
    a = None
  if a is None or a.dtype == object or not (np.issubdtype(a.dtype, np.number)
                                            or a.dtype == np.bool_):
    raise ElasticJaxError(f"{name} must be {what}, got {type(x).__name__}"
                          + (" of rows of different lengths" if a is None or a.dtype == object
                             and isinstance(x, (list, tuple)) else ""))
  return a


def _check_mask(mask: np.ndarray) -> None:
  """An attention mask of 0s and 1s whose real tokens form one run per row (padding on the
  left or the right): a hole would number the tokens after it as if it were not there."""
  if not np.isin(mask, (0, 1)).all():
    raise ElasticJaxError("attention_mask must hold only 0 (padding) and 1 (real token)")
  m = mask.astype(np.int8)
  starts = np.sum(np.diff(m, axis=1, prepend=0) == 1, axis=1)
  if (starts > 1).any():
    row = int(np.argmax(starts > 1))
    raise ElasticJaxError(f"attention_mask row {row} has padding between real tokens; pad on "
                          "the left or the right only (for several sequences in one row, "
                          "pack them)")
  if (m.sum(1) == 0).any():
    raise ElasticJaxError(f"attention_mask row {int(np.argmin(m.sum(1)))} has no real token")


ROUTERS_FILE = "routers.safetensors"   # our format: the routers under the authors' names


def _generate(self: "ElasticModel", prompts, attention: str | None = None, *,
              max_new_tokens=None, sampling=None, eos_ids=None, tokenizer=None,
              gates=None, attn_impl: str | None = None, return_logits: bool = False,
              tokens_per_sync: int = 32, layer_loop: str = "auto",
              prefill_chunk: int | None = 8192, pack: bool | None = None):
  """Generates after each prompt: texts (tokenized with the model directory's tokenizer, or
  `tokenizer`) or lists of token ids. attention: how heads attend (default elastic when the
  model has routers, else full); the rest as `elastic_jax.generation.generate.generate`. EOS ids are the
  tokenizer's by default. max_new_tokens: one limit for every prompt, or a list of one per
  prompt. Returns a `Generation` (`.texts` when a tokenizer is at hand)."""
  from elastic_jax.generation.generate import SamplingConfig, generate
  prompts = _prompt_list(prompts)
  texts = isinstance(prompts[0], str)
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


_GENERATE_KEYWORDS = ("attention", "max_new_tokens", "sampling", "eos_ids", "tokenizer", "gates",
                      "attn_impl", "return_logits", "tokens_per_sync", "layer_loop",
                      "prefill_chunk", "pack")


def _prompt_list(prompts) -> list:
  """Prompts as a list of texts or of token-id sequences: a text, a list of texts, a token-id
  array [T] or [B, T] (numpy or jax), or a list of token-id sequences."""
  if isinstance(prompts, str):
    return [prompts]
  if isinstance(prompts, (np.ndarray, jax.Array)):
    ids = np.asarray(prompts)
    if ids.ndim not in (1, 2) or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
      raise ElasticJaxError(f"prompts as an array must be integer token ids shaped [T] or "
                            f"[B, T], got {ids.dtype} {list(ids.shape)}")
    return [ids.tolist()] if ids.ndim == 1 else [row.tolist() for row in ids]
  if isinstance(prompts, (list, tuple)) and prompts:
    if all(isinstance(p, str) for p in prompts):
      return list(prompts)
    if all(isinstance(p, (int, np.integer)) for p in prompts):
      return [list(prompts)]        # one prompt of token ids
    if not any(isinstance(p, str) for p in prompts):
      return [np.asarray(p).tolist() if isinstance(p, (np.ndarray, jax.Array)) else p
              for p in prompts]
  raise ElasticJaxError("generate takes a text, a list of texts, token ids ([T] or [B, T]) or "
                        f"a list of token-id lists, got {type(prompts).__name__}"
                        + (" (empty)" if isinstance(prompts, (list, tuple)) else "")
                        + ("" if not isinstance(prompts, (list, tuple)) or not prompts
                           else " mixing texts and token ids"))




ROUTERS_DIR = "routers"   # our full-model layout: a router export beside the backbone
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def hub_cache_dir() -> str:
  """The local Hugging Face hub cache, found as `huggingface_hub` finds it (HF_HUB_CACHE,
  then HF_HOME/hub, then ~/.cache/huggingface/hub), read at each call."""
  cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
  if cache:
    return os.path.expanduser(cache)
  home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache",
                                                    "huggingface")
  return os.path.join(os.path.expanduser(home), "hub")


def _hub_snapshot(repo_id: str, revision: str) -> str | None:
  """The directory of `repo_id` at `revision` (a branch, tag or commit) in the local hub
  cache, or None. Nothing is downloaded."""
  repo = os.path.join(hub_cache_dir(), "models--" + repo_id.replace("/", "--"))
  commit = revision
  ref = os.path.join(repo, "refs", revision)
  if os.path.isfile(ref):
    with open(ref, encoding="utf-8") as f:
      commit = f.read().strip()
  snapshot = os.path.join(repo, "snapshots", commit)
  return snapshot if commit and os.path.isdir(snapshot) else None


def _model_directory(path: str, revision: str) -> str:
  if os.path.isdir(path):
    return path
  if not os.path.exists(path) and _HUB_ID.fullmatch(path):
    snapshot = _hub_snapshot(path, revision)
    if snapshot is None:
      raise ElasticJaxError(f"{path}: neither a directory nor a model of the local Hugging "
                            f"Face cache at revision '{revision}' (looked in "
                            f"{hub_cache_dir()}; nothing is downloaded)")
    return snapshot
  raise ElasticJaxError(f"{path}: not a directory")


def from_pretrained(path: str | os.PathLike, *args, dtype: str = "auto",
                    routers: Routers | str | os.PathLike | None = None,
                    allow_pickle: bool = False, attn_impl: str = "reference",
                    show_progress: bool = True, revision: str = "main") -> ElasticModel:
  """Loads a model: an HF directory (safetensors), one that `convert` or `save_pretrained`
  wrote, one of the authors' released Elastic-Attention models, or a hub id ("org/name")
  already in the local Hugging Face cache (never downloaded).

  The authors' directories (PawQwen3ForCausalLM / PawLlamaForCausalLM) load with their
  routers, task multipliers and router config (convert/authors.py); a directory in our
  full-model layout with the router export in its `routers/` folder. Either way the model is
  ready for `logits(..., attention="elastic")` with no other argument.
  dtype: "auto" (the default: the checkpoint's own dtype, as transformers does),
    "bfloat16", "float32" or "float16".
  routers: a router export of train.py (its export/elastic_jax directory) or a `Routers` to
    attach; it replaces any routers the directory holds.
  allow_pickle: also read PyTorch `*.bin` weights (with `torch.load(weights_only=True)`).
  revision: for a hub id, the branch, tag or commit of the cached snapshot.
  Everything after the path is keyword-only (a positional dtype still works, with a warning).
  """
  if args:
    dtype = _legacy_positional("from_pretrained", args, {}, ("dtype",))["dtype"]
  if path is None or not isinstance(path, (str, os.PathLike)):
    raise ElasticJaxError(f"from_pretrained needs a directory path or a hub id, got {path!r}")
  path = _model_directory(os.fspath(path), revision)
  dtype = _check_dtype(dtype)
  get_attention(attn_impl)
  cfg, raw = read_hf_config(path)
  rcfg = (authors.router_config_from_authors(raw, os.path.join(path, "config.json"))
          if is_authors_config(raw) else None)
  ours = os.path.join(path, ROUTERS_DIR)
  if not os.path.isfile(os.path.join(ours, "routers.json")):
    ours = None
  elif rcfg is not None:
    raise ElasticJaxError(f"{path}: holds routers twice (the authors' architecture in its "
                          f"config and a router export in {ROUTERS_DIR}/); keep one")
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
  if routers is None and ours is not None:
    routers = ours
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


LAYOUTS = ("auto", "authors", "elastic_jax")


def _router_layout(model: ElasticModel, routers: bool, layout: str) -> str | None:
  """Where the routers go: None (the backbone alone), "authors" (their full-model layout) or
  "elastic_jax" (ours: a router export in `routers/` beside a plain backbone)."""
  if layout not in LAYOUTS:
    raise ElasticJaxError(f"layout '{layout}' is not one of {', '.join(LAYOUTS)}")
  if not routers or model.router_params is None:
    return None
  if layout == "elastic_jax":
    return layout
  problem = router_io.authors_layout_problem(model.router_config)
  if problem is None:
    return "authors"
  if layout == "authors":
    raise ElasticJaxError(f"{problem} (layout='auto' or 'elastic_jax' keeps them in ours)")
  return "elastic_jax"


def _check_target(directory, overwrite: bool) -> str:
  directory = os.fspath(directory)
  if os.path.exists(directory) and not overwrite:
    raise ElasticJaxError(f"{directory}: already exists (overwrite=True replaces it)")
  return directory


def _write_our_routers(model: ElasticModel, tmp: str) -> None:
  routers = Routers(jax.device_get(model.router_params), model.router_config, model.lambdas)
  router_io.write_routers(os.path.join(tmp, ROUTERS_DIR), routers, model.config,
                          targets=model.objective_targets)


def save_pretrained(model: ElasticModel, directory: str | os.PathLike, *,
                    dtype: str | None = None, max_shard_size: int = 5 * 2**30,
                    overwrite: bool = False, show_progress: bool = False,
                    routers: bool = True, layout: str = "auto") -> None:
  """Writes an HF directory (config.json + safetensors) that `transformers` loads, with the
  model's routers when it has any and `routers` is true.

  layout: where the routers go. "authors": their full-model layout (their architecture name
  and config keys, routers and multipliers beside the backbone), which their code and
  `transformers` both load; refused, naming what does not fit, for routers it cannot hold
  (another SSA block or boundary width, a static gate, ...). "elastic_jax": ours, a plain HF
  backbone with a router export in `routers/`. "auto" (default): the authors' when it fits,
  else ours. `from_pretrained(directory)` reads any of them back with its routers.
  With `dtype=None` the tensors keep the model's dtype, so HF -> ours -> HF is bit-exact.
  Written atomically: on failure nothing is left at `directory`.
  """
  directory = _check_target(directory, overwrite)
  dtype = _check_dtype(dtype or model.dtype, allow_auto=False)
  _check_params(model)
  where = _router_layout(model, routers, layout)
  config = _hf_config_for_export(model, dtype, where == "authors")
  extra = _router_tensors(model) if where == "authors" else None
  with atomic_directory(directory, overwrite=overwrite, protect=[model.source_dir]) as tmp:
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(config, f, indent=2, sort_keys=True)
    native.copy_side_files(model.source_dir, tmp)
    hf.write_hf_safetensors(model.params, model.config, tmp, dtype, max_shard_size,
                            show_progress=show_progress, extra=extra)
    if where == "elastic_jax":
      _write_our_routers(model, tmp)


def save_converted(model: ElasticModel, directory: str | os.PathLike, *,
                   overwrite: bool = False, routers: bool = True, layout: str = "auto") -> None:
  """Writes our own format (orbax params + config), atomically, with the routers when the
  model has any: under the authors' names in routers.safetensors when their layout holds
  them, else as a router export in `routers/` (`layout` as in `save_pretrained`)."""
  from safetensors.numpy import save_file
  directory = _check_target(directory, overwrite)
  _check_params(model)
  where = _router_layout(model, routers, layout)
  config = _hf_config_for_export(model, model.dtype, where == "authors")
  extra = _router_tensors(model) if where == "authors" else None
  with atomic_directory(directory, overwrite=overwrite, protect=[model.source_dir]) as tmp:
    native.copy_side_files(model.source_dir, tmp)
    if extra:
      save_file({k: np.array(v, order="C") for k, v in extra.items()},
                os.path.join(tmp, ROUTERS_FILE), metadata={"format": "pt"})
    native.save_params(tmp, model.params, config, model.dtype)
    if where == "elastic_jax":
      _write_our_routers(model, tmp)
