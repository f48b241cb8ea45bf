"""Prefill for generation: the prompts through the model once, every head's mode decided, the
per-head decode cache (kv_cache.py) filled, the first token's logits out.

Two ways, the same result (tests/test_generate.py checks it):

  whole     one call over the stacked layers returns every layer's keys and values
            [L, B, T, K, H], from which `kv_cache.build` makes the cache: at its peak the
            device holds the weights, the dense keys and values of every layer and the cache.
  by layer  (`chunk` tokens) the hidden states [B, T, E] of the whole prompt go through one
            layer per call; the layer's keys and values go straight into that layer's own
            compact cache (`kv_cache.build` on one layer) and are dropped before the next
            layer runs; the MLP, whose hidden layer is the widest activation, runs `chunk`
            tokens at a time. At its peak the device holds the weights, the hidden states,
            one layer's dense keys and values with its temporaries, and the compact cache so
            far, which shrinks with the MSR. The cache comes out as one `HeadCache` per layer.

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

import jax
import jax.numpy as jnp
import numpy as np

from elastic_jax import aot, kv_cache
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


def _cache_gates(gates_lbk: np.ndarray, attention: str, rcfg: RouterConfig) -> np.ndarray:
  """The modes the cache keeps: every head full for full attention, and for XAttention
  heads, which select blocks at prefill only and decode as full heads."""
  if attention == "full" or rcfg.patterns == "fa-xa":
    return np.ones_like(gates_lbk)
  return gates_lbk


def _decided(stats, n_layers_and_b_k):
  return (stats["gate"][..., 1, :] if "gate" in stats
          else jnp.zeros(n_layers_and_b_k, jnp.float32))


@functools.partial(jax.jit, static_argnames=("cfg", "rcfg", "attention", "attn_impl"))
def _whole(params, ids_bt, seg_bt, lengths_b, router_params, forced, *, cfg, rcfg, attention,
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
  gates = _decided(stats, (cfg.num_layers,) + ids_bt.shape[:1] + (cfg.num_kv_heads,))
  return logits, gates, stats.get("xa_kept"), stats["k"], stats["v"]


@functools.partial(jax.jit, static_argnames=("cfg",))
def _embed(params, ids_bt, seg_bt, *, cfg):
  dtype = params["embed"].dtype
  positions = jnp.broadcast_to(jnp.arange(ids_bt.shape[1], dtype=jnp.int32), ids_bt.shape)
  cos, sin = rope_tables(cfg, positions, dtype, seg_bt > 0)
  return jnp.take(params["embed"], ids_bt, axis=0), cos, sin


@functools.partial(jax.jit, static_argnames=("cfg", "rcfg", "attention", "attn_impl", "chunk"),
                   donate_argnames=("x_bte",))
def _layer(layers, index, x_bte, cos, sin, seg_bt, router_params, forced, *, cfg, rcfg,
           attention, attn_impl, chunk):
  """Layer `index` (traced: one compilation serves every layer) over the whole prompt:
  (hidden states, decided gates [B, K], XAttention's kept fraction or None, keys and values
  [1, B, T, K, H])."""
  take = lambda tree: jax.tree.map(lambda a: a[index], tree)
  per_layer = {}
  if attention == "elastic":
    per_layer["router"] = take(router_params)
  elif attention == "forced":
    per_layer["gate"] = forced[index]
  positions = jnp.broadcast_to(jnp.arange(seg_bt.shape[1], dtype=jnp.int32), seg_bt.shape)
  ctx = Context(cos, sin, seg_bt, positions, seg_bt > 0, jnp.float32(1.0), return_kv=True)
  layer = DecoderLayer(cfg, x_bte.dtype, attn_impl, attention, rcfg, packed=False,
                       mlp_chunk=chunk)
  x_bte, stats = layer.apply({"params": take(layers)}, x_bte, ctx, per_layer)
  gates = _decided(stats, (x_bte.shape[0], cfg.num_kv_heads))
  return x_bte, gates, stats.get("xa_kept"), stats["k"][None], stats["v"][None]


@functools.partial(jax.jit, static_argnames=("cfg",))
def _head(params, x_bte, lengths_b, *, cfg):
  last = jnp.take_along_axis(x_bte, (lengths_b - 1)[:, None, None], axis=1)
  last = RMSNorm("embed", cfg.rms_norm_eps, last.dtype).apply(
      {"params": params["final_norm"]}, last)[:, 0]
  return jnp.einsum("be,ev->bv", last, output_head(params, cfg),
                    preferred_element_type=jnp.float32)


def whole(params: Params, cfg: ModelConfig, args: tuple, *, attention: str, rcfg: RouterConfig,
          attn_impl: str, capacity: int) -> Prefilled:
  """The one-call prefill; args = (ids [B, T], segments [B, T], lengths [B], router params,
  forced gates [L, B, 2, K] or None) as device arrays."""
  run, compile_s = aot.compiled(_whole, (params, *args), dict(
      cfg=cfg, rcfg=rcfg, attention=attention, attn_impl=attn_impl))
  start = time.perf_counter()
  logits, gates, xa_kept, k, v = run(params, *args)
  gates_np = np.asarray(jax.device_get(gates))
  if attention == "full":       # no routing: every head keeps every position
    gates_np = np.ones_like(gates_np)
  cache, build_bytes, build_compile = kv_cache.build(
      k, v, _cache_gates(gates_np, attention, rcfg), args[2], capacity, rcfg.streaming)
  del k, v
  jax.block_until_ready((logits, cache))
  seconds = time.perf_counter() - start - build_compile
  prefill_bytes = aot.footprint(run)
  peak = (None if prefill_bytes is None or build_bytes is None
          else max(prefill_bytes, build_bytes + aot.tree_bytes(params)))
  return Prefilled(logits, gates_np, xa_kept, cache, seconds, compile_s + build_compile, peak)


def by_layer(params: Params, cfg: ModelConfig, args: tuple, *, attention: str,
             rcfg: RouterConfig, attn_impl: str, capacity: int, chunk: int) -> Prefilled:
  """The layer-by-layer prefill (module docstring), the MLP `chunk` tokens at a time; args as
  for `whole`. A layer's modes come to the host (one small transfer) for its cache's slot
  tables while the next layer already runs, so the device does not wait for the host; the
  layer's keys and values live until then (two layers' at most)."""
  ids, seg, lengths, router_params, forced = args
  static = dict(cfg=cfg, rcfg=rcfg, attention=attention, attn_impl=attn_impl, chunk=chunk)
  embed, compile_s = aot.compiled(_embed, (params, ids, seg), dict(cfg=cfg))
  start, timed_compile = time.perf_counter(), 0.0    # compilations inside the timed span
  x, cos, sin = embed(params, ids, seg)
  others = aot.tree_bytes(params) - aot.tree_bytes(params["layers"])
  side = aot.tree_bytes((cos, sin, seg, lengths))
  caches, gates, kept, peak, pending = [], [], [], 0, None
  for index in range(cfg.num_layers + 1):
    ran = None
    if index < cfg.num_layers:
      layer_args = (params["layers"], jnp.int32(index), x, cos, sin, seg, router_params,
                    forced)
      run, seconds = aot.compiled(_layer, layer_args, static)
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
      if attention == "full":
        g = np.ones_like(g)
      cache, build_bytes, seconds = kv_cache.build(
          k, v, _cache_gates(g, attention, rcfg), lengths, capacity, rcfg.streaming)
      timed_compile += seconds
      # The build: keys and values in, the layer's cache out, beside the weights, the hidden
      # states, the caches so far and the next layer's outputs.
      peak = None if build_bytes is None or peak is None else max(
          peak, build_bytes + aot.tree_bytes((params, x, caches, ran)) + side)
      del k, v
      caches.append(cache)
      gates.append(g[0])
      kept.append(xa)
    pending = ran
  head, seconds = aot.compiled(_head, (params, x, lengths), dict(cfg=cfg))
  timed_compile += seconds
  logits = head(params, x, lengths)
  jax.block_until_ready((logits, caches))
  elapsed = time.perf_counter() - start - timed_compile
  xa_kept = None if kept[0] is None else jnp.stack(kept)
  return Prefilled(logits, np.stack(gates), xa_kept, caches, elapsed,
                   compile_s + timed_compile, peak)
