"""Attention: the plain-jnp specification, the kernel backends, and the registry that
picks one by name.

Two signatures:
  causal  `attention(q, k, v, segment_ids)`: q [B, T, N, H], k/v [B, T, K, H], segment_ids
          [B, T] or None -> [B, T, N, H];
  hybrid  `hybrid(q, k, v, gate_btk, streaming, segment_ids, positions)`: each KV head mixes
          its pattern pair's two patterns by its gate (`reference.hybrid_attention`; the
          patterns: `patterns.py`).

Where things are:
  registry.py          names -> implementations (`get_attention`, `get_hybrid_attention`,
                       `decode_kernel`, "NAME:interpret"); the one place a name is read
  backend.py           the record each backend gives the registry (`Backend`)
  patterns.py          Pattern (full / stream / xa), the pairs, the kernels' Mode
  reference.py         the spec: chunked online softmax in plain jnp (and `dense`)
  decode_reference.py  the spec of decode over the per-head cache
  xattention.py        XAttention's block scoring and selection
  common.py            pieces the kernels share (tile ranges, packed-row plans, modes)
  hybrid.py            the hybrid entry point the model calls (checks, XA selection)
  sequence_parallel.py the same over a device mesh's sequence axis
  pallas_gpu/          Pallas Triton kernels for any GPU: hybrid forward/backward, decode
  mosaic_gpu/          Pallas Mosaic GPU kernels for Hopper: forward, backward, XA scoring
  pallas_tpu/          Pallas Mosaic TPU kernels: hybrid forward/backward, decode

Names: "reference", "dense" (causal only), "pallas_gpu", "mosaic_gpu", "pallas_tpu", and
"auto" (Mosaic GPU on Hopper, Triton on other GPUs, the TPU kernels on a TPU, the reference on
a CPU; causal layers take cuDNN on a GPU for half-precision unpacked rows). Every kernel runs
on a CPU in Pallas's interpret mode ("pallas_gpu:interpret"), which the tests use. A new
backend is a subfolder with its `Backend` record and one entry in `registry.BACKENDS`
(docs/architecture.md).
"""

from elastic_jax.attention.backend import Backend, on_hopper
from elastic_jax.attention.reference import (Streaming, causal_attention,
                                             dense_causal_attention, hybrid_attention)
from elastic_jax.attention.registry import (BACKENDS, DECODE_KERNELS, HYBRID_IMPLS, IMPLS,
                                            KERNELS, get_attention, get_hybrid_attention,
                                            parse_impl)

__all__ = ["BACKENDS", "Backend", "DECODE_KERNELS", "KERNELS", "Streaming", "causal_attention",
           "dense_causal_attention", "hybrid_attention", "get_attention", "get_hybrid_attention",
           "on_hopper", "parse_impl"]
