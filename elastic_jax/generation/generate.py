"""Prefill, then decode with the per-head cache (kv_cache.py): greedy or sampled, batched.

The router decides each (layer, row, KV head)'s mode once, on the prompt, as in the method;
decoding keeps those modes. A batch's prompts prefill packed one after the other in one row
(`prefill.arrange`; the fused kernels keep them apart by segment and skip the tiles between
them), or right-padded to the longest (on the jnp reference, or pack=False; attention is
causal, so a row's real tokens never see its padding).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from elastic_jax.attention.registry import KERNELS, parse_impl
from elastic_jax.config import ModelConfig
from elastic_jax.errors import ElasticJaxError
from elastic_jax.generation import aot, kv_cache, prefill
from elastic_jax.heads import FORWARD, check_attention
from elastic_jax.model import Params, decode_step, unstack_layers
from elastic_jax.router import RouterConfig, esr, msr



def _is_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_real(x) -> bool:
  return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(
      x, (bool, np.bool_))


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  max_new_tokens: int = 64
  temperature: float = 0.0          # 0: greedy
  top_p: float = 1.0
  stop: tuple[str, ...] = ()        # stop strings (need a tokenizer to decode)
  seed: int = 0

  def __post_init__(self):
    if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
      raise ElasticJaxError(f"max_new_tokens must be an integer >= 1, got "
                            f"{self.max_new_tokens!r}")
    for name in ("temperature", "top_p"):
      value = getattr(self, name)
      if not _is_real(value) or not np.isfinite(value):
        raise ElasticJaxError(f"{name} must be a finite number, got {value!r}")
      object.__setattr__(self, name, float(value))
    if self.temperature < 0 or not 0 < self.top_p <= 1:
      raise ElasticJaxError(f"temperature must be >= 0 and top_p in (0, 1], got "
                            f"{self.temperature} and {self.top_p}")
    if not _is_int(self.seed):
      raise ElasticJaxError(f"seed must be an integer, got {self.seed!r}")
    stop = self.stop
    if isinstance(stop, str) or not isinstance(stop, (tuple, list)) or not all(
        isinstance(x, str) for x in stop):
      raise ElasticJaxError(f"stop must be a tuple of strings, e.g. stop=(\"\\n\\n\",), got "
                            f"{stop!r}")
    if any(x == "" for x in stop):
      raise ElasticJaxError("stop strings must not be empty (an empty one would stop every row "
                            "after its first token)")
    object.__setattr__(self, "stop", tuple(stop))


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
  prefill_seconds: float            # to the first token's logits and the filled cache
                                    # (time-to-first-token), compilation excluded
                                    # (info["prefill_compile_seconds"])
  decode_seconds: float
  info: dict[str, Any] = dataclasses.field(default_factory=dict)
  # info: new_tokens, capacity, layer_loop, prefill ("whole" or "by_layer": `prefill.py`),
  # packed (the prompts prefilled packed in one row),
  # prefill_compile_seconds, decode_compile_seconds, and the
  # device bytes at the peak of the prefill phase and of a decode loop (prefill_peak_bytes,
  # decode_peak_bytes: XLA's buffer assignment, `aot.footprint`; None where not reported).
  logits: np.ndarray | None = None  # [steps, B, V] float32, with return_logits: the logits
                                    # each new token was chosen from


def capacity_bucket(n: int) -> int:
  """The cache capacity for n positions: a multiple of 1/8 of the power of two below n (at
  least 128), so that a decode compilation serves every request whose prompt and limit fit,
  for at most 1/8 more memory. The decode kernels read only the live positions."""
  step = max(128, (1 << max(0, n.bit_length() - 1)) // 8)
  return prefill.round_up(n, step)


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


def _eos_set(eos_ids) -> set[int]:
  """The EOS ids (an integer or a sequence of them) as a set; anything else is refused."""
  if _is_int(eos_ids):
    return {int(eos_ids)}
  ids = None
  if not isinstance(eos_ids, (str, bytes, dict)):
    try:
      ids = np.asarray(list(eos_ids), dtype=object).reshape(-1)
    except (TypeError, ValueError):
      pass
  if ids is None or not all(_is_int(x) for x in ids):
    raise ElasticJaxError(f"eos_ids must be a list of integer token ids, got {eos_ids!r}")
  return {int(x) for x in ids}


def _check_prompts(prompts, cfg: ModelConfig, max_new_tokens: np.ndarray) -> np.ndarray:
  """Every check of the prompts (and their new-token limits [B]) in one sentence each;
  returns the prompt lengths [B]."""
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
    if ((arr < 0) | (arr >= cfg.vocab_size)).any():
      raise ElasticJaxError(f"a prompt holds a token id outside the vocabulary [0, "
                            f"{cfg.vocab_size})")
  lengths = np.asarray([len(p) for p in prompts], np.int32)
  total = lengths + max_new_tokens
  if int(total.max()) > cfg.max_length:
    i = int(np.argmax(total))
    raise ElasticJaxError(f"prompt ({int(lengths[i])} tokens) + max_new_tokens "
                          f"({int(max_new_tokens[i])}) exceeds the model's "
                          f"{cfg.max_length_text()}")
  return lengths


def _sample(logits_bv, key, temperature, top_p):
  if temperature == 0:
    return jnp.argmax(logits_bv, -1).astype(jnp.int32)
  # Shifted by the row's largest logit first: a small temperature then sharpens toward the
  # argmax instead of overflowing every logit to inf.
  logits = (logits_bv - jnp.max(logits_bv, -1, keepdims=True)) / temperature
  if top_p < 1:
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, -1)
    probs = jax.nn.softmax(sorted_logits, -1)
    keep = jnp.cumsum(probs, -1) - probs < top_p          # the smallest set reaching top_p
    sorted_logits = jnp.where(keep, sorted_logits, -jnp.inf)
    logits = jnp.full_like(logits, -jnp.inf).at[
        jnp.arange(logits.shape[0])[:, None], order].set(sorted_logits)
  return jax.random.categorical(key, logits, -1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("temperature", "top_p"))
def _first_token(logits_bv, key, limits_b, eos, *, temperature, top_p):
  """The first new token from the prefill's logits: (tokens [B], counts [B], done [B], key)."""
  key, sub = jax.random.split(key)
  tok = _sample(logits_bv, sub, temperature, top_p)
  done = jnp.isin(tok, eos) | (limits_b <= 1)
  return tok, jnp.ones_like(tok), done, key


