"""The Pallas Mosaic GPU backend, for Hopper (wgmma, TMA): the warp-specialised forward
kernel (`forward.py`), the dQ and dK/dV kernels (`backward.py`), the XAttention scoring kernel
(`scoring.py`) and the entry points that choose among them and the Triton kernels
(`hybrid.py`), all tiled by one `Tiles` (`tiles.py`). Decode runs the Triton backend's
kernel."""

from elastic_jax.attention import pallas_gpu
from elastic_jax.attention.backend import Backend, XAScorer, on_hopper
from elastic_jax.attention.mosaic_gpu import backward, forward, hybrid, scoring, tiles
from elastic_jax.attention.mosaic_gpu.backward import (  # noqa: F401  (the backend's API)
    DEFAULT_BACKWARD_TILES)
from elastic_jax.attention.mosaic_gpu.forward import (  # noqa: F401
    SMEM_BYTES, TRACE_REGIONS, TRAINING, XAWalk, applies, online_softmax, packed_walk, walk,
    xa_walk)
from elastic_jax.attention.mosaic_gpu.scoring import DEFAULT_SCORING_TILES  # noqa: F401
# The one tile settings of the backend's kernels; the former three classes' names, deprecated
# constructors of it.
from elastic_jax.attention.mosaic_gpu.tiles import (  # noqa: F401
    DEFAULT_TILES, BackwardTiles, MosaicTiles, ScoringTiles, Tiles)
from elastic_jax.attention.mosaic_gpu.hybrid import (  # noqa: F401
    forward_train, hard_gates, hybrid_attention, hybrid_forward, hybrid_forward_hard,
    make_hybrid, make_packed_hybrid, make_packed_xa_hybrid, make_xa_hybrid, packed_backward,
    packed_forward_hard, packed_forward_train, packed_rows_apply, packed_xa_backward,
    packed_xa_forward_hard, packed_xa_forward_train, packed_xa_list_spans, packed_xa_walk,
    positions_count_up, trains, xa_applies, xa_backward, xa_forward_hard, xa_forward_train,
    xa_trains)


def _scorer_preferred(q_shape, xa) -> bool:
  return on_hopper() and scoring.partial_sums_bytes(q_shape, xa) <= scoring.AUTO_BYTES


def _scorer_takes(q_shape, k_shape, dtype, xa, packed: bool) -> bool:
  return not packed and scoring.applies(q_shape, k_shape, dtype, xa)


BACKEND = Backend(
    name="mosaic_gpu", platform="gpu", hybrid=hybrid.hybrid_attention,
    decode=pallas_gpu.decode.decode_attention, decode_applies=pallas_gpu.decode.decode_applies,
    preferred=on_hopper,
    xa_scorer=XAScorer(block_mass=scoring.block_mass_mosaic, takes=_scorer_takes,
                       preferred=_scorer_preferred))


def __getattr__(name):   # the rest of the kernels' modules, as before the backend was a folder
  for module in (hybrid, forward):
    if hasattr(module, name):
      return getattr(module, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
