"""Model configuration, read from a Hugging Face ``config.json`` through an allow-list.

Every key of the HF config is either used, checked to hold a value this implementation
reproduces exactly, or known to be metadata that cannot change the logits. Any other key is
refused with an error naming it: a field we do not understand might change the maths, and a
model that silently computes something else is worse than one that does not load.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from elastic_jax.errors import ElasticJaxError

# Architectures this package implements, keyed by HF `model_type`.
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
# The authors' released Elastic-Attention models: the same backbones plus routers in the same
# directory (convert/authors.py reads and writes them).
AUTHORS_ARCHITECTURES = {"qwen3": "PawQwen3ForCausalLM", "llama": "PawLlamaForCausalLM"}

# The keys the authors' config adds (their PawQwen3Config), each with what elastic_jax does
# with it. "routing" keys become the model's RouterConfig (convert/authors.py checks their
# values); the others configure their training or variants we refuse elsewhere, and cannot
# change what an evaluated model computes.
AUTHORS_KEYS = {
    "enable_ada_sparsity": "routing: must be true (input-dependent routers); false means "
                           "static per-head masks, which their evaluation code does not run",
    "toggle_type": "routing: must be 'streaming' (sparse heads attend sink + local window)",
    "retrieval_mode": "routing: 'full' -> patterns fa-ssa, 'xattn' -> xa-ssa (full-routed heads "
                      "run XAttention)",
    "sink_size": "routing: sink tokens, a multiple of 128 -> router.sink_blocks",
    "local_window_size": "routing: window tokens, a multiple of 128 -> router.local_blocks",
    "pooling_mode": "routing: must be 'ctx_q' (the only mode their evaluation code runs): "
                    "boundary pooling of the prompt's first and last 100 tokens",
    "use_softmax": "routing: true -> two logits, argmax (router.relaxation softmax); false -> "
                   "one logit layer-normalised across the layer's KV heads, > 0 "
                   "(router.relaxation sigmoid, router.head_norm)",
    "xattn_threshold": "routing: XAttention's mass threshold (default 0.8, their code's value)",
    "xattn_stride": "routing: XAttention's antidiagonal stride (default 16)",
    "block_size": "routing: XAttention's block (default 128)",
    "mask_temp": "ignored: the router's inference temperature, which moves only the soft "
                 "probability, never the argmax",
    "enable_lambda_task": "training: per-task multipliers; their tensors are read when present",
    "suggested_sparsity": "training: rounds the static masks (enable_ada_sparsity false only)",
    "suggested_threshold": "training: threshold of the static masks (written at their save)",
    "disable_linear_regularization_term": "training: drops the lambda-1 term",
    "topk_k": "training: their top-k toggle variant (toggle_type topk)",
    "triangle_n_last": "training: their TriangleMix toggle variant",
    "enable_layerwise_sparsity": "training: a layer-wise sparsity schedule",
    "layerwise_sparsity_schedule": "training: a layer-wise sparsity schedule",
    "layerwise_sparsity_min_ratio": "training: a layer-wise sparsity schedule",
    "layerwise_sparsity_max_ratio": "training: a layer-wise sparsity schedule",
    "layerwise_sparsity_power": "training: a layer-wise sparsity schedule",
    "layerwise_sparsity_weight": "training: a layer-wise sparsity schedule",
    "erank_analysis_path": "training: a file of their analysis scripts",
    "pooling_seq": "training: unused by their code",
    "use_task_emb_for_mask": "training: a task embedding added to the pooled keys in training "
                             "only (its tensor is kept for export)",
    "enable_contrastive_loss": "training: an extra loss of theirs",
    "mask_hard_sample": "training: unused by their router",
}

# Keys that describe the checkpoint or generation defaults but never the forward pass.
_METADATA_KEYS = frozenset({
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype",
    "_name_or_path", "name_or_path", "use_cache", "initializer_range", "bos_token_id",
    "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "max_position_embeddings", "attention_dropout", "output_attentions",
    "output_hidden_states", "return_dict", "id2label", "label2id", "tokenizer_class",
    "prefix", "task_specific_params", "problem_type", "chunk_size_feed_forward",
    "is_encoder_decoder", "tie_encoder_decoder", "is_decoder", "add_cross_attention",
    "cross_attention_hidden_size", "finetuning_task", "torchscript", "use_bfloat16",
    "tf_legacy_loss", "pruned_heads", "bad_words_ids", "begin_suppress_tokens",
    "suppress_tokens", "num_labels", "quantization_config_ignored", "model_name",
    # Tensor-parallel plans and the pretraining slice count change how HF splits matmuls,
    # not their result.
    "base_model_tp_plan", "base_model_pp_plan", "pretraining_tp",
    # Which remote code would build the model; elastic_jax never runs it.
    "auto_map",
})

_MATH_KEYS = {
    "llama": frozenset({
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
        "rope_theta", "rope_scaling", "rope_parameters", "tie_word_embeddings",
        "original_max_position_embeddings",
        "attention_bias", "mlp_bias",
    }),
    "qwen3": frozenset({
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
        "rope_theta", "rope_scaling", "rope_parameters", "tie_word_embeddings",
        "original_max_position_embeddings",
        "attention_bias", "use_sliding_window", "sliding_window", "max_window_layers",
        "layer_types",
    }),
}

# transformers' defaults when a config omits max_position_embeddings (dynamic NTK RoPE and
# YaRN read it).
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "qwen3": 32768}

# RoPE types and the fields each reads (HF `rope_parameters` / legacy `rope_scaling`).
_ROPE_COMMON = frozenset({"rope_type", "type", "rope_theta"})
_ROPE_KEYS = {
    "default": _ROPE_COMMON,
    "linear": _ROPE_COMMON | {"factor"},
    "dynamic": _ROPE_COMMON | {"factor"},
    "llama3": _ROPE_COMMON | {"factor", "low_freq_factor", "high_freq_factor",
                              "original_max_position_embeddings"},
    "yarn": _ROPE_COMMON | {"factor", "original_max_position_embeddings", "attention_factor",
                            "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"},
}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE scaling of the HF families we serve (`rope_type`), computed as `transformers` does:

  linear   every frequency divided by `factor` (position interpolation);
  dynamic  NTK: the base grows with the sequence length once it passes
           max_position_embeddings (`dynamic_inv_freq`); length-dependent, see
           `model.rope_tables`;
  llama3   Llama 3.x: low frequencies divided by `factor`, high ones kept, a smooth ramp
           between (`low_freq_factor`, `high_freq_factor`, `original_max_position_embeddings`);
  yarn     YaRN: per-frequency blend of interpolation and extrapolation over the correction
           range set by `beta_fast` / `beta_slow` (floored and ceiled when `truncate`), and
           cos/sin scaled by `attention_factor` (default 0.1 ln(factor) + 1, or the ratio of
           the `mscale` / `mscale_all_dim` terms when both are given).
  """
  rope_type: str                   # linear | dynamic | llama3 | yarn
  factor: float
  original_max_position_embeddings: int | None = None   # llama3, yarn
  low_freq_factor: float | None = None                  # llama3
  high_freq_factor: float | None = None
  attention_factor: float | None = None                 # yarn (None: derived from factor)
  beta_fast: float | None = None
  beta_slow: float | None = None
  mscale: float | None = None
  mscale_all_dim: float | None = None
  truncate: bool = True

  def to_hf(self) -> dict[str, Any]:
    return {"rope_type": self.rope_type,
            **{k: v for k, v in dataclasses.asdict(self).items()
               if v is not None and k != "rope_type"
               and (self.rope_type == "yarn" or k != "truncate")}}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """What the forward pass needs; hashable so it can be a static argument of `jax.jit`."""
  family: str                      # "qwen3" | "llama"
  vocab_size: int                  # V
  hidden_size: int                 # E
  intermediate_size: int           # F
  num_layers: int                  # L
  num_heads: int                   # N, query heads
  num_kv_heads: int                # K, key/value heads (GQA group G = N / K)
  head_dim: int                    # H
  rms_norm_eps: float
  rope_theta: float
  rope_scaling: RopeScaling | None = None
  tie_word_embeddings: bool = False
  attention_bias: bool = False     # biases on q/k/v/o projections
  mlp_bias: bool = False           # biases on gate/up/down projections (Llama only)
  qk_norm: bool = False            # per-head RMSNorm on q and k before RoPE (Qwen3)
  max_position_embeddings: int = 131072

  @property
  def groups(self) -> int:
    return self.num_heads // self.num_kv_heads

  @property
  def max_length(self) -> int:
    """Longest sequence this model accepts: max_position_embeddings, or, with dynamic NTK
    RoPE (made to run past it), `factor` times that."""
    s = self.rope_scaling
    if s is not None and s.rope_type == "dynamic":
      return int(self.max_position_embeddings * max(s.factor, 1.0))
    return self.max_position_embeddings

  def max_length_text(self) -> str:
    """`max_length` in words, for error messages."""
    mpe = self.max_position_embeddings
    if self.max_length == mpe:
      return f"max_position_embeddings ({mpe})"
    return (f"limit ({self.max_length}: max_position_embeddings {mpe} times the dynamic RoPE "
            "factor)")

  def num_params(self) -> int:
    e, f, n, k, h, v = (self.hidden_size, self.intermediate_size, self.num_heads,
                        self.num_kv_heads, self.head_dim, self.vocab_size)
    attn = e * (n + 2 * k) * h + n * h * e
    attn += ((n + 2 * k) * h + e) if self.attention_bias else 0
    attn += 2 * h if self.qk_norm else 0
    mlp = 3 * e * f + ((2 * f + e) if self.mlp_bias else 0)
    per_layer = attn + mlp + 2 * e
    head = 0 if self.tie_word_embeddings else e * v
    return v * e + self.num_layers * per_layer + e + head

  def to_hf_dict(self) -> dict[str, Any]:
    """A minimal HF ``config.json`` that describes exactly this model."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
    if self.rope_scaling is not None:
      rope = {**self.rope_scaling.to_hf(), "rope_theta": self.rope_theta}
    out = {
        "architectures": [ARCHITECTURES[self.family]], "model_type": self.family,
        "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim, "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps,
        "rope_parameters": rope, "tie_word_embeddings": self.tie_word_embeddings,
        "attention_bias": self.attention_bias,
        "max_position_embeddings": self.max_position_embeddings,
    }
    if self.family == "llama":
      out["mlp_bias"] = self.mlp_bias
    return out


def _fail(source: str, msg: str):
  raise ElasticJaxError(f"{source}: {msg}")


def _get(d: dict, key: str, kind: type, source: str, default: Any = None, required=True):
  if key not in d or d[key] is None:
    if required and default is None:
      _fail(source, f"required field '{key}' is missing")
    return default
  value = d[key]
  if kind is float and isinstance(value, int) and not isinstance(value, bool):
    value = float(value)
  if kind is int and isinstance(value, bool) or not isinstance(value, kind):
    _fail(source, f"field '{key}' should be {kind.__name__}, got {value!r}")
  if kind in (int, float) and not value > 0:
    _fail(source, f"field '{key}' must be positive, got {value!r}")
  return value


def _parse_rope(d: dict, source: str) -> tuple[float, RopeScaling | None]:
  params = d.get("rope_parameters")
  legacy = d.get("rope_scaling")
  if params is not None and legacy is not None and legacy != params:
    _fail(source, "both 'rope_parameters' and 'rope_scaling' are set and they differ")
  params = params if params is not None else (legacy or {})
  if not isinstance(params, dict):
    _fail(source, f"field 'rope_parameters' should be an object, got {params!r}")
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type not in _ROPE_KEYS:
    _fail(source, f"rope type '{rope_type}' is not supported (supported: "
                  f"{', '.join(sorted(_ROPE_KEYS))})")
  extra = sorted(set(params) - _ROPE_KEYS[rope_type])
  if extra:
    _fail(source, f"rope field '{extra[0]}' is not supported for rope type '{rope_type}'")
  theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
  theta = _get({"rope_theta": theta}, "rope_theta", float, source)
  if rope_type == "default":
    return theta, None
  p = dict(params)
  if rope_type in ("llama3", "yarn"):
    # As transformers: a top-level original_max_position_embeddings wins, then the rope
    # field, then max_position_embeddings.
    orig = d.get("original_max_position_embeddings", p.get("original_max_position_embeddings"))
    p["original_max_position_embeddings"] = (
        orig if orig is not None else d.get("max_position_embeddings",
                                            _DEFAULT_MAX_POSITIONS[d.get("model_type")]))
  if rope_type == "yarn" and p.get("factor") is None and p["original_max_position_embeddings"]:
    # transformers derives a missing YaRN factor from the two lengths.
    p["factor"] = (d.get("max_position_embeddings", _DEFAULT_MAX_POSITIONS[d["model_type"]])
                   / p["original_max_position_embeddings"])

  def num(key, required=False):
    value = p.get(key)
    if value is None:
      if required:
        _fail(source, f"rope type '{rope_type}' needs field '{key}'")
      return None
    return _get({key: value}, key, float, f"{source} (rope field)")

  factor = num("factor", required=True)
  if rope_type == "linear" or rope_type == "dynamic":
    return theta, RopeScaling(rope_type, factor)
  orig = _get(p, "original_max_position_embeddings", int, f"{source} (rope field)")
  if rope_type == "llama3":
    scaling = RopeScaling(rope_type, factor, orig, low_freq_factor=num("low_freq_factor", True),
                          high_freq_factor=num("high_freq_factor", True))
    if scaling.high_freq_factor <= scaling.low_freq_factor:
      _fail(source, "rope 'high_freq_factor' must exceed 'low_freq_factor'")
    return theta, scaling
  truncate = p.get("truncate", True)
  if not isinstance(truncate, bool):
    _fail(source, f"rope field 'truncate' should be true or false, got {truncate!r}")
  # transformers reads beta_fast, beta_slow, mscale and mscale_all_dim with `or` / truth
  # tests: a 0 or null means "not given".
  for key in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
    if not p.get(key):
      p[key] = None
  return theta, RopeScaling(
      rope_type, factor, orig, attention_factor=num("attention_factor"),
      beta_fast=num("beta_fast") or 32.0, beta_slow=num("beta_slow") or 1.0,
      mscale=num("mscale"), mscale_all_dim=num("mscale_all_dim"), truncate=truncate)


def config_from_hf_dict(d: dict[str, Any], source: str = "config.json") -> ModelConfig:
  """Validates an HF config dict and returns the `ModelConfig` it describes."""
  if not isinstance(d, dict):
    _fail(source, "the config is not a JSON object")
  model_type = d.get("model_type")
  if model_type not in ARCHITECTURES:
    _fail(source, f"model_type {model_type!r} is not supported (supported: "
                  f"{', '.join(sorted(ARCHITECTURES))})")
  archs = d.get("architectures") or [ARCHITECTURES[model_type]]
  authors = archs == [AUTHORS_ARCHITECTURES[model_type]]
  if archs != [ARCHITECTURES[model_type]] and not authors:
    _fail(source, f"architectures {archs} is not supported for model_type '{model_type}' "
                  f"(expected ['{ARCHITECTURES[model_type]}'] or the authors' "
                  f"['{AUTHORS_ARCHITECTURES[model_type]}'])")
  unknown = sorted(set(d) - _METADATA_KEYS - _MATH_KEYS[model_type]
                   - (set(AUTHORS_KEYS) if authors else set()))
  if unknown:
    _fail(source, f"field '{unknown[0]}' is not implemented by elastic_jax for "
                  f"{model_type} and could change the model's output")
  if d.get("hidden_act", "silu") != "silu":
    _fail(source, f"field 'hidden_act' must be 'silu', got {d['hidden_act']!r}")
  if model_type == "qwen3":
    if d.get("use_sliding_window"):
      _fail(source, "field 'use_sliding_window' is true; sliding-window layers are not "
                    "implemented")
    layer_types = d.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
      _fail(source, "field 'layer_types' lists a layer type other than 'full_attention'")
  hidden = _get(d, "hidden_size", int, source)
  heads = _get(d, "num_attention_heads", int, source)
  kv_heads = _get(d, "num_key_value_heads", int, source, default=heads)
  if heads % kv_heads:
    _fail(source, f"num_attention_heads ({heads}) is not a multiple of "
                  f"num_key_value_heads ({kv_heads})")
  if "head_dim" in d and d["head_dim"] is not None:
    head_dim = _get(d, "head_dim", int, source)
  elif hidden % heads:
    _fail(source, f"hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads}) "
                  "and no 'head_dim' is given")
  else:
    head_dim = hidden // heads
  if head_dim % 2:
    _fail(source, f"head_dim ({head_dim}) must be even for rotary embeddings")
  theta, scaling = _parse_rope(d, source)
  for key in ("tie_word_embeddings", "attention_bias", "mlp_bias"):
    if key in d and not isinstance(d[key], bool):
      _fail(source, f"field '{key}' should be true or false, got {d[key]!r}")
  return ModelConfig(
      family=model_type,
      vocab_size=_get(d, "vocab_size", int, source),
      hidden_size=hidden,
      intermediate_size=_get(d, "intermediate_size", int, source),
      num_layers=_get(d, "num_hidden_layers", int, source),
      num_heads=heads,
      num_kv_heads=kv_heads,
      head_dim=head_dim,
      rms_norm_eps=_get(d, "rms_norm_eps", float, source, default=1e-6),
      rope_theta=theta,
      rope_scaling=scaling,
      # HF's default for both families is untied.
      tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
      attention_bias=bool(d.get("attention_bias", False)),
      mlp_bias=bool(d.get("mlp_bias", False)),
      qk_norm=model_type == "qwen3",
      max_position_embeddings=_get(d, "max_position_embeddings", int, source,
                                   default=_DEFAULT_MAX_POSITIONS[model_type]),
  )


def is_authors_config(d: dict[str, Any]) -> bool:
  """Whether an HF config dict is one of the authors' released models (Paw architectures)."""
  archs = d.get("architectures") or []
  return any(a in AUTHORS_ARCHITECTURES.values() for a in archs)


