"""Every attention implementation by name: the one place an implementation name is read.

A name is a backend's (`BACKENDS`: "pallas_gpu", "mosaic_gpu", "pallas_tpu"), "reference"
(plain jnp, the spec), "dense" (the textbook [T, T] softmax, causal only) or "auto" (the
backend this machine prefers, else the reference); a backend's name with ":interpret" runs its
kernels in Pallas's interpret mode on any machine (a CPU, for tests). The same name serves the
hybrid attention of routed layers, the causal attention of unrouted ones (a backend's name
routes those through cuDNN or its kernel with every head full, as "auto" does), XAttention
scoring (`xattention.select`) and decode over the per-head cache (`decode_kernel`).

Adding a backend: a subfolder whose `__init__.py` builds its `backend.Backend` record, and its
entry in `BACKENDS` below.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp

from elastic_jax.attention import mosaic_gpu, pallas_gpu, pallas_tpu, xattention
from elastic_jax.attention.backend import Backend
from elastic_jax.attention.reference import (Streaming, causal_attention,
                                             dense_causal_attention, hybrid_attention)
from elastic_jax.errors import ElasticJaxError

BACKENDS: dict[str, Backend] = {b.name: b for b in (pallas_gpu.BACKEND, mosaic_gpu.BACKEND,
                                                    pallas_tpu.BACKEND)}
KERNELS = tuple(BACKENDS)
# Decode's former names for the backends' decode kernels (deprecated aliases).
_DECODE_ALIASES = {"triton": "pallas_gpu", "tpu": "pallas_tpu"}

for _backend in BACKENDS.values():
  if _backend.xa_scorer is not None:
    xattention.register_scorer(_backend.name, _backend.xa_scorer)


def native() -> Backend | None:
  """The backend "auto" runs on this machine (None on a CPU)."""
  platform = jax.default_backend()
  return next((b for b in BACKENDS.values() if b.platform == platform and b.preferred()),
              None)


def parse_impl(impl: str, kernels=KERNELS) -> tuple[str, bool]:
  """(name, interpret) of an implementation name: "NAME:interpret" runs kernel NAME in
  Pallas's interpret mode (on a CPU, for tests). `kernels`: the names that take the suffix."""
  if not isinstance(impl, str):
    raise ElasticJaxError(f"attention implementation must be a name, got {impl!r}")
  name, sep, flag = impl.partition(":")
  if sep and flag != "interpret":
    raise ElasticJaxError(f"attention implementation '{impl}': the only suffix is ':interpret'")
  if sep and name not in kernels:
    raise ElasticJaxError(f"attention implementation '{impl}': ':interpret' applies to the "
                          f"kernels ({', '.join(kernels)})")
  return name, bool(sep)


def _check_name(name: str, what: str = "attention") -> None:
  if name not in IMPLS:
    raise ElasticJaxError(f"{what} implementation '{name}' is unknown (known: "
                          f"{', '.join(sorted(IMPLS))})")


def full_heads(hybrid, **kwargs):
  """Causal attention `fn(q, k, v, segment_ids)` as a hybrid implementation with every head
  full (gate 1): where no other fused kernel takes the row (packed rows, float32)."""
  def fn(q, k, v, segment_ids=None):
    gate = jnp.ones(k.shape[:3], jnp.float32)
    return hybrid(q, k, v, gate, Streaming(), segment_ids, None, **kwargs)
  return fn


def auto_hybrid(*args, **kwargs):
  """The preferred backend's fused kernel on this machine; the reference on a CPU."""
  backend = native()
  if backend is None:
    kwargs.pop("interpret", None)
    return hybrid_attention(*args, **kwargs)
  return backend.hybrid(*args, **kwargs)


def auto_causal(q, k, v, segment_ids=None):
  """cuDNN's fused attention on a GPU for half-precision unpacked rows; elsewhere on a GPU or
  TPU the preferred backend's hybrid kernel with every head full (MSR 0; packed rows too);
  the reference on a CPU."""
  backend = native()
  if (backend is not None and backend.platform == "gpu" and segment_ids is None
      and q.dtype in (jnp.bfloat16, jnp.float16)):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
  if backend is not None:
    return full_heads(backend.hybrid)(q, k, v, segment_ids)
  return causal_attention(q, k, v, segment_ids)


