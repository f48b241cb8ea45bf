"""What a kernel backend gives the package: one `Backend` record per subfolder
(`pallas_gpu/`, `mosaic_gpu/`, `pallas_tpu/`), listed in `registry.py`, which is the one place
that reads an implementation name. A new backend is a new subfolder whose `__init__.py` builds
its record, and one line in the registry.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax


def on_hopper() -> bool:
  """Whether the default device is an NVIDIA GPU with wgmma (compute capability 9.x)."""
  return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9")


def always() -> bool:
  return True


@dataclasses.dataclass(frozen=True)
class XAScorer:
  """A backend's XAttention scoring kernel (`xattention.select` with its name).

  block_mass  (q [B, T, N, H], k [B, T, K, H], xa, *, interpret) -> block mass [B, K, nb, nb];
  takes       (q_shape, k_shape, dtype, xa, packed) -> whether the kernel takes the call;
  preferred   (q_shape, xa) -> whether `attn_impl="auto"` picks it on this machine.
  """
  block_mass: Callable
  takes: Callable
  preferred: Callable


@dataclasses.dataclass(frozen=True)
class Backend:
  """One kernel backend under the implementation name `name`.

  platform        `jax.default_backend()` where it runs natively; elsewhere it runs only in
                  Pallas's interpret mode ("NAME:interpret");
  hybrid          `hybrid(q, k, v, gate_btk, streaming, segment_ids, positions, *,
                  interpret=False)`: plain, padded and packed rows, every pattern setting,
                  with a fused backward (`reference.hybrid_attention`'s contract);
  decode          decode attention over the per-head cache (`decode_reference.reference`'s
                  arguments, plus `interpret`), with `decode_applies(head_dim, capacity,
                  width)` saying which caches it takes;
  preferred       whether "auto" picks this backend on its platform (Mosaic GPU on Hopper);
  xa_scorer       its XAttention scoring kernel, if any;
  paged_decode    decode attention over a paged pool (`decode_reference.paged_reference`'s
                  arguments, plus `interpret`), if any, with `paged_applies(head_dim,
                  page_size)` saying which pools it takes.
  """
  name: str
  platform: str
  hybrid: Callable
  decode: Callable
  decode_applies: Callable = lambda head_dim, capacity, width: True
  preferred: Callable[[], bool] = always
  xa_scorer: XAScorer | None = None
  paged_decode: Callable | None = None
  paged_applies: Callable = lambda head_dim, page_size: True