@functools.partial(jax.jit, static_argnames=(
    "cfg", "rcfg", "steps", "temperature", "top_p", "unroll", "impl", "keep_logits"),
    donate_argnames=("cache",))
def _decode_tokens(params, cache, tok, count, done, key, lengths, limits, eos, *, cfg, rcfg,
                   steps, temperature, top_p, unroll, impl, keep_logits):
  """Up to `steps` decode steps in one device loop, which ends early once every row is done.

  tok [B]: each row's last token, not yet fed to the model; count [B]: tokens generated so far
  (position of tok: lengths + count - 1); done [B]: rows that stopped (EOS, their limit, or a
  stop string found on the host), which keep feeding their last token at its position, a
  write that changes nothing. Returns (tok, cache, count, done, key, tokens [steps, B] with -1
  where a row generated nothing, logits [steps, B, V] or [0, B, V]).
  """
  b = tok.shape[0]
  toks = jnp.full((steps, b), -1, jnp.int32)
  logits_buf = jnp.zeros((steps if keep_logits else 0, b, cfg.vocab_size), jnp.float32)

  def body(c):
    i, tok, cache, count, done, key, toks, logits_buf = c
    logits, cache = decode_step(params, tok, lengths + count - 1, cache, cfg=cfg, rcfg=rcfg,
                                unroll=unroll, impl=impl)
    key, sub = jax.random.split(key)
    new = _sample(logits, sub, temperature, top_p)
    live = jnp.logical_not(done)
    tok = jnp.where(live, new, tok)
    toks = toks.at[i].set(jnp.where(live, new, -1))
    if keep_logits:
      logits_buf = logits_buf.at[i].set(logits)
    count = count + live
    done = done | (live & (jnp.isin(new, eos) | (count >= limits)))
    return i + 1, tok, cache, count, done, key, toks, logits_buf

  def cond(c):
    return (c[0] < steps) & jnp.logical_not(jnp.all(c[4]))

  _, tok, cache, count, done, key, toks, logits_buf = jax.lax.while_loop(
      cond, body, (jnp.int32(0), tok, cache, count, done, key, toks, logits_buf))
  return tok, cache, count, done, key, toks, logits_buf


