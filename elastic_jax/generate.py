"""Prefill, then decode with the per-head cache (kv_cache.py): greedy or sampled, batched.

The router decides each (layer, row, KV head)'s mode once, on the prompt, as in the method;
decoding keeps those modes. Rows of different lengths are right-padded: attention is causal,
so a row's real tokens never see its padding, and the fused kernels run unpacked.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from elastic_jax import kv_cache
from elastic_jax.config import ModelConfig
from elastic_jax.errors import ElasticJaxError
from elastic_jax.heads import FORWARD, check_attention
from elastic_jax.model import Params, decode_step, forward_routed, output_head
from elastic_jax.router import RouterConfig, esr, msr



@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  max_new_tokens: int = 64
  temperature: float = 0.0          # 0: greedy
  top_p: float = 1.0
  stop: tuple[str, ...] = ()        # stop strings (need a tokenizer to decode)
  seed: int = 0

  def __post_init__(self):
    if self.max_new_tokens < 1:
      raise ElasticJaxError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
    if self.temperature < 0 or not 0 < self.top_p <= 1:
      raise ElasticJaxError(f"temperature must be >= 0 and top_p in (0, 1], got "
                            f"{self.temperature} and {self.top_p}")


@dataclasses.dataclass
class Generation:
  """What `generate` returns: per row the new tokens (stop string or EOS included, nothing
  after), the text when a tokenizer was given, why it stopped; routing, cache and timings."""
  tokens: list[list[int]]
  texts: list[str] | None
  finish: list[str]                 # "eos", "stop" or "length"
  gates: np.ndarray                 # [L, B, K], 1 = full attention
  msr: np.ndarray                   # [B]
  esr: np.ndarray                   # [B]
  cache_bytes: int                  # the per-head cache, keys and values
  dense_cache_bytes: int            # a cache that keeps every position of every head
  prefill_seconds: float            # to the first token's logits (time-to-first-token),
                                    # compilation excluded (info["prefill_compile_seconds"])
  decode_seconds: float
  info: dict[str, Any] = dataclasses.field(default_factory=dict)
  logits: np.ndarray | None = None  # [steps, B, V] float32, with return_logits: the logits
                                    # each new token was chosen from


def _bucket(n: int, multiple: int = 128) -> int:
  """Padded prompt length: few distinct shapes, so few compilations."""
  return -(-n // multiple) * multiple


@functools.partial(jax.jit, static_argnames=("cfg", "rcfg", "attention", "attn_impl"))
def _prefill(params, ids_bt, seg_bt, lengths_b, router_params, forced, *, cfg, rcfg, attention,
             attn_impl):
  positions = jnp.broadcast_to(jnp.arange(ids_bt.shape[1], dtype=jnp.int32), ids_bt.shape)
  hidden, stats = forward_routed(
      params, ids_bt, positions, seg_bt, seg_bt > 0, cfg=cfg, rcfg=rcfg,
      attention=attention, router_params=router_params,
      forced_gates=forced, attn_impl=attn_impl, packed=False, return_hidden=True,
      return_kv=True)
  last = jnp.take_along_axis(hidden, (lengths_b - 1)[:, None, None], axis=1)[:, 0]
  logits = jnp.einsum("be,ev->bv", last, output_head(params, cfg),
                      preferred_element_type=jnp.float32)
  gates = (stats["gate"][:, :, 1] if "gate" in stats
           else jnp.zeros((cfg.num_layers,) + ids_bt.shape[:1] + (cfg.num_kv_heads,)))
  return logits, gates, stats.get("xa_kept"), stats["k"], stats["v"]


_PREFILL_EXECUTABLES: dict = {}


def _compiled_prefill(args: tuple, static: dict):
  """`_prefill` compiled ahead of time for these argument shapes (kept per shape), so that
  the timed call runs the executable alone: reported prefill times exclude compilation.
  Returns (executable, seconds spent compiling now: 0 when it was already compiled)."""
  leaves, tree = jax.tree.flatten(args)
  key = (tree, tuple((tuple(x.shape), str(x.dtype), getattr(x, "sharding", None))
                     for x in leaves),
         tuple(sorted(static.items())))
  if key not in _PREFILL_EXECUTABLES:
    start = time.perf_counter()
    _PREFILL_EXECUTABLES[key] = _prefill.lower(*args, **static).compile()
    return _PREFILL_EXECUTABLES[key], time.perf_counter() - start
  return _PREFILL_EXECUTABLES[key], 0.0


def _texts(tokens, finish, tokenizer, eos, stop) -> list[str]:
  """The generated texts, without EOS, cut before the stop string that ended a row."""
  texts = []
  for toks, why in zip(tokens, finish):
    text = tokenizer.decode([x for x in toks if x not in eos], skip_special_tokens=True)
    if why == "stop":
      text = text[:min(text.find(s) for s in stop if s in text)]
    texts.append(text)
  return texts


def _limits(per_request, default: int, b: int) -> np.ndarray:
  """New-token limits per row [B] int: `per_request` (one per prompt) or `default` for all."""
  if per_request is None:
    return np.full(b, default, np.int64)
  limits = np.asarray(per_request)
  if (limits.shape != (b,) or not np.issubdtype(limits.dtype, np.integer)
      or (limits < 1).any()):
    raise ElasticJaxError(f"max_new_tokens must give one integer >= 1 per prompt ({b}), got "
                          f"{list(np.atleast_1d(limits))}")
  return limits.astype(np.int64)


def _prompt_rows(prompts, cfg: ModelConfig, max_new_tokens: np.ndarray):
  """(ids [B, T], segments [B, T], lengths [B]) of right-padded prompt rows, T a bucket of
  128; every check of the prompts (and their new-token limits [B]) in one sentence each."""
  if isinstance(prompts, (str, bytes)) or not prompts or any(
      isinstance(p, (str, bytes)) or not hasattr(p, "__len__") for p in prompts):
    raise ElasticJaxError("prompts must be a list of token-id lists (tokenize text first)")
  if any(len(p) == 0 for p in prompts):
    raise ElasticJaxError("every prompt needs at least one token")
  for p in prompts:
    arr = np.asarray(p)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
      raise ElasticJaxError(f"prompts must hold integer token ids, got {arr.dtype} "
                            f"{list(arr.shape)}")
  lengths = np.asarray([len(p) for p in prompts], np.int32)
  total = lengths + max_new_tokens
  if int(total.max()) > cfg.max_length:
    i = int(np.argmax(total))
    raise ElasticJaxError(f"prompt ({int(lengths[i])} tokens) + max_new_tokens "
                          f"({int(max_new_tokens[i])}) exceeds the model's "
                          f"{cfg.max_length_text()}")
  t = _bucket(int(lengths.max()))
  ids = np.zeros((len(prompts), t), np.int32)
  seg = np.zeros((len(prompts), t), np.int32)
  for i, p in enumerate(prompts):
    ids[i, :len(p)], seg[i, :len(p)] = p, 1
  if ((ids < 0) | (ids >= cfg.vocab_size)).any():
    raise ElasticJaxError(f"a prompt holds a token id outside the vocabulary [0, "
                          f"{cfg.vocab_size})")
  return ids, seg, lengths


@functools.partial(jax.jit, static_argnames=("temperature", "top_p"))
def _sample(logits_bv, key, *, temperature, top_p):
  if temperature == 0:
    return jnp.argmax(logits_bv, -1).astype(jnp.int32)
  logits = logits_bv / temperature
  if top_p < 1:
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, -1)
    probs = jax.nn.softmax(sorted_logits, -1)
    keep = jnp.cumsum(probs, -1) - probs < top_p          # the smallest set reaching top_p
    sorted_logits = jnp.where(keep, sorted_logits, -jnp.inf)
    logits = jnp.full_like(logits, -jnp.inf).at[
        jnp.arange(logits.shape[0])[:, None], order].set(sorted_logits)
  return jax.random.categorical(key, logits, -1).astype(jnp.int32)


def generate(params: Params, cfg: ModelConfig, prompts: Sequence[Sequence[int]], *,
             attention: str = "elastic", rcfg: RouterConfig | None = None,
             router_params: Params | None = None, gates=None,
             sampling: SamplingConfig = SamplingConfig(), eos_ids: Sequence[int] = (),
             tokenizer=None, attn_impl: str = "auto", unroll_decode: bool = False,
             return_logits: bool = False,
             max_new_tokens: Sequence[int] | None = None) -> Generation:
  """Generate up to `sampling.max_new_tokens` tokens after each prompt (lists of token ids).

  attention: "full" (every head full, cache dense), "elastic" (routers decide; needs
  `router_params`), "forced" (`gates` [L, K] or [L, B, K], 1 = full), "sparse" (every head
  streaming). A row stops at an EOS id or, with a tokenizer, once its text holds a stop string.
  unroll_decode: unroll the decode step's loop over layers (`model.decode_step`).
  return_logits: also return the logits of every step (`Generation.logits`; one host copy of
  [B, V] per step).
  max_new_tokens: a limit per request (one int per prompt) in place of the sampling's; a row
  that reaches its own stops with finish "length" while the others go on.
  """
  check_attention(attention, FORWARD)
  if sampling.stop and tokenizer is None:
    raise ElasticJaxError("stop strings need a tokenizer to decode the generated text")
  if attention == "elastic" and router_params is None:
    raise ElasticJaxError("attention='elastic' needs trained routers (router_params)")
  rcfg = rcfg or RouterConfig()
  b, n_layers, kh = len(prompts), cfg.num_layers, cfg.num_kv_heads
  limits = _limits(max_new_tokens, sampling.max_new_tokens, b)
  ids, seg, lengths = _prompt_rows(prompts, cfg, limits)
  capacity_needed = int((lengths + limits).max())

  forced = None
  if attention == "forced":
    g = np.asarray(gates, np.float32)
    g = np.broadcast_to(g[:, None], (n_layers, b, kh)) if g.shape == (n_layers, kh) else g
    if g.shape != (n_layers, b, kh):
      raise ElasticJaxError(f"gates must be [L, K] or [L, B, K] = {[n_layers, b, kh]}, got "
                            f"{list(np.shape(gates))}")
    forced = jnp.asarray(np.stack([np.zeros_like(g), g], axis=2))

  args = (params, jnp.asarray(ids), jnp.asarray(seg), jnp.asarray(lengths), router_params,
          forced)
  prefill, compile_s = _compiled_prefill(args, dict(cfg=cfg, rcfg=rcfg, attention=attention,
                                                    attn_impl=attn_impl))
  jax.block_until_ready(args)
  start = time.perf_counter()
  logits, gates_lbk, xa_kept, k, v = prefill(*args)
  gates_np = np.asarray(jax.device_get(gates_lbk))
  if attention == "full":     # no routing: every head keeps every position
    gates_np = np.ones_like(gates_np)
  prefill_s = time.perf_counter() - start

  capacity = _bucket(capacity_needed)
  # XAttention selects blocks at prefill only: its heads decode as full heads (whole cache).
  cache_gates = np.ones_like(gates_np) if rcfg.patterns == "fa-xa" else gates_np
  cache = kv_cache.build(k, v, cache_gates, lengths, capacity, rcfg.streaming)
  del k, v
  dt = jax.tree.leaves(params)[0].dtype
  dense = kv_cache.dense_cache_bytes(n_layers, b, kh, capacity, cfg.head_dim, dt)

  key = jax.random.key(sampling.seed)
  eos = set(int(x) for x in eos_ids)
  out: list[list[int]] = [[] for _ in range(b)]
  finish = [""] * b
  pos = jnp.asarray(lengths)
  start = time.perf_counter()
  step_logits = []
  for step in range(int(limits.max())):
    if return_logits:
      step_logits.append(np.asarray(logits))
    key, sub = jax.random.split(key)
    tok = _sample(logits, sub, temperature=sampling.temperature, top_p=sampling.top_p)
    tok_np = np.asarray(tok)
    for i in range(b):
      if finish[i]:
        continue
      out[i].append(int(tok_np[i]))
      if tok_np[i] in eos:
        finish[i] = "eos"
      elif sampling.stop and any(s in tokenizer.decode(out[i]) for s in sampling.stop):
        finish[i] = "stop"
      elif len(out[i]) == limits[i]:
        finish[i] = "length"
    if all(finish):
      break
    logits, cache = decode_step(params, tok, pos, cache, cfg=cfg, rcfg=rcfg,
                                unroll=unroll_decode)
    pos = pos + 1
  jax.block_until_ready(logits)
  decode_s = time.perf_counter() - start
  finish = [f or "length" for f in finish]

  texts = None if tokenizer is None else _texts(out, finish, tokenizer, eos, sampling.stop)
  g = jnp.asarray(gates_np)
  return Generation(
      tokens=out, texts=texts, finish=finish, gates=gates_np,
      msr=np.asarray(msr(g[:, :, None]))[:, 0],
      esr=np.asarray(esr(g[-1][:, None], jnp.asarray(lengths)[:, None], rcfg.streaming,
                         patterns=rcfg.patterns if attention != "full" else "fa-ssa",
                         xa_kept_bsk=None if xa_kept is None else xa_kept[-1][:, None]))[:, 0],
      cache_bytes=cache.nbytes, dense_cache_bytes=dense, prefill_seconds=prefill_s,
      decode_seconds=decode_s,
      info={"new_tokens": sum(len(o) for o in out), "capacity": capacity,
            "prefill_compile_seconds": compile_s},
      logits=np.stack(step_logits) if return_logits else None)
