"""The Attention Router (docs/method.md §4) and the sparsity ratios (§6).

One router per layer reads that layer's key states (after k-norm, before RoPE), pools them over
the prompt of each packed segment, and scores every KV head with two logits (index 1 = full
attention, the authors' checkpoint convention). Its parameters form their own pytree, stacked
over layers, apart from the frozen backbone:

    {"task_w1": [L, H, 4H], "task_b1": [L, 4H], "task_w2": [L, 4H, H], "task_b2": [L, H],
     "route_w1": [L, H, 4H], "route_b1": [L, 4H], "route_w2": [L, 4H, H], "route_b2": [L, H],
     "route_w3": [L, H, C], "route_b3": [L, C]}          C = 2 (softmax) or 1 (sigmoid)

A static router (`RouterConfig.static`, the input-independent baseline) has instead one learned
logit vector per (layer, KV head), {"static_logits": [L, K, C]}, trained by the same objective.

Shape letters: B batch, T tokens, S segment slots, L layers, K KV heads, H head dim.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from elastic_jax.attention.patterns import PATTERN_PAIRS, Pattern, split_patterns
from elastic_jax.attention.reference import Streaming
from elastic_jax.attention.xattention import XAttention
from elastic_jax.config import ModelConfig

POOLINGS = ("boundary", "prompt_mean")
RELAXATIONS = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class RouterConfig:
  """How heads are routed. Hashable: a static argument of the jitted forward."""
  pooling: str = "boundary"       # boundary: first + last `boundary` prompt tokens; prompt_mean
  boundary: int = 100             # tokens at each end of the prompt for boundary pooling
  relaxation: str = "softmax"     # softmax: two logits + Gumbel-softmax; sigmoid: one logit
  hidden_mult: int = 4            # MLP width = hidden_mult * head_dim
  sink_blocks: int = 1            # the streaming pattern (docs/method.md §3)
  local_blocks: int = 16          # local window, in blocks (the query's own included)
  block: int = 128                # block size in tokens
  patterns: str = "fa-ssa"        # the pattern pair: what heads routed full (r = 1) and sparse
                                  # (r = 0) run: fa-ssa, fa-xa (sparse heads XAttention),
                                  # xa-ssa (full heads XAttention); docs/method.md §3
  xa_threshold: float = 0.9       # XAttention (pattern pairs with "xa")
  xa_stride: int = 16             # XAttention's antidiagonal stride
  xa_block: int = 128             # XAttention's block size in tokens
  static: bool = False            # no input dependence: one learned gate per (layer, KV head),
                                  # the same for every input (a DuoAttention-style baseline)
  head_norm: bool = False         # sigmoid only: layer-normalise the logit across the layer's
                                  # KV heads before the decision (the authors' evaluation code
                                  # for use_softmax false)
  task_mlp: bool = True           # the task MLP before the router MLP (false: an ablation,
                                  # the pooled keys go to the router MLP directly)

  def __post_init__(self):
    if self.pooling not in POOLINGS:
      raise ValueError(f"router pooling '{self.pooling}' is unknown (known: {POOLINGS})")
    if self.relaxation not in RELAXATIONS:
      raise ValueError(f"router relaxation '{self.relaxation}' is unknown "
                       f"(known: {RELAXATIONS})")
    if self.boundary < 1 or self.hidden_mult < 1:
      raise ValueError("router boundary and hidden_mult must be positive")
    if self.static and not self.task_mlp:
      raise ValueError("router task_mlp applies to input-dependent routers, not static ones")
    if self.head_norm and self.relaxation != "sigmoid":
      raise ValueError("router head_norm applies to the sigmoid relaxation only")
    if self.patterns not in PATTERN_PAIRS:
      raise ValueError(f"router patterns '{self.patterns}' is unknown (known: {PATTERN_PAIRS})")
    self.streaming  # validates the SSA numbers
    self.xattention  # and the XAttention ones

  @property
  def streaming(self) -> Streaming:
    return Streaming(self.sink_blocks, self.local_blocks, self.block)

  @property
  def xattention(self) -> XAttention:
    return XAttention(self.xa_stride, self.xa_block, self.xa_threshold)

  @property
  def uses_xattention(self) -> bool:
    return "xa" in self.patterns

  @property
  def num_logits(self) -> int:
    return 2 if self.relaxation == "softmax" else 1


def router_param_names(rcfg: RouterConfig) -> frozenset[str]:
  """The names of one router's parameters under `rcfg` (`init_router_params` makes them)."""
  if rcfg.static:
    return frozenset({"static_logits"})
  mlps = ("task", "route") if rcfg.task_mlp else ("route",)
  return frozenset(f"{m}_{kind}{i}" for m in mlps for kind in "wb"
                   for i in range(1, 4 if m == "route" else 3))