def choose_layer_loop(params: Params, cache_bytes: int) -> str:
  """"split" where the device reports a memory limit that holds the weights, a second copy of
  the layer weights and the cache with a quarter to spare (or reports none: a CPU), else
  "scan"."""
  stats = jax.devices()[0].memory_stats() or {}
  limit = stats.get("bytes_limit")
  if not limit:
    return "split"
  need = aot.tree_bytes(params) + aot.tree_bytes(params["layers"]) + cache_bytes
  return "split" if need <= 0.75 * limit else "scan"


def decode_impl_for(attn_impl: str) -> str:
  """The decode attention (`generation.decode`) that goes with a prefill implementation: a
  backend's name takes its backend's decode kernel (`attention.registry.decode_kernel`)."""
  name, interpret = parse_impl(attn_impl)
  if name in KERNELS:
    return name + (":interpret" if interpret else "")
  return "auto" if name == "auto" else "reference"


class _Rows:
  """The host's view of the rows being generated: their tokens and why each stopped."""

  def __init__(self, limits, eos: set, stop, tokenizer):
    self.limits, self.eos, self.stop, self.tokenizer = limits, eos, stop, tokenizer
    self.tokens: list[list[int]] = [[] for _ in limits]
    self.finish = [""] * len(limits)

  def take(self, tokens_b) -> None:
    """One step's tokens (-1: none) into the rows still open; their finish reasons."""
    for i, (out, tok) in enumerate(zip(self.tokens, tokens_b)):
      if self.finish[i] or tok < 0:
        continue
      out.append(int(tok))
      if tok in self.eos:
        self.finish[i] = "eos"
      elif self.stop and any(s in self.tokenizer.decode(out) for s in self.stop):
        self.finish[i] = "stop"
      elif len(out) == self.limits[i]:
        self.finish[i] = "length"


def _decode(params, cache, logits, lengths, rows: _Rows, layer_loop: str, seed: int,
            static: dict) -> dict:
  """Decodes until every row stopped, `static["steps"]` steps per device loop, from the
  prefill's logits; fills `rows`. Returns the decoding seconds (the per-layer weight copy
  included, compilation excluded), compile seconds, peak device bytes of a loop and, with
  static["keep_logits"], the logits of every step."""
  eos = jnp.asarray(sorted(rows.eos) or [-1], jnp.int32)
  limits, lengths = jnp.asarray(rows.limits, jnp.int32), jnp.asarray(lengths)
  step_params, split_s, compile_s = params, 0.0, 0.0
  if layer_loop == "split":
    unstack, compile_s = aot.compiled(unstack_layers, (params["layers"],), {})
    start = time.perf_counter()
    step_params = dict(params, layers=jax.block_until_ready(unstack(params["layers"])))
    split_s = time.perf_counter() - start
  first_args = (logits, jax.random.key(seed), limits, eos)
  first, compiled_s = aot.compiled(_first_token, first_args, dict(
      temperature=static["temperature"], top_p=static["top_p"]))
  compile_s += compiled_s
  start = time.perf_counter() - split_s
  tok, count, done, key = first(*first_args)
  step_logits = [np.asarray(logits)] if static["keep_logits"] else []
  rows.take(np.asarray(tok))
  peak = None
  stacked = aot.tree_bytes(params["layers"]) if layer_loop == "split" else 0  # stays too
  while not all(rows.finish):
    done = jnp.asarray([bool(f) for f in rows.finish])    # stop strings found on the host
    args = (step_params, cache, tok, count, done, key, lengths, limits, eos)
    run, compiled_s = aot.compiled(_decode_tokens, args, static)
    compile_s, start = compile_s + compiled_s, start + compiled_s
    fp = aot.footprint(run)
    peak = None if fp is None else fp + stacked
    tok, cache, count, done, key, toks, chunk_logits = run(*args)
    toks = np.asarray(toks)
    live = (toks >= 0).any(axis=1)
    for step in np.nonzero(live)[0]:
      rows.take(toks[step])
    if static["keep_logits"]:
      step_logits.extend(np.asarray(chunk_logits)[live])
  return {"seconds": time.perf_counter() - start, "compile_seconds": compile_s,
          "peak_bytes": peak, "logits": step_logits}


