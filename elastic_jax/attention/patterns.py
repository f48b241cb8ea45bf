"""The patterns a KV head attends with, from the router's decision to the kernels' modes.

A router decides, per request and KV head, a gate r in [0, 1]; a *pattern pair* (the
`patterns` setting, e.g. "fa-ssa") says what r = 1 and r = 0 run (`split_patterns`):

  Pattern.FULL    full causal attention (FA);
  Pattern.STREAM  streaming attention: sink + local window (SSA, `reference.Streaming`);
  Pattern.XA      XAttention's block-sparse attention (`xattention.py`).

The kernels read each (row, KV head)'s gate at run time as a `Mode`: the pair's dense pattern
(r = 1), its sparse one (r = 0), or both mixed by a fractional gate (training).
"""

from __future__ import annotations

import enum


class Pattern(enum.StrEnum):
  """How one KV head attends (equal to its name as a string)."""
  FULL = "full"
  STREAM = "stream"
  XA = "xa"


class Mode(enum.IntEnum):
  """A KV head's gate as the kernels read it (an int32 per row and KV head)."""
  SPARSE = 0    # r = 0: the pair's second pattern
  FULL = 1      # r = 1: the pair's first pattern
  MIX = 2       # 0 < r < 1: both, mixed by the gate


# The pattern pairs: (pattern of heads routed r = 1, of heads routed r = 0), docs/method.md §3.
PAIRS: dict[str, tuple[Pattern, Pattern]] = {
    "fa-ssa": (Pattern.FULL, Pattern.STREAM),
    "fa-xa": (Pattern.FULL, Pattern.XA),
    "xa-ssa": (Pattern.XA, Pattern.STREAM),
}
PATTERN_PAIRS = tuple(PAIRS)


def split_patterns(patterns: str) -> tuple[Pattern, Pattern]:
  """(pattern of heads with r = 1, pattern of heads with r = 0) of a pattern pair:
  "fa-ssa" -> (FULL, STREAM), "fa-xa" -> (FULL, XA), "xa-ssa" -> (XA, STREAM)."""
  if patterns not in PAIRS:
    raise ValueError(f"patterns '{patterns}' is not one of {', '.join(PATTERN_PAIRS)}")
  return PAIRS[patterns]
