"""Attention implementations behind one signature.

`attention(q, k, v, segment_ids, impl=...)` with q [B, T, N, H], k/v [B, T, K, H],
segment_ids [B, T] or None, returns [B, T, N, H]. Implementations:
  reference  chunked online-softmax in plain jnp; memory-safe at long T (the spec).
  dense      the textbook [T, T] softmax; short inputs and tests only.
"""

from elastic_jax.attention.reference import causal_attention, dense_causal_attention
from elastic_jax.errors import ElasticJaxError

IMPLS = {"reference": causal_attention, "dense": dense_causal_attention}


def get_attention(impl: str):
  try:
    return IMPLS[impl]
  except KeyError:
    raise ElasticJaxError(f"attention implementation '{impl}' is unknown (known: "
                          f"{', '.join(sorted(IMPLS))})") from None
