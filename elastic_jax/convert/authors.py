"""The authors' released Elastic-Attention models: their directory layout, in and out.

The authors publish whole Hugging Face directories (`PawQwen3ForCausalLM`,
`PawLlamaForCausalLM`; `model_type` stays qwen3 / llama): the backbone's tensors under the
usual names, and beside them in the same safetensors, per layer i,

    model.layers.{i}.self_attn.mask_allocator.cls_feat_extractor.{0,2}.{weight,bias}
    model.layers.{i}.self_attn.mask_allocator.cls_router_head_agnostic.{0,2,4}.{weight,bias}

(the task MLP and the router MLP, PyTorch Linear layout [out, in]) and the task multipliers
`model.sparsity_lambda{1,2}_task` [5]. Their model also saves tensors that evaluation never
reads (the static masks `...self_attn.attn_mask_log_alphas` [K], the global multipliers
`model.sparsity_lambda_{1,2}` [1], a task embedding, a temperature buffer): they are kept
verbatim so that writing the model back gives the same directory, tensor by tensor.

Their config keys (`config.AUTHORS_KEYS` lists each with what we do with it) become a
`RouterConfig`: sink and window sizes in blocks of 128 tokens, `retrieval_mode` the pattern pair,
`use_softmax` the relaxation, `pooling_mode` ctx_q the boundary pooling of their evaluation
code. A directory whose keys or tensors we cannot run as they do is refused, naming the key
or tensor.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import ml_dtypes
import numpy as np

from elastic_jax.config import AUTHORS_ARCHITECTURES, AUTHORS_KEYS, ModelConfig
from elastic_jax.errors import ElasticJaxError
from elastic_jax.router import RouterConfig

BLOCK = 128                 # their kernels' block: sink and window are counted in these
BOUNDARY = 100              # their evaluation code pools the first and last 100 prompt tokens
NUM_TASKS = 5               # Single QA, MultiHop QA, Summarization, Code, In-Context Learning
DEFAULT_XA_THRESHOLD = 0.8  # what their code runs (xattn_params); our default is 0.9 (docs/method.md §10)
DEFAULT_XA_STRIDE = 16

# Our stacked router tensors -> (their module, Linear index) per layer.
ROUTER_LINEARS = {
    "task_w1": ("cls_feat_extractor", 0), "task_w2": ("cls_feat_extractor", 2),
    "route_w1": ("cls_router_head_agnostic", 0), "route_w2": ("cls_router_head_agnostic", 2),
    "route_w3": ("cls_router_head_agnostic", 4),
}
_ROUTER_NAME = "model.layers.{i}.self_attn.mask_allocator.{module}.{index}.{kind}"
LAMBDAS = {"l1": "model.sparsity_lambda1_task", "l2": "model.sparsity_lambda2_task"}
# Tensors their model saves that no evaluation reads; kept for export. "{i}" is a layer.
_KEPT = {
    "model.layers.{i}.self_attn.attn_mask_log_alphas": "static head masks (per KV head)",
    "model.layers.{i}.self_attn.mask_allocator.log_temp": "router temperature buffer",
    "model.layers.{i}.self_attn.mask_allocator.task_embedding.weight": "task embedding",
    "model.sparsity_lambda_1": "global multiplier",
    "model.sparsity_lambda_2": "global multiplier",
}
_AUTHORS_NAME = re.compile(
    r"^model\.(layers\.\d+\.self_attn\.(mask_allocator\..*|attn_mask_log_alphas)"
    r"|sparsity_lambda.*)$")
_KEPT_PATTERNS = [re.compile("^" + re.escape(k).replace(r"\{i\}", r"\d+") + "$") for k in _KEPT]
_NP_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def is_authors_name(name: str) -> bool:
  """Whether a tensor name belongs to the authors' router layout (not to the backbone)."""
  return bool(_AUTHORS_NAME.match(name))