def init_router_params(cfg: ModelConfig, rcfg: RouterConfig, key: jax.Array) -> dict:
  """N(0, 0.02) weights and zero biases (a neutral start), float32, stacked over layers; a
  static router's logits start at zero (both choices equally likely)."""
  h, w, l = cfg.head_dim, rcfg.hidden_mult * cfg.head_dim, cfg.num_layers
  if rcfg.static:
    return {"static_logits": jnp.zeros((l, cfg.num_kv_heads, rcfg.num_logits), jnp.float32)}
  shapes = {"task_w1": (h, w), "task_w2": (w, h), "route_w1": (h, w), "route_w2": (w, h),
            "route_w3": (h, rcfg.num_logits)}
  if not rcfg.task_mlp:
    del shapes["task_w1"], shapes["task_w2"]
  keys = jax.random.split(key, len(shapes))
  params = {name: 0.02 * jax.random.normal(k, (l, *shape), jnp.float32)
            for k, (name, shape) in zip(keys, sorted(shapes.items()))}
  for name, shape in shapes.items():
    params[name.replace("w", "b")] = jnp.zeros((l, shape[1]), jnp.float32)
  return params


def pool_prompt(k_btkh: jax.Array, segment_ids_bt: jax.Array, positions_bt: jax.Array,
                prompt_mask_bt: jax.Array, rcfg: RouterConfig, num_segments: int) -> jax.Array:
  """Pooled prompt keys per segment slot: [B, S, K, H] float32, S = num_segments (segment
  ids must be below it).

  Boundary pooling averages the first `boundary` and the last `boundary` prompt tokens of each
  segment, as the concatenation of the two spans (a short prompt counts its overlap twice, as
  the authors' `cat(k[:100], k[-100:]).mean()` does). A segment's prompt is its tokens with
  `prompt_mask` set, its first tokens; positions count from the segment's start. Slots with no
  prompt give 0.

  Boundary pooling reads only the 2 x boundary keys of each slot: the row's token indices
  are scattered into [B, S, 2 x boundary] slots (integers only), then those keys are gathered.
  Its cost does not grow with the row's length times the number of segments, as a weighted
  sum over every token per segment would (at 128K tokens such a sum reads every key of the
  layer once per slot). Prompt-mean pooling sums each segment's keys once.
  """
  b, t = segment_ids_bt.shape
  seg = segment_ids_bt.astype(jnp.int32)
  prompt = prompt_mask_bt.astype(bool)
  per_row_sum = jax.vmap(lambda x, s: jax.ops.segment_sum(x, s, num_segments))
  plen_bs = per_row_sum(prompt.astype(jnp.int32), seg)                       # [B, S]
  if rcfg.pooling == "prompt_mean":
    w = prompt.astype(jnp.float32)[..., None, None]
    pooled = per_row_sum(k_btkh.astype(jnp.float32) * w, seg)
    return pooled / jnp.maximum(plen_bs, 1).astype(jnp.float32)[:, :, None, None]
  nb = rcfg.boundary
  pos = positions_bt.astype(jnp.int32)
  plen_bt = jnp.take_along_axis(plen_bs, jnp.clip(seg, 0, num_segments - 1), axis=1)
  last = pos - (plen_bt - nb)                     # rank among the last `nb` prompt tokens
  off = 2 * nb                                    # an index past the slots: dropped
  first_slot = jnp.where(prompt & (pos < nb), pos, off)
  last_slot = jnp.where(prompt & (last >= 0) & (last < nb), nb + last, off)
  rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
  tok = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
  idx = jnp.full((b, num_segments, 2 * nb), -1, jnp.int32)
  idx = idx.at[rows, seg, first_slot].set(tok, mode="drop")
  idx = idx.at[rows, seg, last_slot].set(tok, mode="drop")
  return _mean_of_tokens(k_btkh, idx)


