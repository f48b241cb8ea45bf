"""Prefill for generation: the prompts through the model once, every head's mode decided, the
per-head decode cache (kv_cache.py) filled, the first token's logits out.

Two ways, the same result (tests/test_generate.py checks it):

  whole     one call over the stacked layers returns every layer's keys and values
            [L, R, T, K, H] (R rows: one per request, or one packed row), from which
            `kv_cache.build` makes the cache: at its peak the device holds the weights, the
            dense keys and values of every layer and the cache.
  by layer  (`chunk` tokens) the hidden states [R, T, E] of the whole prompt go through one
            layer per call; the layer's keys and values go straight into that layer's own
            compact cache (`kv_cache.build` on one layer), built while the next layer runs,
            and are dropped then; the MLP, whose hidden layer is the widest activation, runs
            `chunk` tokens of each row at a time. At its peak the device holds the weights,
            the hidden states, two layers' dense keys and values and one layer's
            temporaries, and the compact cache so far, which shrinks with the MSR. The cache
            comes out as one `HeadCache` per layer.

Why layers and not token chunks through the whole model, as servers usually chunk a prompt:
a layer's router reads that layer's keys of the prompt's first and last tokens (boundary
pooling, docs/method.md §4), and those keys depend on every earlier layer having attended over
the whole prompt. Walking the layers one at a time over the whole prompt gives each router
exactly the keys the one-shot pass gives it, before that layer's attention runs; chunks of
tokens through all layers would have to decide before the prompt's last tokens reached the
layer.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from elastic_jax.generation import aot, kv_cache
from elastic_jax.config import ModelConfig
from elastic_jax.model import (Context, DecoderLayer, Params, RMSNorm, forward_routed,
                               output_head, rope_tables)
from elastic_jax.router import RouterConfig


@dataclasses.dataclass
class Prefilled:
  logits: jax.Array                      # [B, V] float32: each row's next-token logits
  gates: np.ndarray                      # [L, B, K] decided modes, 1 = full attention
  xa_kept: jax.Array | None              # [L, B, K] XAttention's kept fraction, or None
  cache: kv_cache.HeadCache | list       # pooled (whole) or one HeadCache per layer
  seconds: float                         # to the logits and the cache, compilation excluded
  compile_seconds: float
  peak_bytes: int | None                 # device bytes at the phase's peak (XLA's buffer
                                         # assignment; None where not reported)


def _cache_gates(gates_lbk: np.ndarray, rcfg: RouterConfig) -> np.ndarray:
  """The modes the cache keeps: the decided ones (all 1 under full attention), but full for
  XAttention heads, which select blocks at prefill only and decode as full heads."""
  return np.ones_like(gates_lbk) if rcfg.patterns == "fa-xa" else gates_lbk


@flax.struct.dataclass
class Rows:
  """The prompts as the model reads them (device arrays): right-padded, one request a row, or
  packed, every request one after the other in a single row (no padding between them; the
  kernels keep the requests apart by segment). Request b holds lengths[b] tokens from index
  offset[b] of row row[b], as segment seg_of[b]."""
  ids: jax.Array                  # [R, T]
  seg: jax.Array                  # [R, T] segment of each token, 0 = padding
  pos: jax.Array                  # [R, T] position within its request
  lengths: jax.Array              # [B]
  row: jax.Array                  # [B]
  offset: jax.Array               # [B]
  seg_of: jax.Array               # [B]
  packed: bool = flax.struct.field(pytree_node=False, default=False)

  @property
  def num_segments(self) -> int:
    return self.lengths.shape[0] + 1 if self.packed else 2


def packs(attn_impl: str) -> bool:
  """Whether packing a batch's prompts in one row saves work under `attn_impl`: the fused
  kernels skip the tiles between segments; the plain-jnp reference scores every pair of the
  row, which grows with the square of the batch."""
  from elastic_jax.attention import parse_impl
  name, _ = parse_impl(attn_impl)
  if name == "auto":
    return jax.default_backend() in ("gpu", "tpu")
  return name not in ("reference", "dense")


def round_up(n: int, multiple: int) -> int:
  """n rounded up to a multiple of `multiple`."""
  return -(-n // multiple) * multiple


def arrange(prompts, pack: bool, multiple: int = 128) -> Rows:
  """Rows for token-id lists: packed into one row (pack), else right-padded to a common
  length; the row length a multiple of `multiple` (few distinct shapes, few compilations)."""
  lengths = np.asarray([len(p) for p in prompts], np.int32)
  b = len(prompts)
  if pack:
    offset = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int32)
    row, seg_of = np.zeros(b, np.int32), np.arange(1, b + 1, dtype=np.int32)
  else:
    offset, row, seg_of = np.zeros(b, np.int32), np.arange(b, dtype=np.int32), np.ones(b, np.int32)
  width = round_up(int((offset + lengths).max()), multiple)
  ids, seg, pos = (np.zeros((1 if pack else b, width), np.int32) for _ in range(3))
  for i, p in enumerate(prompts):
    at = (row[i], slice(offset[i], offset[i] + lengths[i]))
    ids[at], seg[at], pos[at] = p, seg_of[i], np.arange(lengths[i])
  return Rows(*(jnp.asarray(x) for x in (ids, seg, pos, lengths, row, offset, seg_of)),
              packed=pack)


def _segment_gates(forced_lbk, rows: Rows):
  """Forced gates per request [L, B, K] as the routed forward takes them: [L, R, S, K]."""
  if forced_lbk is None:
    return None
  n_layers, _, k = forced_lbk.shape
  out = jnp.zeros((n_layers, rows.ids.shape[0], rows.num_segments, k), forced_lbk.dtype)
  return out.at[:, rows.row, rows.seg_of].set(forced_lbk)


def _decided(stats, rows: Rows, shape, attention: str):
  """Each request's decided gates ([..., R, S, K] -> [..., B, K]); where nothing routes,
  every head full (full attention) or streaming (sparse)."""
  if "gate" not in stats:
    return jnp.full(shape, 1.0 if attention == "full" else 0.0, jnp.float32)
  return stats["gate"][..., rows.row, rows.seg_of, :]


def _last(x_rte, rows: Rows):
  """Each request's last prompt token [B, E]."""
  return x_rte[rows.row, rows.offset + rows.lengths - 1]