@dataclasses.dataclass
class AuthorsExtras:
  """What an authors' directory holds beside backbone, routers and task multipliers, and the
  dtype of its router tensors: kept so that writing the model back reproduces it exactly."""
  tensors: dict[str, np.ndarray]
  router_dtype: str = "float32"


# ----------------------------------------------------------------------------------------------
# Config keys


def _key(raw: dict, key: str, default: Any) -> Any:
  """A key of theirs, with their PawQwen3Config default when absent."""
  value = raw.get(key, default)
  return default if value is None else value


def _blocks(raw: dict, key: str, default: int, source: str) -> int:
  size = _key(raw, key, default)
  if isinstance(size, bool) or not isinstance(size, int) or size < BLOCK or size % BLOCK:
    raise ElasticJaxError(f"{source}: '{key}' is {size!r}; elastic_jax needs a positive "
                          f"multiple of the {BLOCK}-token block (their kernels round it up)")
  return size // BLOCK


def router_config_from_authors(raw: dict[str, Any], source: str = "config.json"
                               ) -> RouterConfig:
  """The RouterConfig their keys describe; refuses, by name, what we do not run as they do."""
  def fail(msg):
    raise ElasticJaxError(f"{source}: {msg}")

  if _key(raw, "enable_ada_sparsity", False) is not True:
    fail("'enable_ada_sparsity' is not true: this model routes with static per-head masks "
         "(attn_mask_log_alphas), which their evaluation code does not run; elastic_jax "
         "runs input-dependent routers only")
  toggle = _key(raw, "toggle_type", "streaming")
  if toggle != "streaming":
    fail(f"'toggle_type' is {toggle!r}; elastic_jax runs the authors' 'streaming' sparse "
         "heads only")
  retrieval = _key(raw, "retrieval_mode", "full")
  if retrieval not in ("full", "xattn"):
    fail(f"'retrieval_mode' is {retrieval!r} (known: 'full', 'xattn')")
  pooling = _key(raw, "pooling_mode", "first_token")
  if pooling != "ctx_q":
    fail(f"'pooling_mode' is {pooling!r}; their evaluation code runs 'ctx_q' only (the mean "
         "of the prompt's first and last 100 keys)")
  softmax = _key(raw, "use_softmax", False)
  if not isinstance(softmax, bool):
    fail(f"'use_softmax' should be true or false, got {softmax!r}")
  xa = {}
  for key, field, default, kind in (("xattn_threshold", "xa_threshold", DEFAULT_XA_THRESHOLD,
                                     float), ("xattn_stride", "xa_stride", DEFAULT_XA_STRIDE,
                                              int), ("block_size", "xa_block", BLOCK, int)):
    value = _key(raw, key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
        kind is int and value != int(value)):
      fail(f"'{key}' should be a {kind.__name__}, got {value!r}")
    xa[field] = kind(value)
  try:
    return RouterConfig(
        pooling="boundary", boundary=BOUNDARY, hidden_mult=4,
        relaxation="softmax" if softmax else "sigmoid", head_norm=not softmax,
        sink_blocks=_blocks(raw, "sink_size", 128, source),
        local_blocks=_blocks(raw, "local_window_size", 1024, source), block=BLOCK,
        patterns="fa-ssa" if retrieval == "full" else "xa-ssa", **xa)
  except ValueError as e:
    raise ElasticJaxError(f"{source}: {e}") from None