def _mean_of_tokens(k_btkh: jax.Array, idx_bsn: jax.Array) -> jax.Array:
  """Mean of the keys at token indices idx [B, S, N] (-1: no token) per slot: [B, S, K, H]
  float32, 0 for a slot with no token."""
  b, s, n = idx_bsn.shape
  ok = (idx_bsn >= 0).astype(jnp.float32)
  flat = jnp.clip(idx_bsn, 0, k_btkh.shape[1] - 1).reshape(b, s * n)
  got = jnp.take_along_axis(k_btkh, flat[:, :, None, None], axis=1)
  got = got.reshape((b, s, n) + k_btkh.shape[2:]).astype(jnp.float32)
  return (jnp.einsum("bsn,bsnkh->bskh", ok, got)
          / jnp.maximum(ok.sum(-1), 1.0)[:, :, None, None])


def pool_prompt_prefix(k_btkh: jax.Array, segment_ids_bt: jax.Array,
                       prompt_mask_bt: jax.Array, rcfg: RouterConfig,
                       num_segments: int) -> jax.Array:
  """`pool_prompt` for rows that each hold one input whose prompt is a prefix (positions
  0 .. n-1, then the answer or right padding), as in unpacked batches: [B, S, K, H] float32.

  Boundary pooling then needs only the first and last `boundary` prompt tokens of each row,
  read by index. The row's result goes to the slot of its first token's segment.
  """
  if rcfg.pooling != "boundary":
    raise ValueError("pool_prompt_prefix implements boundary pooling only")
  plen_b = prompt_mask_bt.astype(jnp.int32).sum(1)
  span = jnp.arange(rcfg.boundary, dtype=jnp.int32)[None]
  first = jnp.broadcast_to(span, (plen_b.shape[0], rcfg.boundary))         # [B, boundary]
  last = plen_b[:, None] - rcfg.boundary + span
  idx = jnp.concatenate([jnp.where(first < plen_b[:, None], first, -1),
                         jnp.where(last >= 0, last, -1)], axis=1)
  pooled_bkh = _mean_of_tokens(k_btkh, idx[:, None])[:, 0]
  slot_bs = jax.nn.one_hot(segment_ids_bt[:, 0], num_segments, dtype=jnp.float32)
  return slot_bs[:, :, None, None] * pooled_bkh[:, None]


def _dense(x, w, b):
  return jnp.einsum("...i,io->...o", x, w) + b.reshape((1,) * (x.ndim - 1) + b.shape)


def task_features(p: dict, pooled_bskh: jax.Array) -> jax.Array:
  """One layer's task MLP on the pooled keys (the pooled keys where the router has none):
  the task representation the router MLP reads. -> [B, S, K, H]."""
  if "task_w1" not in p:
    return pooled_bskh
  return _dense(jax.nn.silu(_dense(pooled_bskh, p["task_w1"], p["task_b1"])), p["task_w2"],
                p["task_b2"])


def router_logits(p: dict, pooled_bskh: jax.Array) -> jax.Array:
  """One layer's router: task MLP (where the params have one) then router MLP, shared over
  heads. -> [B, S, K, C]. A static router's logits [K, C] are the same for every input."""
  if "static_logits" in p:
    return jnp.broadcast_to(p["static_logits"], pooled_bskh.shape[:2] + p["static_logits"].shape)
  x = task_features(p, pooled_bskh)
  x = jax.nn.silu(_dense(x, p["route_w1"], p["route_b1"]))
  x = jax.nn.silu(_dense(x, p["route_w2"], p["route_b2"]))
  return _dense(x, p["route_w3"], p["route_b3"])


def static_margin(static_logits) -> jax.Array:
  """[L, K] from a static router's logits [L, K, C]: how strongly it sends each (layer, KV
  head) pair to full attention (the full logit minus the sparse one; the one logit of a
  sigmoid router), which ranks the pairs for a static head set of any size."""
  z = jnp.asarray(static_logits, jnp.float32)
  return z[..., 1] - z[..., 0] if z.shape[-1] == 2 else z[..., 0]


def gumbel(key: jax.Array, shape, eps: float = 1e-10) -> jax.Array:
  u = jax.random.uniform(key, shape, jnp.float32)
  return -jnp.log(-jnp.log(u + eps) + eps)


