"""Public operators."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from elastic_jax.attention import HYBRID_IMPLS, Streaming
from elastic_jax.attention.common import segment_bounds
from elastic_jax.attention.patterns import PATTERN_PAIRS
from elastic_jax.errors import ElasticJaxError


def _concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def _check_inputs(q, k, v, gate, segment_ids, positions) -> None:
  if positions is not None and segment_ids is None:
    raise ElasticJaxError("positions number the tokens within packed segments: pass "
                          "segment_ids with them, or neither for one unpacked input per row")
  for name, x, rank in (("q", q, 4), ("k", k, 4), ("v", v, 4)):
    if getattr(x, "ndim", None) != rank:
      raise ElasticJaxError(f"{name} must be [B, T, heads, D], got shape "
                            f"{list(getattr(x, 'shape', ()))}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ElasticJaxError(f"{name} must be a floating-point array, got {x.dtype}")
    if 0 in x.shape:
      raise ElasticJaxError(f"{name} has an empty dimension: shape {list(x.shape)}")
  if not q.dtype == k.dtype == v.dtype:
    raise ElasticJaxError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype} and "
                          f"{v.dtype}")
  if k.shape != v.shape:
    raise ElasticJaxError(f"k and v differ in shape: {list(k.shape)} and {list(v.shape)}")
  b, t, hq, d = q.shape
  if k.shape[:2] != (b, t) or k.shape[3] != d:
    raise ElasticJaxError(f"q {list(q.shape)} and k/v {list(k.shape)} must share batch, length "
                          "and head_dim (self-attention: q, k and v are the same tokens)")
  if hq % k.shape[2]:
    raise ElasticJaxError(f"q has {hq} heads, not a multiple of k/v's {k.shape[2]} (GQA)")
  if not (jnp.issubdtype(gate.dtype, jnp.floating) or jnp.issubdtype(gate.dtype, jnp.integer)
          or gate.dtype == jnp.bool_):
    raise ElasticJaxError(f"gate must be numeric, got {gate.dtype}")
  if _concrete(gate):
    g = np.asarray(gate, np.float32)   # numpy: also for a constant inside a jit trace
    if bool(np.any((g < 0) | (g > 1) | np.isnan(g))):
      raise ElasticJaxError("gate values must lie in [0, 1] (1 = full attention)")
  for name, x in (("segment_ids", segment_ids), ("positions", positions)):
    if x is None:
      continue
    if tuple(x.shape) != (b, t) or not jnp.issubdtype(x.dtype, jnp.integer):
      raise ElasticJaxError(f"{name} must be integers [B, T] = {[b, t]}, got "
                            f"{x.dtype}{list(x.shape)}")
  if segment_ids is not None and all(_concrete(x) for x in (segment_ids, positions, gate)):
    _check_segments(np.asarray(segment_ids), None if positions is None else
                    np.asarray(positions), np.asarray(gate, np.float32))
  elif segment_ids is None and gate.ndim == 3 and gate.shape[1] > 1 and _concrete(gate):
    g = np.asarray(gate, np.float32)
    rows = np.flatnonzero((g != g[:, :1]).any(axis=(1, 2)))
    if rows.size:
      raise ElasticJaxError(f"gate, row {int(rows[0])}: more than one gate per KV head along "
                            "a row without segment_ids, which is one segment, routed once")


def _check_segments(seg, pos, gate) -> None:
  """Packed rows, where the values are known: every segment id other than 0 (padding) is one
  contiguous run of its row, its positions count 0, 1, ... from the run's start, and a gate
  given per token ([B, T, K]) is constant within it."""
  for row in range(seg.shape[0]):
    s = seg[row]
    starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
    ids = s[starts]
    real = ids != 0
    if len(set(ids[real].tolist())) != int(real.sum()):
      dup = next(i for i in ids[real] if (ids[real] == i).sum() > 1)
      raise ElasticJaxError(f"segment_ids, row {row}: segment {int(dup)} is split into "
                            "several runs; each packed segment must be one contiguous run")
    ends = np.r_[starts[1:], len(s)]
    for a, e, i in zip(starts, ends, ids):
      if i == 0:
        continue
      if pos is not None and not np.array_equal(pos[row, a:e], np.arange(e - a)):
        raise ElasticJaxError(f"positions, row {row}: segment {int(i)} (tokens {a}-{e - 1}) "
                              "must count 0, 1, ... from its start")
      if gate.ndim == 3 and (gate[row, a:e] != gate[row, a]).any():
        raise ElasticJaxError(f"gate, row {row}: segment {int(i)} (tokens {a}-{e - 1}) has "
                              "more than one gate per KV head; a segment is routed once")


def hybrid_attention(q: jax.Array, k: jax.Array, v: jax.Array, gate: jax.Array, *,
                     sink_blocks: int = 1, local_blocks: int = 16, block: int = 128,
                     attn_impl: str = "reference", segment_ids: jax.Array | None = None,
                     positions: jax.Array | None = None, patterns: str = "fa-ssa",
                     xa_keep: jax.Array | None = None, xa_block: int = 128,
                     **impl_kwargs) -> jax.Array:
  """Elastic attention: O = r * O_FA + (1 - r) * O_SSA for each KV head.

  Args:
    q: [B, T, Hq, D]; k, v: [B, T, Hkv, D] with Hq a multiple of Hkv (GQA).
    gate: r in [0, 1], [B, Hkv] (or [B, T, Hkv] for packed inputs whose segments route
      differently); 1 = full causal attention, 0 = streaming (sink + local blocks).
    sink_blocks, local_blocks, block: the streaming pattern (docs/method.md §3); any T.
    attn_impl: "reference" (plain jnp, memory-safe), "pallas_gpu" or "pallas_tpu" (the fused
      kernels; `interpret=True` runs them on CPU), "mosaic_gpu" (pallas_gpu with Hopper
      forward and training kernels in Mosaic GPU), or "auto" (the kernel for this backend,
      the reference on CPU).
    segment_ids, positions: [B, T] packed segments and positions within them (optional).
    patterns: "fa-ssa"; "fa-xa" (r = 0 heads attend only XAttention's kept blocks) or "xa-ssa"
      (r = 1 heads do), with xa_keep [B, Hkv, nb, nb] bool the kept blocks of xa_block tokens
      (`elastic_jax.attention.xattention.select`).
  Differentiable in q, k, v and gate (the kept blocks are constants).

  Shapes and dtypes are checked up front, one sentence each. Values (gates in [0, 1]; each
  packed segment one contiguous run of its row, with positions 0, 1, ... from its start and
  one gate per KV head; segment id 0 is padding, free of these rules) are checked when they
  are concrete, i.e. not under `jax.jit`, where only shapes and dtypes are known: inside jit
  the caller vouches for them, and what the operator computes stays the same for every
  implementation: each contiguous run of equal segment ids is a segment of its own (an id
  used by two runs, padding included, makes two segments), and each segment (without
  segment_ids, each row) is routed by its first token's gate.
  """
  if attn_impl not in HYBRID_IMPLS:
    raise ElasticJaxError(f"hybrid attention implementation '{attn_impl}' is unknown (known: "
                          f"{', '.join(sorted(HYBRID_IMPLS))})")
  if not hasattr(gate, "dtype"):
    try:
      gate = jnp.asarray(gate, jnp.float32)
    except (TypeError, ValueError):
      raise ElasticJaxError("gate must be an array [B, Hkv] or [B, T, Hkv] of values in "
                            f"[0, 1], got {type(gate).__name__}") from None
  _check_inputs(q, k, v, gate, segment_ids, positions)
  b, t = q.shape[:2]
  hkv = k.shape[2]
  if gate.shape == (b, hkv):
    gate = jnp.broadcast_to(gate[:, None, :], (b, t, hkv))
  elif gate.shape != (b, t, hkv):
    raise ElasticJaxError(f"gate has shape {list(gate.shape)}; expected [B, Hkv] = "
                          f"{[b, hkv]} or [B, T, Hkv] = {[b, t, hkv]}")
  if patterns not in PATTERN_PAIRS:
    raise ElasticJaxError(f"patterns '{patterns}' is unknown (known: {', '.join(PATTERN_PAIRS)})")
  if patterns != "fa-ssa":
    if not isinstance(xa_block, int) or xa_block < 1:
      raise ElasticJaxError(f"xa_block must be a positive number of tokens, got {xa_block!r}")
    if xa_keep is None:
      raise ElasticJaxError(f"patterns '{patterns}' needs the kept XAttention blocks (xa_keep)")
    nb = -(-t // xa_block)
    if tuple(xa_keep.shape) != (b, hkv, nb, nb) or xa_keep.dtype != jnp.bool_:
      raise ElasticJaxError(f"xa_keep is {xa_keep.dtype}{list(xa_keep.shape)}; expected bool "
                            f"[B, Hkv, nb, nb] = {[b, hkv, nb, nb]} for blocks of {xa_block}")
    impl_kwargs.update(patterns=patterns, xa_keep=xa_keep, xa_block=xa_block)
  # What the implementations are given: segments as the kernels read them (runs, each named
  # by its first index) and one gate value per segment (its first token's; each token keeps its
  # own gradient). Rows that pass the checks above are unchanged by this, bit for bit, but
  # for their padding runs (id 0), each now a segment of its own; rows under jit, which the
  # checks cannot see, then mean the same to every implementation.
  if not jnp.issubdtype(gate.dtype, jnp.floating):
    gate = gate.astype(jnp.float32)
  if segment_ids is not None:   # a run's first index names it
    segment_ids = segment_bounds(segment_ids)[0]
    first = jnp.take_along_axis(gate, segment_ids[:, :, None], axis=1)
  else:
    first = jnp.broadcast_to(gate[:, :1], gate.shape)
  gate = gate + jax.lax.stop_gradient(first - gate)
  return HYBRID_IMPLS[attn_impl](q, k, v, gate, Streaming(sink_blocks, local_blocks, block),
                            segment_ids, positions, **impl_kwargs)