def authors_keys(rcfg: RouterConfig, *, lambdas: bool) -> dict[str, Any]:
  """Their config keys for a RouterConfig; refuses what their layout cannot express."""
  problems = []
  if rcfg.static:
    problems.append("a static router (one logit pair per head) has no place in it")
  if rcfg.patterns == "fa-xa":
    problems.append("it has no FA-XA pattern pair with toggle_type streaming")
  if rcfg.block != BLOCK:
    problems.append(f"its SSA block is {BLOCK} tokens, this router's is {rcfg.block}")
  if rcfg.pooling == "boundary" and rcfg.boundary != BOUNDARY:
    problems.append(f"its evaluation pools {BOUNDARY} boundary tokens, this router "
                    f"{rcfg.boundary}")
  if rcfg.hidden_mult != 4:
    problems.append("its MLPs are 4 x head_dim wide")
  if not rcfg.task_mlp:
    problems.append("its routers have a task MLP")
  if rcfg.relaxation == "sigmoid" and not rcfg.head_norm:
    problems.append("its evaluation code layer-normalises a sigmoid router's logits across "
                    "heads (train with router.head_norm=true)")
  if problems:
    raise ElasticJaxError(f"these routers cannot be written in the authors' layout: "
                          f"{'; '.join(problems)}")
  keys = {"enable_ada_sparsity": True, "toggle_type": "streaming",
          "retrieval_mode": "full" if rcfg.patterns == "fa-ssa" else "xattn",
          "sink_size": rcfg.sink_blocks * BLOCK,
          "local_window_size": rcfg.local_blocks * BLOCK,
          "pooling_mode": "ctx_q", "use_softmax": rcfg.relaxation == "softmax",
          "enable_lambda_task": lambdas}
  if rcfg.uses_xattention:
    keys.update(xattn_threshold=rcfg.xa_threshold, xattn_stride=rcfg.xa_stride,
                block_size=rcfg.xa_block)
  return keys


def authors_config(base: dict[str, Any], family: str, rcfg: RouterConfig, *,
                   lambdas: bool) -> dict[str, Any]:
  """`base` (an HF config dict) as one of their configs for these routers. Keys already
  there keep their exact value when it means the same, so a round trip changes nothing."""
  def same(a, b):
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b))
    return float(a) == float(b) if numbers else (type(a) is type(b) and a == b)

  out = dict(base)
  out["architectures"] = [AUTHORS_ARCHITECTURES[family]]
  for key, value in authors_keys(rcfg, lambdas=lambdas).items():
    if key == "enable_lambda_task" and not value and key not in out:
      continue
    if key not in out or not same(out[key], value):
      out[key] = value
  return out


# ----------------------------------------------------------------------------------------------
# Tensors


def _router_shapes(cfg: ModelConfig, rcfg: RouterConfig) -> dict[str, tuple[int, ...]]:
  """Our stacked router tensor -> its shape for one layer (our layout: weight [in, out])."""
  h, w = cfg.head_dim, rcfg.hidden_mult * cfg.head_dim
  return {"task_w1": (h, w), "task_w2": (w, h), "route_w1": (h, w), "route_w2": (w, h),
          "route_w3": (h, rcfg.num_logits)}


def router_names(cfg: ModelConfig, rcfg: RouterConfig
                 ) -> dict[str, tuple[str, int, str, tuple[int, ...]]]:
  """Their tensor name -> (our stacked tensor, layer, weight|bias, their shape)."""
  out = {}
  for ours, (module, index) in ROUTER_LINEARS.items():
    fan_in, fan_out = _router_shapes(cfg, rcfg)[ours]
    for i in range(cfg.num_layers):
      out[_ROUTER_NAME.format(i=i, module=module, index=index, kind="weight")] = (
          ours, i, "weight", (fan_out, fan_in))
      out[_ROUTER_NAME.format(i=i, module=module, index=index, kind="bias")] = (
          ours.replace("w", "b"), i, "bias", (fan_out,))
  return out


