"""Progress for long work: a bar with count, rate and ETA on stderr."""

from __future__ import annotations

import sys
from typing import Iterable, TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], desc: str, unit: str = "it", enabled: bool = True
             ) -> Iterable[T]:
  """A tqdm bar (count, rate, ETA) on stderr, or the bare iterable when disabled."""
  if not enabled:
    return items
  from tqdm.auto import tqdm
  return tqdm(items, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True)
