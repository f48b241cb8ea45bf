"""The Pallas Triton backend, for any GPU: the fused hybrid FA/SSA/XA kernels with their
backward passes (`hybrid.py`), decode over the per-head cache (`decode.py`) and over the
serving engine's pages (`paged.py`)."""

from elastic_jax.attention import xattention
from elastic_jax.attention.backend import Backend, XAScorer, on_hopper
from elastic_jax.attention.pallas_gpu import decode, hybrid, paged
from elastic_jax.attention.pallas_gpu.hybrid import (  # noqa: F401  (the backend's API)
    DKV_TILES, DQ_TILES, FORWARD_TILES, LOG2E, TRAIN_FORWARD_TILES, PackedXA, Tiles,
    hybrid_attention, hybrid_forward, make_hybrid, online_update, parts, xa_hybrid_forward,
    xa_kernel_applies)
# Former names: the parts' (kept, without a warning: the Mosaic GPU backend calls them) and
# the builders' (deprecated for `make_hybrid(..., packed=, xa=)`).
from elastic_jax.attention.pallas_gpu.hybrid import (  # noqa: F401
    hybrid_parts, make_packed_hybrid, make_packed_xa_hybrid, make_xa_hybrid, packed_parts,
    xa_parts)


def _scorer_takes(q_shape, k_shape, dtype, xa, packed: bool) -> bool:
  return not packed


BACKEND = Backend(
    name="pallas_gpu", platform="gpu", hybrid=hybrid.hybrid_attention,
    decode=decode.decode_attention, decode_applies=decode.decode_applies,
    preferred=lambda: not on_hopper(),
    xa_scorer=XAScorer(block_mass=xattention.block_mass_pallas, takes=_scorer_takes,
                       preferred=lambda q_shape, xa: False),
    paged_decode=paged.paged_attention, paged_applies=paged.paged_applies)


def __getattr__(name):   # the rest of the kernels' module, as before the backend was a folder
  return getattr(hybrid, name)