@functools.partial(jax.jit, static_argnames=("cfg", "rcfg", "attention", "attn_impl"))
def _whole(params, rows, router_params, forced_lbk, *, cfg, rcfg, attention, attn_impl):
  hidden, stats = forward_routed(
      params, rows.ids, rows.pos, rows.seg, rows.seg > 0, cfg=cfg, rcfg=rcfg,
      attention=attention, router_params=router_params,
      forced_gates=_segment_gates(forced_lbk, rows), attn_impl=attn_impl,
      packed=rows.packed, num_segments=rows.num_segments, return_hidden=True,
      return_kv=True)
  logits = jnp.einsum("be,ev->bv", _last(hidden, rows), output_head(params, cfg),
                      preferred_element_type=jnp.float32)
  gates = _decided(stats, rows, (cfg.num_layers,) + rows.lengths.shape + (cfg.num_kv_heads,),
                   attention)
  return logits, gates, stats.get("xa_kept"), stats["k"], stats["v"]


@functools.partial(jax.jit, static_argnames=("cfg",))
def _embed(params, rows, *, cfg):
  cos, sin = rope_tables(cfg, rows.pos, params["embed"].dtype, rows.seg > 0)
  return jnp.take(params["embed"], rows.ids, axis=0), cos, sin


@functools.partial(jax.jit, static_argnames=("cfg", "rcfg", "attention", "attn_impl", "chunk"),
                   donate_argnames=("x_rte",))
def _layer(layers, index, x_rte, cos, sin, rows, router_params, forced_lbk, *, cfg, rcfg,
           attention, attn_impl, chunk):
  """Layer `index` (traced: one compilation serves every layer) over the whole prompt:
  (hidden states, decided gates [B, K], XAttention's kept fraction or None, keys and values
  [1, R, T, K, H])."""
  take = lambda tree: jax.tree.map(lambda a: a[index], tree)
  per_layer = {}
  if attention == "elastic":
    per_layer["router"] = take(router_params)
  elif attention == "forced":
    per_layer["gate"] = _segment_gates(forced_lbk, rows)[index]
  ctx = Context(cos, sin, rows.seg, rows.pos, rows.seg > 0, jnp.float32(1.0), return_kv=True,
                num_segments=rows.num_segments)
  layer = DecoderLayer(cfg, x_rte.dtype, attn_impl, attention, rcfg, packed=rows.packed,
                       mlp_chunk=chunk)
  x_rte, stats = layer.apply({"params": take(layers)}, x_rte, ctx, per_layer)
  gates = _decided(stats, rows, rows.lengths.shape + (cfg.num_kv_heads,), attention)
  return x_rte, gates, stats.get("xa_kept"), stats["k"][None], stats["v"][None]


@functools.partial(jax.jit, static_argnames=("cfg",))
def _head(params, x_rte, rows, *, cfg):
  last = RMSNorm("embed", cfg.rms_norm_eps, x_rte.dtype).apply(
      {"params": params["final_norm"]}, _last(x_rte, rows))
  return jnp.einsum("be,ev->bv", last, output_head(params, cfg),
                    preferred_element_type=jnp.float32)


def _build(k, v, gates, rows: Rows, rcfg, capacity, before_compile=None):
  return kv_cache.build(k, v, _cache_gates(gates, rcfg), rows.lengths, capacity,
                        rcfg.streaming, rows.row, rows.offset, before_compile)


