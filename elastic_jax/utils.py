"""Small shared helpers: progress reporting and atomic directory writes."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import uuid
from typing import Iterable, Iterator, TypeVar

from elastic_jax.errors import ElasticJaxError

T = TypeVar("T")


def progress(items: Iterable[T], desc: str, unit: str = "it", enabled: bool = True
             ) -> Iterable[T]:
  """A tqdm bar (count, rate, ETA) on stderr, or the bare iterable when disabled."""
  if not enabled:
    return items
  from tqdm.auto import tqdm
  return tqdm(items, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True)


@contextlib.contextmanager
def atomic_directory(target: str, overwrite: bool = False) -> Iterator[str]:
  """Yields a fresh temporary directory beside `target`; renames it to `target` on success.

  On any failure (an exception, Ctrl-C, SIGTERM turned into SystemExit) the temporary
  directory is removed and `target` is left as it was: a reader never sees a half-written
  output. With `overwrite`, an existing `target` is replaced only after the new one is whole.
  """
  target = os.path.abspath(target)
  if os.path.exists(target) and not overwrite:
    raise ElasticJaxError(f"{target}: already exists (pass --overwrite to replace it)")
  parent = os.path.dirname(target)
  os.makedirs(parent, exist_ok=True)
  tmp = os.path.join(parent, f".{os.path.basename(target)}.partial-{uuid.uuid4().hex[:8]}")
  os.makedirs(tmp)
  try:
    yield tmp
    if os.path.exists(target):
      old = tmp + ".old"
      os.replace(target, old)
      os.replace(tmp, target)
      shutil.rmtree(old, ignore_errors=True)
    else:
      os.replace(tmp, target)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
