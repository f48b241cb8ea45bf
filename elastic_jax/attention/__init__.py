"""Attention implementations behind two signatures.

Causal: `attention(q, k, v, segment_ids)` with q [B, T, N, H], k/v [B, T, K, H],
segment_ids [B, T] or None, returns [B, T, N, H].
Hybrid: `hybrid(q, k, v, gate_btk, streaming, segment_ids, positions)` mixes full and
streaming attention per KV head (see `reference.hybrid_attention`).

Implementations:
  reference  chunked online-softmax in plain jnp; memory-safe at long T (the spec).
  dense      the textbook [T, T] softmax (causal only); short inputs and tests.
  pallas_gpu the fused hybrid kernel (hybrid only; Pallas Triton backend; `interpret=True`
             runs it on CPU). Its backward pass is the reference's for now.
"""

from elastic_jax.attention.reference import (Streaming, causal_attention,
                                             dense_causal_attention, hybrid_attention)
from elastic_jax.attention import pallas_gpu
from elastic_jax.errors import ElasticJaxError

IMPLS = {"reference": causal_attention, "dense": dense_causal_attention}
HYBRID_IMPLS = {"reference": hybrid_attention, "pallas_gpu": pallas_gpu.hybrid_attention}


def _lookup(table, impl, what):
  try:
    return table[impl]
  except KeyError:
    raise ElasticJaxError(f"{what} implementation '{impl}' is unknown (known: "
                          f"{', '.join(sorted(table))})") from None


def get_attention(impl: str):
  return _lookup(IMPLS, impl, "attention")


def get_hybrid_attention(impl: str):
  """The hybrid version of `impl`; implementations without one use the reference."""
  if impl in HYBRID_IMPLS:
    return HYBRID_IMPLS[impl]
  get_attention(impl)  # an unknown name is still an error
  return hybrid_attention


__all__ = ["Streaming", "causal_attention", "dense_causal_attention", "hybrid_attention",
           "get_attention", "get_hybrid_attention"]