def gate_from_logits(z_bskc: jax.Array, rcfg: RouterConfig, *, key: jax.Array | None = None,
                     tau: float | jax.Array = 1.0) -> tuple[jax.Array, jax.Array]:
  """(hard gate, soft gate), each [B, S, K]: r = 1 routes the head to full attention.

  With `key` (training): Gumbel noise, temperature `tau`, and the straight-through estimator
  (the value is the hard decision, the gradient that of the soft one). Without (inference):
  the noiseless argmax, and the soft gate is the plain probability.
  """
  if rcfg.relaxation == "softmax":
    if key is not None:
      z_bskc = z_bskc + gumbel(key, z_bskc.shape)
    soft = jax.nn.softmax(z_bskc / (tau if key is not None else 1.0), axis=-1)[..., 1]
    hard = (z_bskc[..., 1] > z_bskc[..., 0]).astype(jnp.float32)
  else:
    z = z_bskc[..., 0]
    if rcfg.head_norm:
      # LayerNorm over the KV heads without affine weights, eps 1e-5 (torch's default).
      mean = z.mean(-1, keepdims=True)
      var = jnp.square(z - mean).mean(-1, keepdims=True)
      z = (z - mean) * jax.lax.rsqrt(var + 1e-5)
    if key is not None:
      z = z + gumbel(key, z.shape)
    soft = jax.nn.sigmoid(z / (tau if key is not None else 1.0))
    hard = (soft > 0.5).astype(jnp.float32)
  if key is None:
    return jax.lax.stop_gradient(hard), soft
  # Parenthesised so the forward value is exactly the hard decision (no rounding).
  return hard + (soft - jax.lax.stop_gradient(soft)), soft


def gates_per_token(gate_bsk: jax.Array, segment_ids_bt: jax.Array) -> jax.Array:
  """[B, S, K] per segment -> [B, T, K] per token (each token takes its segment's gate)."""
  return jnp.take_along_axis(gate_bsk, segment_ids_bt[:, :, None], axis=1)


# ----------------------------------------------------------------------------------------------
# Sparsity ratios


def msr(gates_lbsk: jax.Array) -> jax.Array:
  """Model sparsity ratio per input, [B, S]: the fraction of (layer, KV head) pairs sent to SA."""
  return 1.0 - gates_lbsk.mean(axis=(0, 3))


def esr(last_layer_gates_bsk: jax.Array, lengths_bs: jax.Array, streaming: Streaming, *,
        patterns: str = "fa-ssa", xa_kept_bsk: jax.Array | None = None) -> jax.Array:
  """Effective sparsity ratio per input, [B, S]: the mean over the last layer's KV heads of the
  pruned fraction of causal keys (0 for an FA head, 1 - kept/causal for an SA head). Under
  the XAttention settings an XA head's kept fraction is that of the blocks it really
  attended, `xa_kept_bsk` (`xattention.kept_fraction`)."""
  hi_pattern, lo_pattern = split_patterns(patterns)
  if Pattern.XA in (hi_pattern, lo_pattern) and xa_kept_bsk is None:
    raise ValueError(f"the ESR of patterns '{patterns}' needs the XA heads' kept fractions")
  pruned = {Pattern.FULL: 0.0,
            Pattern.STREAM: (1.0 - streaming_kept_fraction(lengths_bs, streaming))[..., None],
            Pattern.XA: None if xa_kept_bsk is None else 1.0 - xa_kept_bsk}
  r = last_layer_gates_bsk
  return (r * pruned[hi_pattern] + (1.0 - r) * pruned[lo_pattern]).mean(-1)


def streaming_kept_fraction(lengths: jax.Array, streaming: Streaming) -> jax.Array:
  """Fraction of the causal (query, key) pairs that SSA keeps for sequences of `lengths`
  (closed form, elementwise)."""
  n = lengths.astype(jnp.float32)
  blk, sink, local = streaming.block, streaming.sink_blocks, streaming.local_blocks
  # Queries in blocks < sink + local see every earlier key.
  full_len = jnp.minimum(n, (sink + local) * blk)
  seen = full_len * (full_len + 1) / 2
  # Later queries see the sink (sink * blk keys) plus their window: (p mod blk) + 1 + (local-1)*blk.
  rest = jnp.maximum(n - full_len, 0.0)
  per_block_window = (local - 1) * blk + sink * blk
  # Sum over the remaining positions p of (p mod blk) + 1 + per_block_window.
  whole, part = jnp.floor(rest / blk), jnp.mod(rest, blk)
  seen = seen + rest * per_block_window + whole * blk * (blk + 1) / 2 + part * (part + 1) / 2
  return jnp.where(n > 0, seen / jnp.maximum(n * (n + 1) / 2, 1.0), 1.0)

