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

import functools

from elastic_jax.attention.reference import (Streaming, causal_attention,
                                             dense_causal_attention, hybrid_attention)
import jax
import jax.numpy as jnp

from elastic_jax.attention import mosaic_gpu, pallas_gpu, pallas_tpu
from elastic_jax.errors import ElasticJaxError


def on_hopper() -> bool:
  """Whether the default device is an NVIDIA GPU with wgmma (compute capability 9.x)."""
  return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9")


def _auto_hybrid(*args, **kwargs):
  """The fused kernel for the backend this runs on (Mosaic GPU's forward on Hopper); the
  reference on CPU."""
  gpu = mosaic_gpu.hybrid_attention if on_hopper() else pallas_gpu.hybrid_attention
  impl = {"gpu": gpu, "tpu": pallas_tpu.hybrid_attention}.get(
      jax.default_backend(), hybrid_attention)
  if impl is hybrid_attention:
    kwargs.pop("interpret", None)
  return impl(*args, **kwargs)


def _auto_causal(q, k, v, segment_ids=None):
  """cuDNN's fused attention on a GPU for half-precision unpacked rows; elsewhere on a GPU or
  TPU the backend's hybrid kernel with every head full (MSR 0; packed rows too); the
  reference on a CPU."""
  backend = jax.default_backend()
  if backend == "gpu" and segment_ids is None and q.dtype in (jnp.bfloat16, jnp.float16):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
  if backend == "gpu":
    return _full_heads(HYBRID_IMPLS["mosaic_gpu" if on_hopper() else "pallas_gpu"])(
        q, k, v, segment_ids)
  if backend == "tpu":
    return _full_heads(HYBRID_IMPLS["pallas_tpu"])(q, k, v, segment_ids)
  return causal_attention(q, k, v, segment_ids)


def _full_heads(hybrid, **kwargs):
  """Causal attention `fn(q, k, v, segment_ids)` as a hybrid implementation with every head
  full (gate 1): where no other fused kernel takes the row (packed rows, float32)."""
  def fn(q, k, v, segment_ids=None):
    gate = jnp.ones(k.shape[:3], jnp.float32)
    return hybrid(q, k, v, gate, Streaming(), segment_ids, None, **kwargs)
  return fn


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


KERNELS = ("pallas_gpu", "mosaic_gpu", "pallas_tpu")
# The decode kernel of each backend, under the names decode.attention also takes.
DECODE_KERNELS = {"pallas_gpu": "triton", "mosaic_gpu": "triton", "pallas_tpu": "tpu"}


def parse_impl(impl: str, kernels=KERNELS) -> tuple[str, bool]:
  """(name, interpret) of an implementation name: "NAME:interpret" runs kernel NAME in
  Pallas's interpret mode (on a CPU, for tests). The one place the suffix is read (hybrid,
  causal, prefill, generation and decode all call it); `kernels`: the names that take it."""
  if not isinstance(impl, str):
    raise ElasticJaxError(f"attention implementation must be a name, got {impl!r}")
  name, sep, flag = impl.partition(":")
  if sep and flag != "interpret":
    raise ElasticJaxError(f"attention implementation '{impl}': the only suffix is ':interpret'")
  if sep and name not in kernels:
    raise ElasticJaxError(f"attention implementation '{impl}': ':interpret' applies to the "
                          f"kernels ({', '.join(kernels)})")
  return name, bool(sep)


_split_interpret = parse_impl


def get_attention(impl: str):
  name, interpret = _split_interpret(impl)
  if interpret:   # the kernel itself, every head full, on any backend
    return _full_heads(HYBRID_IMPLS[name], interpret=True)
  return _lookup(IMPLS, name, "attention")


def get_hybrid_attention(impl: str):
  """The hybrid version of `impl`; implementations without one use the reference."""
  name, interpret = _split_interpret(impl)
  if interpret:
    return functools.partial(HYBRID_IMPLS[name], interpret=True)
  if name in HYBRID_IMPLS:
    return HYBRID_IMPLS[name]
  get_attention(name)  # an unknown name is still an error
  return hybrid_attention


__all__ = ["DECODE_KERNELS", "KERNELS", "Streaming", "causal_attention",
           "dense_causal_attention", "hybrid_attention", "get_attention", "get_hybrid_attention",
           "parse_impl"]
