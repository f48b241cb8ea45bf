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
})

_MATH_KEYS = {
    "llama": frozenset({
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
        "rope_theta", "rope_scaling", "rope_parameters", "tie_word_embeddings",
        "attention_bias", "mlp_bias",
    }),
    "qwen3": frozenset({
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
        "rope_theta", "rope_scaling", "rope_parameters", "tie_word_embeddings",
        "attention_bias", "use_sliding_window", "sliding_window", "max_window_layers",
        "layer_types",
    }),
}

_ROPE_KEYS = {
    "default": frozenset({"rope_type", "type", "rope_theta"}),
    "llama3": frozenset({"rope_type", "type", "rope_theta", "factor", "low_freq_factor",
                         "high_freq_factor", "original_max_position_embeddings"}),
}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama 3.x frequency-dependent RoPE scaling (HF ``rope_type: llama3``)."""
  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position_embeddings: int


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
      rope = {"rope_type": "llama3", "rope_theta": self.rope_theta,
              **dataclasses.asdict(self.rope_scaling)}
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
  scaling = RopeScaling(
      factor=_get(params, "factor", float, source),
      low_freq_factor=_get(params, "low_freq_factor", float, source),
      high_freq_factor=_get(params, "high_freq_factor", float, source),
      original_max_position_embeddings=_get(params, "original_max_position_embeddings", int,
                                            source))
  if scaling.high_freq_factor <= scaling.low_freq_factor:
    _fail(source, "rope 'high_freq_factor' must exceed 'low_freq_factor'")
  return theta, scaling


def config_from_hf_dict(d: dict[str, Any], source: str = "config.json") -> ModelConfig:
  """Validates an HF config dict and returns the `ModelConfig` it describes."""
  if not isinstance(d, dict):
    _fail(source, "the config is not a JSON object")
  model_type = d.get("model_type")
  if model_type not in ARCHITECTURES:
    _fail(source, f"model_type {model_type!r} is not supported (supported: "
                  f"{', '.join(sorted(ARCHITECTURES))})")
  archs = d.get("architectures") or [ARCHITECTURES[model_type]]
  if archs != [ARCHITECTURES[model_type]]:
    _fail(source, f"architectures {archs} is not supported for model_type '{model_type}' "
                  f"(expected ['{ARCHITECTURES[model_type]}'])")
  unknown = sorted(set(d) - _METADATA_KEYS - _MATH_KEYS[model_type])
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
      max_position_embeddings=_get(d, "max_position_embeddings", int, source, default=131072),
  )


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


def rope_inv_freq(cfg: ModelConfig):
  """Inverse RoPE frequencies [H/2] in float64, exactly as HF derives them (then cast)."""
  import numpy as np
  h = cfg.head_dim
  inv = 1.0 / (cfg.rope_theta ** (np.arange(0, h, 2, dtype=np.int64).astype(np.float32) / h))
  inv = inv.astype(np.float32)
  s = cfg.rope_scaling
  if s is None:
    return inv
  low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
  high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
  wavelen = 2 * math.pi / inv
  scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
  smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
      s.high_freq_factor - s.low_freq_factor)
  smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
  medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)