def read_config_file(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, Any]]:
  """Reads an HF ``config.json``; returns the parsed config and the raw dict (kept for export)."""
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise ElasticJaxError(f"{path}: no such config file")
  try:
    with open(path) as f:
      raw = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ElasticJaxError(f"{path}: not valid JSON ({e})") from None
  return config_from_hf_dict(raw, source=path), raw


def read_hf_config(directory: str | os.PathLike) -> tuple[ModelConfig, dict[str, Any]]:
  """Reads ``DIR/config.json`` (see `read_config_file`)."""
  path = os.path.join(directory, "config.json")
  if not os.path.isfile(path):
    raise ElasticJaxError(f"{path}: no config.json in this directory")
  return read_config_file(path)


def _default_inv_freq(theta: float, h: int):
  import numpy as np
  return (1.0 / (theta ** (np.arange(0, h, 2, dtype=np.int64).astype(np.float32) / h))
          ).astype(np.float32)


def rope_inv_freq(cfg: ModelConfig):
  """Inverse RoPE frequencies [H/2] float32, computed with transformers' float32 operations
  in its order, so the tables match it bit for bit (pow aside). For dynamic NTK this is the
  table at or below max_position_embeddings; longer inputs use `dynamic_inv_freq`."""
  import numpy as np
  h, s = cfg.head_dim, cfg.rope_scaling
  inv = _default_inv_freq(cfg.rope_theta, h)
  if s is None or s.rope_type == "dynamic":
    return inv
  if s.rope_type == "linear":
    return (inv / np.float32(s.factor)).astype(np.float32)
  if s.rope_type == "yarn":
    return _yarn_inv_freq(cfg.rope_theta, h, s)
  low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
  high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
  wavelen = 2 * math.pi / inv
  scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
  smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
      s.high_freq_factor - s.low_freq_factor)
  smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
  medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_inv_freq(theta: float, dim: int, s: RopeScaling):
  import numpy as np

  def correction_dim(rotations):
    return (dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(theta)))

  low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
  if s.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001      # as transformers, against a zero-width ramp
  pos_freqs = (theta ** (np.arange(0, dim, 2).astype(np.float32) / dim)).astype(np.float32)
  extrapolation = np.float32(1.0) / pos_freqs
  interpolation = np.float32(1.0) / (np.float32(s.factor) * pos_freqs)
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low))
                 / np.float32(high - low), 0, 1).astype(np.float32)
  keep = np.float32(1) - ramp       # share of the extrapolated (unscaled) frequency
  return (interpolation * (np.float32(1) - keep) + extrapolation * keep).astype(np.float32)


