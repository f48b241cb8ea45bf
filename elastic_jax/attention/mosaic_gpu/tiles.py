"""The Mosaic GPU backend's tile settings: one frozen dataclass, `Tiles`, whose flat fields
serve its three kernels, each reading its own. `Tiles()` is the builders' default,
`DEFAULT_TILES`; every entry point takes one `tiles=`.

The forward (`forward.py`): block_q .. chain. Rows per compute warpgroup, keys per KV tile,
K/V slots in the shared-memory ring, and the compute warpgroups' schedule: with `overlap`,
each issues tile s's QK^T and tile s-1's PV together and runs tile s's softmax while the PV
product is in flight (FlashAttention-3's intra-warpgroup overlap, beside the two warpgroups'
turns), holding one more score tile and P in registers; without, QK^T, softmax, PV in turn.
persistent = P > 0 launches P programs (e.g. the GPU's SM count) that each take the work
items p, p + P, ... in heavy-first order, the K/V ring running on across items (the next
item's first tiles load while the last ones are computed); 0 launches one program per item.
multicast (G a multiple of 4, not persistent) launches the two programs of one KV head and
query tile as a cluster: each loads half of every K/V tile and the bulk copy engine
multicasts it into both programs' rings, halving the K/V traffic out of L2; a slot is free
once both programs' warpgroups have released it (a cluster barrier). q_registers (natively;
interpret mode keeps Q in shared memory) loads each warpgroup's Q tile into registers once,
so that QK^T reads only K out of shared memory. trace (natively; a diagnostic): a folder
where the Mosaic GPU profiler writes, on every call, a timeline of each warpgroup's regions
of the schedule with neither overlap nor chain (`TRACE_REGIONS`) as a Perfetto trace (JSON);
each region costs a few cycles of clock reads and stores, so a traced kernel runs slower.
The events collect in the shared memory the tiles leave free (about 64 KiB at the default
tiles and head_dim 128: walks up to about 24K tokens); not with persistent programs. chain
(not with overlap, persistent or trace: those schedules take chain=False): in its turn a
compute warpgroup issues tile s+1's QK^T and tile s's PV back to back and awaits both after
the turn, where the schedule without overlap awaits PV before it issues the next QK^T; the
tensor cores then see no wait between a warpgroup's two products, and the other warpgroup's
softmax still covers them. A tile's K is then released a step before its V, and each is
refilled as soon as it is free. The builders' default, `DEFAULT_TILES`, chains its products
(on an H100, full heads 1.6-4.3% faster than without, hybrid rows 0.4-8.5%;
benchmarks/README.md); `Tiles(chain=False)` is the schedule with neither overlap nor chain,
`Tiles(chain=False, overlap=True)` the overlapped one.

The dQ and dK/dV kernels (`backward.py`): dq_block_q .. registers. Rows per compute
warpgroup and keys per K/V tile of the dQ kernel; keys per compute warpgroup and rows per
Q/dO tile of the dK/dV kernel; slots of each kernel's ring (`backward_slots`). Register budget
per compute warpgroup (128 threads, head_dim 128, float32): dQ's accumulator [64, 128] takes
64 registers a thread, S and dP [64, 64] 32 each; dK/dV's two accumulators 128, S^T and dP^T
32 each. Tiles of 128 keys in dQ would add 64 more. `registers`: what each compute
warpgroup's threads may use of the 168 a thread the kernels launch with; the memory
warpgroup keeps the rest (`backward.memory_registers`: 40 at 232, 24 at 240,
FlashAttention-3's split).

The XAttention scoring kernel (`scoring.py`): score_rows .. score_slots. Stride rows per
compute warpgroup (one wgmma's 64), stride columns per tile, the depth of one step's product
(head_dim in pieces of `score_depth`: a step loads Q_t and K_t's columns h*depth ..
(h+1)*depth), ring slots.

Former names, for one release (DeprecationWarning): `MosaicTiles(...)`, `BackwardTiles(...)`
and `ScoringTiles(...)` make the `Tiles` of their fields (`MosaicTiles` with chain=False by
default, as before; `BackwardTiles`' slots are backward_slots, `ScoringTiles`' rows, cols,
depth and slots the score_ fields), and an entry point's `backward_tiles=` merges its
backward fields into `tiles` (`takes_backward_tiles`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings

from elastic_jax.attention.common import deprecated_alias


@dataclasses.dataclass(frozen=True)
class Tiles:
  """The tiles and schedules of the Mosaic GPU kernels (the module docstring's three groups):
  the forward's, the dQ and dK/dV kernels' and the XAttention scoring kernel's fields."""
  # The forward kernel
  block_q: int = 64
  block_kv: int = 128
  slots: int = 2
  overlap: bool = False
  persistent: int = 0
  multicast: bool = False
  q_registers: bool = False
  trace: str = ""
  chain: bool = True
  # The dQ and dK/dV kernels
  dq_block_q: int = 64
  dq_block_kv: int = 64
  dkv_block_k: int = 64
  dkv_block_q: int = 64
  backward_slots: int = 2
  registers: int = 232
  # The XAttention scoring kernel
  score_rows: int = 64
  score_cols: int = 256
  score_depth: int = 64
  score_slots: int = 3


DEFAULT_TILES = Tiles()

# The fields of the dQ and dK/dV kernels (what `backward_tiles=` once set apart).
BACKWARD_FIELDS = ("dq_block_q", "dq_block_kv", "dkv_block_k", "dkv_block_q", "backward_slots",
                   "registers")


def with_backward(tiles: Tiles, backward: Tiles) -> Tiles:
  """`tiles` with the dQ and dK/dV kernels' fields of `backward`."""
  return dataclasses.replace(tiles, **{f: getattr(backward, f) for f in BACKWARD_FIELDS})


def takes_backward_tiles(positional: bool = False):
  """A decorator for an entry point that takes `tiles=` and once took the dQ and dK/dV
  kernels' tiles apart, as `backward_tiles=` (with `positional`, also as the positional
  argument after its last one): that still works, with a DeprecationWarning naming the
  `tiles=` it makes: the given (or default) tiles with backward_tiles' backward fields."""
  def wrap(fn):
    params = inspect.signature(fn).parameters
    names = [p.name for p in params.values() if p.kind == p.POSITIONAL_OR_KEYWORD]
    at = names.index("tiles") if "tiles" in names else None
    default = params["tiles"].default
    default = DEFAULT_TILES if default is inspect.Parameter.empty else default

    @functools.wraps(fn)
    def call(*args, **kwargs):
      if positional and len(args) == len(names) + 1 and "backward_tiles" not in kwargs:
        *args, kwargs["backward_tiles"] = args
      if "backward_tiles" not in kwargs:
        return fn(*args, **kwargs)
      backward = kwargs.pop("backward_tiles")
      args = list(args)
      if at is not None and len(args) > at:
        tiles = args[at] = with_backward(args[at], backward)
      else:
        tiles = kwargs["tiles"] = with_backward(kwargs.get("tiles", default), backward)
      warnings.warn(f"{fn.__name__}(..., backward_tiles=...) is deprecated; the one Tiles "
                    f"holds the backward kernels' fields: use {fn.__name__}(..., "
                    f"tiles={tiles!r})", DeprecationWarning, stacklevel=2)
      return fn(*args, **kwargs)

    return call

  return wrap


def _mosaic_tiles(block_q: int = 64, block_kv: int = 128, slots: int = 2, overlap: bool = False,
                  persistent: int = 0, multicast: bool = False, q_registers: bool = False,
                  trace: str = "", chain: bool = False) -> Tiles:
  return Tiles(block_q=block_q, block_kv=block_kv, slots=slots, overlap=overlap,
               persistent=persistent, multicast=multicast, q_registers=q_registers,
               trace=trace, chain=chain)


def _backward_tiles(dq_block_q: int = 64, dq_block_kv: int = 64, dkv_block_k: int = 64,
                    dkv_block_q: int = 64, slots: int = 2, registers: int = 232) -> Tiles:
  return Tiles(dq_block_q=dq_block_q, dq_block_kv=dq_block_kv, dkv_block_k=dkv_block_k,
               dkv_block_q=dkv_block_q, backward_slots=slots, registers=registers)


def _scoring_tiles(rows: int = 64, cols: int = 256, depth: int = 64, slots: int = 3) -> Tiles:
  return Tiles(score_rows=rows, score_cols=cols, score_depth=depth, score_slots=slots)


# The former classes, now constructors of the one `Tiles` (deprecated).
MosaicTiles = deprecated_alias(
    "mosaic_gpu.MosaicTiles(...)",
    "mosaic_gpu.Tiles(..., chain=False) (the forward's fields; MosaicTiles() is "
    "Tiles(chain=False))", _mosaic_tiles)
BackwardTiles = deprecated_alias(
    "mosaic_gpu.BackwardTiles(..., slots, registers)",
    "mosaic_gpu.Tiles(..., backward_slots=slots, registers=registers)", _backward_tiles)
ScoringTiles = deprecated_alias(
    "mosaic_gpu.ScoringTiles(rows, cols, depth, slots)",
    "mosaic_gpu.Tiles(score_rows=rows, score_cols=cols, score_depth=depth, score_slots=slots)",
    _scoring_tiles)