def get_attention(impl: str):
  """Causal attention `fn(q, k, v, segment_ids)` for `impl`."""
  name, interpret = parse_impl(impl)
  if interpret:   # the kernel itself, every head full, on any backend
    return full_heads(BACKENDS[name].hybrid, interpret=True)
  _check_name(name)
  return IMPLS[name]


def get_hybrid_attention(impl: str):
  """Hybrid attention `fn(q, k, v, gate_btk, streaming, segment_ids, positions)` for `impl`;
  "dense" (causal only) uses the reference."""
  name, interpret = parse_impl(impl)
  if interpret:
    return functools.partial(BACKENDS[name].hybrid, interpret=True)
  if name in HYBRID_IMPLS:
    return HYBRID_IMPLS[name]
  _check_name(name)        # a causal-only name (dense) takes the reference hybrid
  return hybrid_attention


def decode_kernel(impl: str, head_dim: int, capacity: int, width: int):
  """(kernel or None for the reference, interpret) of decode attention for `impl`: a backend's
  name (with ":interpret") takes its decode kernel; "auto" the preferred backend's where it
  takes the cache, else the reference; "reference" the reference."""
  name, interpret = parse_impl(impl, kernels=KERNELS + tuple(_DECODE_ALIASES))
  if name in _DECODE_ALIASES:
    warnings.warn(f"decode attention '{name}' is now called '{_DECODE_ALIASES[name]}'",
                  DeprecationWarning, stacklevel=3)
    name = _DECODE_ALIASES[name]
  if name not in ("reference", "auto", *KERNELS):
    raise ValueError(f"decode attention '{impl}' is not one of reference, auto, "
                     f"{', '.join(KERNELS)}")
  if name == "auto":
    backend = native()
    if backend is None or not backend.decode_applies(head_dim, capacity, width):
      return None, False
    return backend.decode, False
  if name == "reference":
    return None, False
  return BACKENDS[name].decode, interpret


def paged_kernel(impl: str, head_dim: int, page_size: int):
  """(kernel or None for the reference, interpret) of decode attention over a paged pool
  (generation/paged.py) for `impl`: a backend's name (with ":interpret") takes its paged
  kernel (an error where it has none or it does not take the shapes); "auto" a kernel of
  this machine's platform that takes them (the preferred backend's first), else the
  reference; "reference" the reference."""
  name, interpret = parse_impl(impl)
  if name not in ("reference", "auto", *KERNELS):
    raise ElasticJaxError(f"decode attention over pages '{impl}' is not one of reference, "
                          f"auto, {', '.join(b for b in KERNELS if BACKENDS[b].paged_decode)}")
  if name == "reference":
    return None, False
  if name == "auto":
    here = [b for b in BACKENDS.values() if b.platform == jax.default_backend()
            and b.paged_decode is not None and b.paged_applies(head_dim, page_size)]
    here.sort(key=lambda b: b is not native())          # the preferred backend's first
    return (here[0].paged_decode if here else None), False
  backend = BACKENDS[name]
  if backend.paged_decode is None:
    raise ElasticJaxError(f"backend '{name}' has no decode kernel over pages")
  if not backend.paged_applies(head_dim, page_size):
    raise ElasticJaxError(f"the {name} kernel over pages does not take head dim {head_dim} "
                          f"with pages of {page_size} tokens (powers of two >= 16)")
  return backend.paged_decode, interpret


# The implementations by name: causal (every name; a backend's name routes unrouted layers as
# "auto" does) and hybrid. An entry added to IMPLS (and to HYBRID_IMPLS for a hybrid one)
# makes a new name usable everywhere `attn_impl` is taken.
HYBRID_IMPLS = {"reference": hybrid_attention, "auto": auto_hybrid,
                **{name: b.hybrid for name, b in BACKENDS.items()}}
IMPLS = {"reference": causal_attention, "dense": dense_causal_attention,
         "auto": auto_causal, **{name: auto_causal for name in BACKENDS}}
DECODE_KERNELS = {"pallas_gpu": "pallas_gpu", "mosaic_gpu": "pallas_gpu",
                  "pallas_tpu": "pallas_tpu"}
