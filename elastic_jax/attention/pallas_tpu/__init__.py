"""The Pallas Mosaic TPU backend: the fused hybrid FA/SSA/XA kernels with their backward
passes (`hybrid.py`) and decode over the per-head cache (`decode.py`)."""

from elastic_jax.attention.backend import Backend
from elastic_jax.attention.pallas_tpu import decode, hybrid
from elastic_jax.attention.pallas_tpu.hybrid import (  # noqa: F401  (the backend's API)
    Tiles, hybrid_attention, hybrid_backward, hybrid_forward, hybrid_forward_train,
    kv_schedule, make_hybrid, q_schedule, xa_hybrid_forward, xa_kernel_applies, xa_schedule)
# Former names of the builder (deprecated for `make_hybrid(tiles, packed=, xa=)`).
from elastic_jax.attention.pallas_tpu.hybrid import (  # noqa: F401
    fused_hybrid, fused_packed_hybrid, fused_xa_hybrid)

BACKEND = Backend(name="pallas_tpu", platform="tpu", hybrid=hybrid.hybrid_attention,
                  decode=decode.decode_attention)


def __getattr__(name):   # the rest of the kernels' module, as before the backend was a folder
  return getattr(hybrid, name)