def generate(params: Params, cfg: ModelConfig, prompts: Sequence[Sequence[int]], *,
             attention: str = "elastic", rcfg: RouterConfig | None = None,
             router_params: Params | None = None, gates=None,
             sampling: SamplingConfig = SamplingConfig(), eos_ids: Sequence[int] = (),
             tokenizer=None, attn_impl: str = "auto", unroll_decode: bool = False,
             return_logits: bool = False,
             max_new_tokens: Sequence[int] | None = None, tokens_per_sync: int = 32,
             decode_impl: str | None = None, layer_loop: str = "auto",
             prefill_chunk: int | None = 8192, pack: bool | None = None) -> Generation:
  """Generate up to `sampling.max_new_tokens` tokens after each prompt (lists of token ids).

  attention: "full" (every head full, cache dense), "elastic" (routers decide; needs
  `router_params`), "forced" (`gates` [L, K] or [L, B, K], 1 = full), "sparse" (every head
  streaming). A row stops at an EOS id or, with a tokenizer, once its text holds a stop string.
  unroll_decode: unroll the decode step's loop over layers (`model.decode_step`).
  return_logits: also return the logits of every step (`Generation.logits`; one host copy of
  [B, V] per step).
  max_new_tokens: a limit per request (one int per prompt) in place of the sampling's; a row
  that reaches its own stops with finish "length" while the others go on.
  tokens_per_sync: decode steps per device loop (`_decode_tokens`): EOS and limits are
  checked on the device at every step, stop strings on the host after each loop.
  decode_impl: the decode attention (`attention.decode.attention`); default: the kernel that
  goes with attn_impl (`decode_impl_for`).
  layer_loop: how a decode step walks the layers: "scan" over the stacked weights, "split"
  over a per-layer copy of them made for this call (`model.split_layers`: about 2x faster
  decoding at small batches on a GPU, for the layer weights' memory once more), "auto":
  split where the device reports room for the copy (`choose_layer_loop`).
  prefill_chunk: a prefill whose row (padded to a multiple of 128; packed prompts count
  together) is longer than this goes layer by layer, each layer's keys and values going
  straight into its compact cache, the MLP this many tokens of a row at a time
  (`prefill.by_layer`: the prefill's peak memory then falls with the MSR; the cache is one
  per layer, which decoding walks with a Python loop over the layers, slicing the stacked
  weights under layer_loop "scan"); shorter ones, or all with None, in one call
  (`prefill.whole`). Same tokens either way.
  pack: prefill a batch's prompts packed one after the other in one row (no padding; the
  kernels keep them apart by segment and skip the tiles between segments), not right-padded
  to the longest; never under XAttention patterns, whose kept fraction is taken per row.
  None: pack where the prefill runs a fused kernel (`prefill.packs`), not on the plain-jnp
  reference, which would score every pair of tokens of the packed row. Same tokens either
  way.
  """
  check_attention(attention, FORWARD)
  if sampling.stop and tokenizer is None:
    raise ElasticJaxError("stop strings need a tokenizer to decode the generated text")
  if attention == "elastic" and router_params is None:
    raise ElasticJaxError("attention='elastic' needs trained routers (router_params)")
  if tokens_per_sync < 1:
    raise ElasticJaxError(f"tokens_per_sync must be >= 1, got {tokens_per_sync}")
  if prefill_chunk is not None and (not isinstance(prefill_chunk, int) or prefill_chunk < 1):
    raise ElasticJaxError(f"prefill_chunk must be None or an integer >= 1, got "
                          f"{prefill_chunk!r}")
  if pack is not None and not isinstance(pack, (bool, np.bool_)):
    raise ElasticJaxError(f"pack must be None, True or False, got {pack!r}")
  if layer_loop not in ("auto", "scan", "split"):
    raise ElasticJaxError(f"layer_loop must be auto, scan or split, got {layer_loop!r}")
  rcfg = rcfg or RouterConfig()
  b, n_layers, kh = len(prompts), cfg.num_layers, cfg.num_kv_heads
  limits = _limits(max_new_tokens, sampling.max_new_tokens, b)
  lengths = _check_prompts(prompts, cfg, limits)
  capacity_needed = int((lengths + limits).max())

  forced = None
  if attention == "forced":
    try:
      g = np.asarray(gates, np.float32)
    except (TypeError, ValueError):
      raise ElasticJaxError(f"gates must be an array of numbers [L, K] or [L, B, K] = "
                            f"{[n_layers, b, kh]}, got {type(gates).__name__}") from None
    g = np.broadcast_to(g[:, None], (n_layers, b, kh)) if g.shape == (n_layers, kh) else g
    if g.shape != (n_layers, b, kh):
      raise ElasticJaxError(f"gates must be [L, K] or [L, B, K] = {[n_layers, b, kh]}, got "
                            f"{list(np.shape(gates))}")
    forced = jnp.asarray(g)

  capacity = capacity_bucket(capacity_needed)
  # XAttention's kept fraction is taken per row: its requests keep a row each.
  pack = prefill.packs(attn_impl) if pack is None else pack
  arranged = prefill.arrange(prompts, pack and b > 1 and not rcfg.uses_xattention)
  jax.block_until_ready(arranged)
  how = dict(attention=attention, rcfg=rcfg, attn_impl=attn_impl, capacity=capacity)
  if prefill_chunk is not None and arranged.ids.shape[1] > prefill_chunk:
    pre = prefill.by_layer(params, cfg, arranged, router_params, forced, chunk=prefill_chunk,
                           **how)
  else:
    pre = prefill.whole(params, cfg, arranged, router_params, forced, **how)
  cache, gates_np, xa_kept = pre.cache, pre.gates, pre.xa_kept
  way = "whole" if isinstance(cache, kv_cache.HeadCache) else "by_layer"
  dt = jax.tree.leaves(params)[0].dtype
  dense = kv_cache.dense_cache_bytes(n_layers, b, kh, capacity, cfg.head_dim, dt)
  cache_bytes = aot.tree_bytes(cache)
  if layer_loop == "auto":
    layer_loop = choose_layer_loop(params, cache_bytes)
  rows = _Rows(limits, _eos_set(eos_ids), sampling.stop, tokenizer)
  static = dict(cfg=cfg, rcfg=rcfg, steps=tokens_per_sync, temperature=sampling.temperature,
                top_p=sampling.top_p, unroll=unroll_decode,
                impl=decode_impl or decode_impl_for(attn_impl), keep_logits=return_logits)
  decoded = _decode(params, cache, pre.logits, lengths, rows, layer_loop, sampling.seed, static)
  del cache                                   # donated to the decode loop
  out, finish, eos = rows.tokens, [f or "length" for f in rows.finish], rows.eos

  texts = None if tokenizer is None else _texts(out, finish, tokenizer, eos, sampling.stop)
  g = jnp.asarray(gates_np)
  return Generation(
      tokens=out, texts=texts, finish=finish, gates=gates_np,
      msr=np.asarray(msr(g[:, :, None]))[:, 0],
      esr=np.asarray(esr(g[-1][:, None], jnp.asarray(lengths)[:, None], rcfg.streaming,
                         patterns=rcfg.patterns if attention != "full" else "fa-ssa",
                         xa_kept_bsk=None if xa_kept is None else xa_kept[-1][:, None]))[:, 0],
      cache_bytes=cache_bytes, dense_cache_bytes=dense, prefill_seconds=pre.seconds,
      decode_seconds=decoded["seconds"],
      info={"new_tokens": sum(len(o) for o in out), "capacity": capacity,
            "layer_loop": layer_loop, "prefill": way, "packed": arranged.packed,
            "prefill_compile_seconds": pre.compile_seconds,
            "decode_compile_seconds": decoded["compile_seconds"],
            "prefill_peak_bytes": pre.peak_bytes,
            "decode_peak_bytes": decoded["peak_bytes"]},
      logits=np.stack(decoded["logits"]) if return_logits else None)