def read_routers(src, cfg: ModelConfig, rcfg: RouterConfig):
  """(router params stacked over layers, multipliers or None, AuthorsExtras) from the tensors
  of `src` (a convert.hf.TensorSource) whose names are the authors'.

  Every router tensor of every layer must be there with its shape; multipliers, when present,
  hold one value per task type; any other tensor under their names must be one their model
  saves (kept for export). Float32 in, whatever the checkpoint's dtype.
  """
  names = router_names(cfg, rcfg)
  theirs = sorted(n for n in src.names if is_authors_name(n))
  missing = sorted(set(names) - set(theirs))
  if missing:
    more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
    raise ElasticJaxError(f"{src.directory}: router tensor '{missing[0]}' is missing{more}")
  router: dict[str, np.ndarray] = {}
  for ours, shape in _router_shapes(cfg, rcfg).items():
    router[ours] = np.zeros((cfg.num_layers, *shape), np.float32)
    router[ours.replace("w", "b")] = np.zeros((cfg.num_layers, shape[1]), np.float32)
  dtypes = set()
  for name, (ours, layer, kind, shape) in names.items():
    got = src.shape(name)
    if got != shape:
      raise ElasticJaxError(f"{src.directory}: router tensor '{name}' has shape {list(got)}, "
                            f"expected {list(shape)} (head_dim {cfg.head_dim}, "
                            f"{'two logits' if rcfg.num_logits == 2 else 'one logit'})")
    raw = src.get(name)
    dtypes.add(str(raw.dtype))
    value = np.asarray(raw, np.float32)
    if not np.all(np.isfinite(value)):
      raise ElasticJaxError(f"{src.directory}: router tensor '{name}' holds NaN or inf values")
    router[ours][layer] = value.T if kind == "weight" else value
  lambdas = None
  present = [n for n in LAMBDAS.values() if n in src.names]
  if present:
    if len(present) != len(LAMBDAS):
      raise ElasticJaxError(f"{src.directory}: tensor '{present[0]}' is there but "
                            f"'{(set(LAMBDAS.values()) - set(present)).pop()}' is not")
    lambdas = {}
    for ours, name in LAMBDAS.items():
      if src.shape(name) != (NUM_TASKS,):
        raise ElasticJaxError(f"{src.directory}: multiplier tensor '{name}' has shape "
                              f"{list(src.shape(name))}, expected [{NUM_TASKS}] (one per task "
                              "type)")
      lambdas[ours] = np.asarray(src.get(name), np.float32)
      if not np.all(np.isfinite(lambdas[ours])):
        raise ElasticJaxError(f"{src.directory}: multiplier tensor '{name}' holds NaN or inf "
                              "values")
  kept = {}
  for name in theirs:
    if name in names or name in LAMBDAS.values():
      continue
    if not any(p.match(name) for p in _KEPT_PATTERNS):
      raise ElasticJaxError(f"{src.directory}: tensor '{name}' is not part of the authors' "
                            "router layout as elastic_jax knows it")
    layer = re.match(r"^model\.layers\.(\d+)\.", name)
    if layer and int(layer.group(1)) >= cfg.num_layers:
      raise ElasticJaxError(f"{src.directory}: tensor '{name}' names layer "
                            f"{layer.group(1)} of a {cfg.num_layers}-layer model")
    kept[name] = np.asarray(src.get(name))
  dtype = dtypes.pop() if len(dtypes) == 1 else "float32"
  return router, lambdas, AuthorsExtras(kept, dtype if dtype in _NP_DTYPES else "float32")


def authors_tensors(router: dict[str, Any], lambdas: dict[str, Any] | None, num_layers: int,
                    dtype: str = "float32") -> dict[str, np.ndarray]:
  """Routers (and multipliers) under their names, PyTorch Linear layout, in `dtype`."""
  np_dtype = _NP_DTYPES[dtype]
  router = {k: np.asarray(v, np.float32) for k, v in router.items()}
  out = {}
  for name, (module, index) in ROUTER_LINEARS.items():
    bias = router[name.replace("w", "b")]
    for i in range(num_layers):
      out[_ROUTER_NAME.format(i=i, module=module, index=index, kind="weight")] = (
          np.ascontiguousarray(router[name][i].T).astype(np_dtype))
      out[_ROUTER_NAME.format(i=i, module=module, index=index, kind="bias")] = (
          bias[i].astype(np_dtype))
  for ours, name in LAMBDAS.items():
    if lambdas is not None:
      out[name] = np.asarray(lambdas[ours], np.float32).astype(np_dtype)
  return out


def describe_keys() -> str:
  """Their config keys and what elastic_jax does with each, one per line (README, CLI)."""
  return "\n".join(f"{k}: {v}" for k, v in AUTHORS_KEYS.items())
