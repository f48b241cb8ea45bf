"""Attention implementations behind two signatures.

Causal: `attention(q, k, v, segment_ids)` with q [B, T, N, H], k/v [B, T, K, H],
segment_ids [B, T] or None, returns [B, T, N, H].
Hybrid: `hybrid(q, k, v, gate_btk, streaming, segment_ids, positions)` mixes full and
streaming attention per KV head (see `reference.hybrid_attention`).

Implementations:
  reference  chunked online-softmax in plain jnp; memory-safe at long T (the spec).
  dense      the textbook [T, T] softmax (causal only); short inputs and tests.
  pallas_gpu the fused hybrid kernel for GPUs (hybrid only; Pallas Triton backend).
  mosaic_gpu pallas_gpu with Hopper kernels in Pallas Mosaic GPU (wgmma, TMA): the inference
             forward for hard gates and the shapes it takes (`mosaic_gpu.applies`), and
             the training kernels where they take the shapes (`mosaic_gpu.trains`; in
             interpret mode training keeps the Triton kernels, `mosaic_gpu.TRAINING`).
  pallas_tpu the fused hybrid kernel for TPUs (hybrid only; Pallas Mosaic TPU).
  auto       hybrid: mosaic_gpu on a Hopper GPU, pallas_gpu on other GPUs, pallas_tpu on a
             TPU, the reference elsewhere;
             causal: cuDNN on a GPU (bf16/fp16, unpacked), the reference elsewhere.
             Elsewhere on a GPU or TPU (packed rows, float32): the backend's hybrid kernel
             with every head full.
The kernels run on CPU with `interpret=True` (implementation "NAME:interpret", e.g.
"pallas_gpu:interpret") and have fused backward passes. Packed rows (segment ids and
positions) run on the packed kernels (`pallas_gpu.make_packed_hybrid`, whose inference
forward and training kernels mosaic_gpu replaces by its own where gates are hard (forward)
and positions count up, and
`pallas_tpu.fused_packed_hybrid`), under the XAttention settings too
(`pallas_gpu.make_packed_xa_hybrid`, likewise replaced by `mosaic_gpu.make_packed_xa_hybrid`,
and `pallas_tpu.fused_packed_hybrid(xa=True)`).
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
