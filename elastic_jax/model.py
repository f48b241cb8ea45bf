"""The functional Flax backbone for the Qwen3 and Llama 3.x families.

`Transformer(cfg)` is a stateless Flax (linen) module: its parameters are a plain nested dict
that lives apart from it, so `forward(params, ...)` is a pure function. The layers are stacked
with `nn.scan` (one compiled layer, parameters with a leading [L] axis), and every parameter and
activation carries logical axis names (`sharding.py` maps them onto a device mesh).

Shape letters: B batch, T tokens, V vocab, E hidden, F MLP hidden, L layers, N query heads,
K key/value heads, H head dim.

Numerics follow HF `transformers`: RMSNorm in float32 with the result cast back before the
weight multiplies it; RoPE tables in float32 cast to the activation dtype; rotate-half RoPE;
scores and softmax in float32.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from elastic_jax.generation import kv_cache
from elastic_jax.attention import sequence_parallel
from elastic_jax import router as rt
from elastic_jax.attention import get_attention, get_hybrid_attention, xattention
from elastic_jax.config import (ModelConfig, dynamic_inv_freq, rope_attention_factor,
                                rope_inv_freq)
from elastic_jax.errors import ElasticJaxError
from elastic_jax.heads import FORWARD, check_attention

Params = dict[str, Any]


@flax.struct.dataclass
class Context:
  """Per-call inputs every layer sees."""
  cos: jax.Array                  # [B, T, H] RoPE tables
  sin: jax.Array
  segment_ids: jax.Array          # [B, T] int, packed segment of each token
  positions: jax.Array            # [B, T] int, position within the segment
  prompt_mask: jax.Array | None = None  # [B, T] bool, token is part of its segment's prompt
  tau: jax.Array | None = None    # Gumbel-softmax temperature (training)
  return_kv: bool = flax.struct.field(pytree_node=False, default=False)  # prefill for decoding
  num_segments: int = flax.struct.field(pytree_node=False, default=2)    # S: segment slots

_normal = nn.initializers.normal(0.02)


def _lead(w: jax.Array, ndim: int) -> jax.Array:
  """`w` with leading unit axes up to rank `ndim`, for explicit broadcasting."""
  return w.reshape((1,) * (ndim - w.ndim) + w.shape)


def _param(module: nn.Module, name: str, shape, axes, init=_normal, dtype=jnp.float32):
  """Declares one parameter with its logical axis names (the only place tensors are declared)."""
  return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


class RMSNorm(nn.Module):
  axis_name: str
  eps: float
  dtype: Any

  @nn.compact
  def __call__(self, x):
    scale = _param(self, "scale", (x.shape[-1],), (self.axis_name,), nn.initializers.ones,
                   self.dtype)
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return _lead(scale, x.ndim) * x32.astype(x.dtype)


def rope_tables(cfg: ModelConfig, positions_bt: jax.Array, dtype, valid_bt=None
                ) -> tuple[jax.Array, jax.Array]:
  """cos, sin [B, T, H] for rotate-half RoPE (the HF layout: frequencies repeated twice),
  scaled by the RoPE type's attention factor (YaRN) as transformers does.

  Dynamic NTK RoPE depends on the length: as transformers, the table is that of
  max(position) + 1 over the whole batch's real tokens (`valid_bt`, default all), once past
  max_position_embeddings. In a decode step that is the new token's position + 1, so the new
  token's query and key use the grown table while the cached keys keep the one they were
  computed with (transformers' behaviour for a model fed positions in increasing order).
  """
  s = cfg.rope_scaling
  if s is not None and s.rope_type == "dynamic":
    pos = positions_bt if valid_bt is None else jnp.where(valid_bt, positions_bt, 0)
    seq_len = jnp.max(pos) + 1
    # Up to the limit, the table computed once on the host (transformers' original table).
    inv_freq = jnp.where(seq_len > cfg.max_position_embeddings,
                         dynamic_inv_freq(cfg, seq_len), jnp.asarray(rope_inv_freq(cfg)))
  else:
    inv_freq = jnp.asarray(rope_inv_freq(cfg), jnp.float32)
  freqs = positions_bt.astype(jnp.float32)[..., None] * inv_freq[None, None]
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  cos, sin = jnp.cos(emb), jnp.sin(emb)
  factor = rope_attention_factor(cfg)
  if factor != 1.0:
    cos, sin = cos * jnp.float32(factor), sin * jnp.float32(factor)
  return cos.astype(dtype), sin.astype(dtype)


def apply_rope(x_btnh, cos_bth, sin_bth):
  half = x_btnh.shape[-1] // 2
  rotated = jnp.concatenate([-x_btnh[..., half:], x_btnh[..., :half]], axis=-1)
  return x_btnh * cos_bth[:, :, None] + rotated * sin_bth[:, :, None]


class Attention(nn.Module):
  cfg: ModelConfig
  dtype: Any
  attn_impl: str

  attention: str = "full"         # how heads attend (heads.FORWARD)
  rcfg: rt.RouterConfig | None = None
  packed: bool = True

  @nn.compact
  def __call__(self, x_bte, ctx: Context, layer: dict):
    cfg, dt = self.cfg, self.dtype
    e, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    cos, sin, segment_ids_bt = ctx.cos, ctx.sin, ctx.segment_ids

    def proj(name, heads, head_axis):
      w = _param(self, f"{name}_kernel", (e, heads, h), ("embed", head_axis, "head_dim"),
                 dtype=dt)
      y = jnp.einsum("bte,enh->btnh", x_bte, w)
      if cfg.attention_bias:
        y = y + _lead(_param(self, f"{name}_bias", (heads, h), (head_axis, "head_dim"),
                             nn.initializers.zeros, dt), y.ndim)
      return y

    q = proj("q", n, "q_heads")
    kk = proj("k", k, "kv_heads")
    v = proj("v", k, "kv_heads")
    if cfg.qk_norm:
      q = RMSNorm("head_dim", cfg.rms_norm_eps, dt, name="q_norm")(q)
      kk = RMSNorm("head_dim", cfg.rms_norm_eps, dt, name="k_norm")(kk)
    stats = {}
    if "cache" in layer:
      # One decode step (kv_cache.py): the modes were decided at prefill and live in the cache.
      q, kk = apply_rope(q, cos, sin), apply_rope(kk, cos, sin)
      # Kept apart from the cache writes: XLA would otherwise fuse the key/value projections
      # into the scatters, one thread per output element (75 us a layer on an H200).
      q, kk, v = jax.lax.optimization_barrier((q, kk, v))
      # A cache of another layout (generation/paged.py) brings its own decode attention,
      # with kv_cache.attend's arguments.
      attend = (kv_cache.attend if isinstance(layer["cache"], kv_cache.HeadCache)
                else layer["cache"].decode_attend)
      out, cache = attend(q[:, 0], kk[:, 0], v[:, 0], ctx.positions[:, 0], layer["cache"],
                          layer["index"], self.rcfg.streaming, h ** -0.5,
                          layer.get("impl", "reference"))
      return self._out_proj(out[:, None]), {"cache": cache}
    gate_bsk = None                  # full and all-sparse attention route nothing
    if self.attention == "elastic":
      # The router reads the keys after k-norm and before RoPE (docs/method.md §4). The
      # named scopes here ("router", "attention_core", "mlp") only label the operations for
      # profiles (benchmarks/xprof.py).
      with jax.named_scope("router"):
        if self.packed or self.rcfg.pooling != "boundary":
          pooled = rt.pool_prompt(kk, segment_ids_bt, ctx.positions, ctx.prompt_mask,
                                  self.rcfg, ctx.num_segments)
        else:   # one input per row, its prompt a prefix: read only the boundary tokens
          pooled = rt.pool_prompt_prefix(kk, segment_ids_bt, ctx.prompt_mask, self.rcfg,
                                         ctx.num_segments)
        z_bskc = rt.router_logits(layer["router"], pooled)
        gate_bsk, soft_bsk = rt.gate_from_logits(z_bskc, self.rcfg, key=layer.get("key"),
                                                 tau=ctx.tau)
      stats = {"gate": gate_bsk, "soft_gate": soft_bsk, "logits": z_bskc, "pooled": pooled}
    elif self.attention == "forced":
      gate_bsk = layer["gate"].astype(jnp.float32)
      stats = {"gate": gate_bsk}
    q = nn.with_logical_constraint(apply_rope(q, cos, sin), ("batch", "seq", "act_heads", None))
    kk = nn.with_logical_constraint(apply_rope(kk, cos, sin),
                                    ("batch", "seq", "act_kv_heads", None))
    if ctx.return_kv:
      stats = dict(stats, k=kk, v=v)
    with jax.named_scope("attention_core"):
      out, stats = self._core(q, kk, v, ctx, stats, gate_bsk)
    return self._out_proj(out), stats

  def _core(self, q, kk, v, ctx: Context, stats: dict, gate_bsk):
    """Attention itself over the projected, rotated heads: (its output, the stats)."""
    segment_ids_bt = ctx.segment_ids
    if self.attention == "full":
      # A mesh and rules that split "seq" make this sequence parallel
      # (attention/sequence_parallel.py).
      # One unpadded input per row (or right padding only): no segment ids, so the fused
      # causal kernel (cuDNN on a GPU) applies.
      out = sequence_parallel.for_context(get_attention(self.attn_impl), hybrid=False)(
          q, kk, v, segment_ids_bt if self.packed else None)
    else:
      gate_btk = (None if self.attention == "sparse"
                  else rt.gates_per_token(gate_bsk, segment_ids_bt))
      # One unpadded input per row: the kernels need no segment ids or positions.
      seg, pos = (segment_ids_bt, ctx.positions) if self.packed else (None, None)
      hybrid = get_hybrid_attention(self.attn_impl)
      wrapped = sequence_parallel.for_context(hybrid, hybrid=True)
      if self.rcfg.uses_xattention:
        if wrapped is not hybrid:
          raise ElasticJaxError(f"patterns '{self.rcfg.patterns}' does not run sequence "
                                "parallel yet; use fa-ssa or a mesh without a sequence axis")
        xa = self.rcfg.xattention
        keep = xattention.select(q, kk, xa, seg,
                                 "reference" if self.attn_impl == "reference" else "auto")
        # Real tokens per row (packed rows: all segments together).
        lengths = (segment_ids_bt > 0).sum(1)
        stats = dict(stats, xa_kept=xattention.kept_fraction(keep, lengths, xa.block))
        wrapped = functools.partial(hybrid, patterns=self.rcfg.patterns, xa_keep=keep,
                                    xa_block=xa.block)
      out = wrapped(q, kk, v, gate_btk, self.rcfg.streaming, seg, pos)
    return out, stats

  def _out_proj(self, out_btnh):
    cfg = self.cfg
    n, h, e = cfg.num_heads, cfg.head_dim, cfg.hidden_size
    wo = _param(self, "o_kernel", (n, h, e), ("q_heads", "head_dim", "embed"), dtype=self.dtype)
    y = jnp.einsum("btnh,nhe->bte", out_btnh, wo)
    if cfg.attention_bias:
      y = y + _lead(_param(self, "o_bias", (e,), ("embed",), nn.initializers.zeros, self.dtype),
                    y.ndim)
    return y


class MLP(nn.Module):
  cfg: ModelConfig
  dtype: Any

  @nn.compact
  def __call__(self, x_bte):
    cfg, dt = self.cfg, self.dtype
    e, f = cfg.hidden_size, cfg.intermediate_size

    def dense(name, shape, axes, x, spec):
      y = jnp.einsum(spec, x, _param(self, f"{name}_kernel", shape, axes, dtype=dt))
      if cfg.mlp_bias:
        y = y + _lead(_param(self, f"{name}_bias", (shape[-1],), (axes[-1],),
                             nn.initializers.zeros, dt), y.ndim)
      return y

    with jax.named_scope("mlp"):
      gate = dense("gate", (e, f), ("embed", "mlp"), x_bte, "bte,ef->btf")
      up = dense("up", (e, f), ("embed", "mlp"), x_bte, "bte,ef->btf")
      hidden = nn.with_logical_constraint(nn.silu(gate) * up, ("batch", "seq", "act_mlp"))
      return dense("down", (f, e), ("mlp", "embed"), hidden, "btf,fe->bte")


class DecoderLayer(nn.Module):
  cfg: ModelConfig
  dtype: Any
  attn_impl: str
  attention: str = "full"
  rcfg: rt.RouterConfig | None = None
  packed: bool = True
  mlp_chunk: int = 0              # > 0: the MLP (its [B, T, F] hidden layer the widest
                                  # activation) runs this many tokens at a time

  @nn.compact
  def __call__(self, x_bte, ctx: Context, layer: dict):
    cfg = self.cfg
    h = RMSNorm("embed", cfg.rms_norm_eps, self.dtype, name="attn_norm")(x_bte)
    y, stats = Attention(cfg, self.dtype, self.attn_impl, self.attention, self.rcfg,
                         self.packed, name="attn")(h, ctx, layer)
    x_bte = x_bte + y
    norm = RMSNorm("embed", cfg.rms_norm_eps, self.dtype, name="mlp_norm")
    chunk = self.mlp_chunk
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
      raise ElasticJaxError(f"mlp_chunk must be an integer >= 0 (0: whole rows), got {chunk!r}")
    if not chunk or chunk >= x_bte.shape[1]:
      x_bte = x_bte + MLP(cfg, self.dtype, name="mlp")(norm(x_bte))
    else:
      # Per token, so chunks give the same result. Each chunk's MLP is rematerialised on its
      # own: a backward pass (router training, under the layer's remat too) holds one chunk's
      # [B, chunk, F] activations at a time instead of the whole row's; without a backward
      # pass it changes nothing.
      chunk_mlp = nn.remat(MLP)(cfg, self.dtype, name="mlp")
      for s in range(0, x_bte.shape[1], chunk):
        part = x_bte[:, s:s + chunk]
        x_bte = x_bte.at[:, s:s + chunk].set(part + chunk_mlp(norm(part)))
    return nn.with_logical_constraint(x_bte, ("batch", "seq", "act_embed")), stats


class Transformer(nn.Module):
  """Decoder-only LM: (float32 logits [B, T, V], per-layer routing stats stacked over L)."""
  cfg: ModelConfig
  dtype: Any = jnp.bfloat16
  attn_impl: str = "reference"
  remat: bool = False
  attention: str = "full"         # how heads attend (heads.FORWARD)
  rcfg: rt.RouterConfig | None = None
  packed: bool = True             # False: each row is one unpadded input (kernels apply)
  num_segments: int = 2           # S: segment slots of the routing (segment ids below it)
  mlp_chunk: int = 0              # > 0: each layer's MLP this many tokens at a time

  @nn.compact
  def __call__(self, input_ids_bt, positions_bt, segment_ids_bt, prompt_mask_bt=None,
               per_layer=None, tau=None, return_hidden=False, return_kv=False):
    cfg, dt = self.cfg, self.dtype
    embed = _param(self, "embed", (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"),
                   dtype=dt)
    x = jnp.take(embed, input_ids_bt, axis=0)
    x = nn.with_logical_constraint(x, ("batch", "seq", "act_embed"))
    cos, sin = rope_tables(cfg, positions_bt, dt, segment_ids_bt > 0)
    ctx = Context(cos, sin, segment_ids_bt, positions_bt, prompt_mask_bt, tau, return_kv,
                  self.num_segments)
    layer_cls = nn.remat(DecoderLayer, prevent_cse=False) if self.remat else DecoderLayer
    stack = nn.scan(layer_cls, variable_axes={"params": 0}, split_rngs={"params": True},
                    in_axes=(nn.broadcast, 0), length=cfg.num_layers,
                    metadata_params={nn.PARTITION_NAME: "layers"})
    x, stats = stack(cfg, dt, self.attn_impl, self.attention, self.rcfg, self.packed,
                     self.mlp_chunk, name="layers")(
        x, ctx, per_layer or {})
    x = RMSNorm("embed", cfg.rms_norm_eps, dt, name="final_norm")(x)
    if not cfg.tie_word_embeddings:
      head = _param(self, "lm_head", (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"),
                    dtype=dt)
    if return_hidden:
      return x, stats
    if cfg.tie_word_embeddings:
      logits = jnp.einsum("bte,ve->btv", x, embed)
    else:
      logits = jnp.einsum("bte,ev->btv", x, head)
    logits = nn.with_logical_constraint(logits.astype(jnp.float32),
                                        ("batch", "seq", "act_vocab"))
    return logits, stats


def transformer(cfg: ModelConfig, dtype, attn_impl="reference", remat=False, attention="full",
                rcfg=None, packed=True, num_segments=2, mlp_chunk=0) -> Transformer:
  """The Flax module for `cfg` (apply it with {"params": params}); `forward` and
  `forward_routed` are the usual ways to run it."""
  return Transformer(cfg, jnp.dtype(dtype), attn_impl, remat, attention, rcfg, packed,
                     num_segments, mlp_chunk)


def abstract_params(cfg: ModelConfig, dtype="bfloat16") -> tuple[Params, Params]:
  """(shapes, logical axes) of the parameter tree, without allocating anything.

  Returns two trees with the same structure: `jax.ShapeDtypeStruct` leaves and tuples of
  logical axis names.
  """
  ids = jnp.zeros((1, 1), jnp.int32)
  boxed = jax.eval_shape(
      lambda: transformer(cfg, dtype).init(jax.random.key(0), ids, ids, ids))["params"]
  shapes = nn.meta.unbox(boxed)
  axes = jax.tree.map(lambda x: tuple(x.names), boxed,
                      is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
  return shapes, axes


def check_shapes(have: dict[str, tuple], want: dict[str, tuple], what: str,
                 suffix: str = "") -> None:
  """Refuses a tree whose leaves (name -> shape) differ from `want` in a name or a shape,
  naming the first: "{what} NAME is missing / is not part of this model / has shape ..."."""
  for key in sorted(set(want) | set(have)):
    if key not in have:
      raise ElasticJaxError(f"{what} {key} is missing{suffix}")
    if key not in want:
      raise ElasticJaxError(f"{what} {key} is not part of this model{suffix}")
    if tuple(have[key]) != tuple(want[key]):
      raise ElasticJaxError(f"{what} {key} has shape {list(have[key])}, expected "
                            f"{list(want[key])}{suffix}")


def init_params(cfg: ModelConfig, key: jax.Array, dtype="bfloat16") -> Params:
  """Random parameters (N(0, 0.02) weights, unit norms, zero biases), e.g. for tests."""
  ids = jnp.zeros((1, 1), jnp.int32)
  params = jax.jit(lambda k: transformer(cfg, dtype).init(k, ids, ids, ids))(key)["params"]
  return nn.meta.unbox(params)


@functools.partial(jax.jit, static_argnames=("cfg", "attn_impl", "remat", "rules"))
def forward(params: Params, input_ids_bt: jax.Array, positions_bt: jax.Array,
            segment_ids_bt: jax.Array, *, cfg: ModelConfig, attn_impl: str = "reference",
            remat: bool = False, rules: tuple | None = None) -> jax.Array:
  """Pure forward pass of the unmodified backbone: float32 logits [B, T, V].

  Compute runs in the parameters' dtype. rules: logical-axis rules (`sharding.rules_for(mesh)`);
  with a mesh in context they place the activations. None leaves placement to the compiler.
  """
  dtype = jax.tree.leaves(params)[0].dtype
  with nn.logical_axis_rules(rules or ()):
    logits, _ = transformer(cfg, dtype, attn_impl, remat).apply(
        {"params": params}, input_ids_bt, positions_bt, segment_ids_bt)
  return logits


def forward_routed(params: Params, input_ids_bt: jax.Array, positions_bt: jax.Array,
                   segment_ids_bt: jax.Array, prompt_mask_bt: jax.Array, *, cfg: ModelConfig,
                   rcfg: rt.RouterConfig, attention: str = "elastic", router_params=None,
                   forced_gates=None, key: jax.Array | None = None, tau=1.0,
                   attn_impl: str = "reference", remat: bool = False,
                   rules: tuple | None = None, packed: bool = True, num_segments: int = 2,
                   return_hidden: bool = False, return_kv: bool = False, mlp_chunk: int = 0):
  """Forward pass with elastic (routed), forced or all-sparse attention. Not jitted itself:
  call it inside `jax.jit` (the train step does) or through `forward_routed_jit`.

  attention: how heads attend, one of heads.FORWARD ("full" here is the same pass with every
  gate 1; `forward` is the plain backbone). router_params: stacked router pytree
  ("elastic"); forced_gates: [L, B, S, K] in [0, 1] ("forced"); key: PRNG key for Gumbel
  noise, None for the noiseless inference decision. num_segments: S, the segment slots of the
  routing (segment ids must be below it; 2 for one input per row and its padding).
  Returns (logits [B, T, V] float32, stats) with stats["gate"] [L, B, S, K] (1 = full) where
  there are gates. packed=False promises one unpadded input per row (segment 1, positions
  0..T-1), which lets the fused kernels run; packed or padded batches need True.
  return_hidden: return the final-normed hidden states [B, T, E] instead of the logits (apply
  `output_head` where they are needed, e.g. `objective.chunked_answer_cross_entropy`).
  return_kv: also return every layer's keys (after RoPE) and values, stats["k"], stats["v"]
  [L, B, T, K, H], to fill a decoding cache (`kv_cache.build`).
  mlp_chunk: > 0 runs each layer's MLP this many tokens at a time, each chunk rematerialised
  on its own (the same result; a backward pass holds one chunk's MLP activations).
  """
  check_attention(attention, FORWARD)
  per_layer: dict[str, Any] = {}
  if attention == "elastic":
    per_layer["router"] = router_params
    if key is not None:
      per_layer["key"] = jax.random.split(key, cfg.num_layers)
  elif attention == "forced":
    per_layer["gate"] = forced_gates
  dtype = jax.tree.leaves(params)[0].dtype
  with nn.logical_axis_rules(rules or ()):
    return transformer(cfg, dtype, attn_impl, remat, attention, rcfg, packed, num_segments,
                       mlp_chunk).apply(
        {"params": params}, input_ids_bt, positions_bt, segment_ids_bt, prompt_mask_bt,
        per_layer, jnp.asarray(tau, jnp.float32), return_hidden, return_kv)


forward_routed_jit = jax.jit(forward_routed, static_argnames=(
    "cfg", "rcfg", "attention", "attn_impl", "remat", "rules", "packed", "num_segments",
    "return_hidden", "return_kv", "mlp_chunk"))


def decode_step(params: Params, ids_b: jax.Array, positions_b: jax.Array,
                cache: kv_cache.HeadCache | list, *, cfg: ModelConfig, rcfg: rt.RouterConfig,
                unroll: bool = False, impl: str = "reference"):
  """One token per row through every layer with the per-head cache (the modes it was built
  with), traced inside the decode loop (`generate._decode_tokens`): (float32 logits [B, V],
  the updated cache). impl: the decode attention
  (`attention.decode.attention`: "reference", "auto", a kernel).

  The cache is carried through the loop over layers, so each layer writes its new key/value
  in place instead of the whole cache being rewritten at every step. The loop is a scan over
  the stacked layer weights (unroll: unrolled; a longer compile), or, where params["layers"]
  is a list (`split_layers`), a Python loop over separate per-layer arrays: XLA copies a
  stacked layer's weights out before its matrix products (two extra passes over the weights
  per token), which separate arrays avoid. A cache given as one HeadCache per layer (the
  layer-by-layer prefill, `prefill.by_layer`) is walked by a Python loop too. A cache of
  another layout (`generation.paged.PagedCache`, the serving engine's pages) brings its own
  decode attention (its `decode_attend`).
  """
  dtype = jax.tree.leaves(params)[0].dtype
  ids, pos = ids_b[:, None], positions_b[:, None]
  x = jnp.take(params["embed"], ids, axis=0)
  cos, sin = rope_tables(cfg, pos, dtype)
  ctx = Context(cos, sin, jnp.ones_like(ids), pos)
  layer = DecoderLayer(cfg, dtype, "reference", "full", rcfg)

  def one(x, cache, layer_params, index):
    x, stats = layer.apply({"params": layer_params}, x, ctx,
                           {"cache": cache, "index": index, "impl": impl})
    return x, stats["cache"]

  layers = params["layers"]
  split = isinstance(layers, (list, tuple))              # `split_layers`: one array per layer
  if split or isinstance(cache, list):
    caches = list(cache) if isinstance(cache, list) else None
    for index in range(cfg.num_layers):
      layer_params = layers[index] if split else jax.tree.map(lambda a: a[index], layers)
      if caches is None:                                 # one cache for every layer
        x, cache = one(x, cache, layer_params, index)
      else:                                              # one cache per layer (prefill.by_layer)
        x, caches[index] = one(x, caches[index], layer_params, 0)
    cache = cache if caches is None else caches
  else:
    (x, cache), _ = jax.lax.scan(lambda c, xs: (one(*c, *xs), None), (x, cache),
                                 (params["layers"], jnp.arange(cfg.num_layers)),
                                 unroll=unroll)
  x = RMSNorm("embed", cfg.rms_norm_eps, dtype).apply({"params": params["final_norm"]}, x)
  logits = jnp.einsum("be,ev->bv", x[:, 0], output_head(params, cfg),
                      preferred_element_type=jnp.float32)
  return logits, cache


def split_layers(params: Params) -> Params:
  """`params` with the stacked layer weights [L, ...] as a list of L per-layer trees (copies:
  the layer weights' memory once more while they live), for `decode_step`."""
  return dict(params, layers=unstack_layers(params["layers"]))


@jax.jit
def unstack_layers(layers):
  """Stacked layer weights [L, ...] as a list of L per-layer trees (copies)."""
  n = jax.tree.leaves(layers)[0].shape[0]
  return [jax.tree.map(lambda x: x[i], layers) for i in range(n)]


def output_head(params: Params, cfg: ModelConfig) -> jax.Array:
  """The output projection [E, V]: the lm_head, or the transposed embedding when tied."""
  return params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]


def positions_and_segments(attention_mask_bt: np.ndarray | jax.Array):
  """Positions and segment ids for a padded batch (1 = real token, 0 = padding).

  Real tokens are numbered from 0 whether the padding is on the left or the right; padding
  forms its own segment, so it never mixes with real tokens.
  """
  mask = jnp.asarray(attention_mask_bt).astype(jnp.int32)
  positions = jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0)
  return positions, mask