def whole(params: Params, cfg: ModelConfig, rows: Rows, router_params, forced_lbk, *,
          attention: str, rcfg: RouterConfig, attn_impl: str, capacity: int) -> Prefilled:
  """The one-call prefill of `rows` (router params for elastic attention, forced gates
  [L, B, K] for forced)."""
  args = (params, rows, router_params, forced_lbk)
  run, compile_s = aot.compiled(_whole, args, dict(
      cfg=cfg, rcfg=rcfg, attention=attention, attn_impl=attn_impl))
  start = time.perf_counter()
  logits, gates, xa_kept, k, v = run(*args)
  gates_np = np.asarray(jax.device_get(gates))
  cache, build_bytes, build_compile = _build(k, v, gates_np, rows, rcfg, capacity,
                                             lambda: jax.block_until_ready(logits))
  del k, v
  jax.block_until_ready((logits, cache))
  seconds = time.perf_counter() - start - build_compile
  prefill_bytes = aot.footprint(run)
  peak = (None if prefill_bytes is None or build_bytes is None
          else max(prefill_bytes, build_bytes + aot.tree_bytes(params)))
  return Prefilled(logits, gates_np, xa_kept, cache, seconds, compile_s + build_compile, peak)


def by_layer(params: Params, cfg: ModelConfig, rows: Rows, router_params, forced_lbk, *,
             attention: str, rcfg: RouterConfig, attn_impl: str, capacity: int,
             chunk: int) -> Prefilled:
  """The layer-by-layer prefill (module docstring), the MLP `chunk` tokens at a time; args as
  for `whole`. A layer's modes come to the host (one small transfer) for its cache's slot
  tables while the next layer already runs, so the device does not wait for the host; the
  layer's keys and values live until then (two layers' at most). A compilation due on the
  way (the first call of a shape) first lets the device finish its queue, so that the time
  reported leaves it out exactly."""
  steps = layer_steps(params, cfg, rows, router_params, forced_lbk, attention=attention,
                      rcfg=rcfg, attn_impl=attn_impl, capacity=capacity, chunk=chunk)
  while True:
    try:
      next(steps)
    except StopIteration as done:
      return done.value


def layer_steps(params: Params, cfg: ModelConfig, rows: Rows, router_params, forced_lbk, *,
                attention: str, rcfg: RouterConfig, attn_impl: str, capacity: int,
                chunk: int):
  """`by_layer` as a generator that pauses after each layer's call (cfg.num_layers - 1
  pauses; the last `next` returns the `Prefilled` through StopIteration), so that a caller
  may run other work on the device between two layers: the engine decodes its other requests
  there. Timed between the pauses too, so `seconds` counts what ran in them."""
  static = dict(cfg=cfg, rcfg=rcfg, attention=attention, attn_impl=attn_impl, chunk=chunk)
  embed, compile_s = aot.compiled(_embed, (params, rows), dict(cfg=cfg))
  start, timed_compile = time.perf_counter(), 0.0    # compilations inside the timed span
  x, cos, sin = embed(params, rows)
  caches, pending = [], None
  drain = lambda: jax.block_until_ready((x, caches, pending))
  others = aot.tree_bytes(params) - aot.tree_bytes(params["layers"])
  side = aot.tree_bytes((cos, sin, rows))
  gates, kept, peak = [], [], 0
  for index in range(cfg.num_layers + 1):
    ran = None
    if index < cfg.num_layers:
      layer_args = (params["layers"], jnp.int32(index), x, cos, sin, rows, router_params,
                    forced_lbk)
      run, seconds = aot.compiled(_layer, layer_args, static, drain)
      timed_compile += seconds
      fp = aot.footprint(run)
      # The layer call: its arguments and temporaries, the other weights, the caches so far
      # and the last layer's keys and values, not yet in its cache.
      peak = None if fp is None or peak is None else max(
          peak, fp + others + aot.tree_bytes((caches, pending)))
      x, *ran = run(*layer_args)
    if pending is not None:
      g, xa, k, v = pending
      g = np.asarray(jax.device_get(g))[None]
      cache, build_bytes, seconds = _build(k, v, g, rows, rcfg, capacity, drain)
      timed_compile += seconds
      # The build: keys and values in, the layer's cache out, beside the weights, the hidden
      # states, the caches so far and the next layer's outputs.
      peak = None if build_bytes is None or peak is None else max(
          peak, build_bytes + aot.tree_bytes((params, x, caches, ran)) + side)
      caches.append(cache)
      gates.append(g[0])
      kept.append(xa)
    pending = ran
    if index < cfg.num_layers - 1:
      yield
  head, seconds = aot.compiled(_head, (params, x, rows), dict(cfg=cfg), drain)
  timed_compile += seconds
  logits = head(params, x, rows)
  jax.block_until_ready((logits, caches))
  elapsed = time.perf_counter() - start - timed_compile
  xa_kept = None if kept[0] is None else jnp.stack(kept)
  return Prefilled(logits, np.stack(gates), xa_kept, caches, elapsed,
                   compile_s + timed_compile, peak)