def rope_attention_factor(cfg: ModelConfig) -> float:
  """The factor transformers multiplies cos and sin by (YaRN's mscale; 1 otherwise)."""
  s = cfg.rope_scaling
  if s is None or s.rope_type != "yarn":
    return 1.0
  if s.attention_factor is not None:
    return s.attention_factor

  def mscale(scale, m=1.0):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

  if s.mscale and s.mscale_all_dim:
    return float(mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim))
  return mscale(s.factor)


def dynamic_inv_freq(cfg: ModelConfig, seq_len):
  """Dynamic NTK inverse frequencies [H/2] for a (traced) sequence length, float32 as
  transformers computes them: base * (factor * L / M - (factor - 1)) ** (H / (H - 2)) with
  L = max(seq_len, M), M = max_position_embeddings. At or below M this is the plain table."""
  import jax.numpy as jnp
  h, s, m = cfg.head_dim, cfg.rope_scaling, cfg.max_position_embeddings
  length = jnp.maximum(jnp.asarray(seq_len, jnp.int32), m).astype(jnp.float32)
  grow = (jnp.float32(s.factor) * length / jnp.float32(m)) - jnp.float32(s.factor - 1)
  base = jnp.float32(cfg.rope_theta) * grow ** jnp.float32(h / (h - 2))
  exponent = jnp.arange(0, h, 2, dtype=jnp.int32).astype(jnp.float32) / jnp.float32(h)
  return jnp.float32(1.0) / base ** exponent
