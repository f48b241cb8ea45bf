"""Attention implementations behind two signatures.

Causal: `attention(q, k, v, segment_ids)` with q [B, T, N, H], k/v [B, T, K, H],
segment_ids [B, T] or None, returns [B, T, N, H].
Hybrid: `hybrid(q, k, v, gate_btk, streaming, segment_ids, positions)` mixes full and
streaming attention per KV head (see `reference.hybrid_attention`).

Implementations:
  reference  chunked online-softmax in plain jnp; memory-safe at long T (the spec).
  dense      the textbook [T, T] softmax (causal only); short inputs and tests.
  pallas_gpu the fused hybrid kernel for GPUs (hybrid only; Pallas Triton backend).
  mosaic_gpu pallas_gpu with a Hopper inference forward in Pallas Mosaic GPU (wgmma, TMA)
             for hard gates and the shapes it takes (`mosaic_gpu.applies`).
  pallas_tpu the fused hybrid kernel for TPUs (hybrid only; Pallas Mosaic TPU).
  auto       hybrid: mosaic_gpu on a Hopper GPU, pallas_gpu on other GPUs, pallas_tpu on a
             TPU, the reference elsewhere;
             causal: cuDNN on a GPU (bf16/fp16, unpacked), the reference elsewhere.
The kernels run on CPU with `interpret=True` and have fused backward passes; packed segments
fall back to the reference.
"""

from elastic_jax.attention.reference import (Streaming, causal_attention,
                                             dense_causal_attention, hybrid_attention)
import jax
import jax.numpy as jnp

from elastic_jax.attention import mosaic_gpu, pallas_gpu, pallas_tpu
from elastic_jax.errors import ElasticJaxError


def _hopper() -> bool:
  """Whether the default device is an NVIDIA GPU with wgmma (compute capability 9.x)."""
  return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9")


def _auto_hybrid(*args, **kwargs):
  """The fused kernel for the backend this runs on (Mosaic GPU's forward on Hopper); the
  reference on CPU."""
  gpu = mosaic_gpu.hybrid_attention if _hopper() else pallas_gpu.hybrid_attention
  impl = {"gpu": gpu, "tpu": pallas_tpu.hybrid_attention}.get(
      jax.default_backend(), hybrid_attention)
  if impl is hybrid_attention:
    kwargs.pop("interpret", None)
  return impl(*args, **kwargs)


def _auto_causal(q, k, v, segment_ids=None):
  """cuDNN's fused attention on a GPU for half-precision unpacked rows; the reference else."""
  if (jax.default_backend() == "gpu" and segment_ids is None
      and q.dtype in (jnp.bfloat16, jnp.float16)):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
  return causal_attention(q, k, v, segment_ids)


# The hybrid kernels' names also name a causal implementation (auto's), so that a model run
# with impl="pallas_gpu" routes its heads through that kernel and its full layers as auto.
IMPLS = {"reference": causal_attention, "dense": dense_causal_attention,
         "auto": _auto_causal, "pallas_gpu": _auto_causal, "mosaic_gpu": _auto_causal,
         "pallas_tpu": _auto_causal}
HYBRID_IMPLS = {"reference": hybrid_attention, "pallas_gpu": pallas_gpu.hybrid_attention,
                "mosaic_gpu": mosaic_gpu.hybrid_attention,
                "pallas_tpu": pallas_tpu.hybrid_attention, "auto": _auto_hybrid}


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
