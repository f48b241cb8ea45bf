"""Small shared helpers: progress reporting and atomic writes."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import uuid
from typing import Callable, Iterable, Iterator, TypeVar

from elastic_jax.errors import ElasticJaxError

T = TypeVar("T")


def progress(items: Iterable[T], desc: str, unit: str = "it", enabled: bool = True
             ) -> Iterable[T]:
  """A tqdm bar (count, rate, ETA) on stderr, or the bare iterable when disabled."""
  if not enabled:
    return items
  from tqdm.auto import tqdm
  return tqdm(items, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True)


def text_lines(path: str, where: Callable[[int], str]) -> Iterator[tuple[int, str]]:
  """(line number, text) of the non-blank lines of a UTF-8 file (JSONL); a line that is not
  UTF-8 raises ElasticJaxError starting with `where(line number)`."""
  with open(path, "rb") as f:
    for line_no, raw in enumerate(f, start=1):
      try:
        text = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise ElasticJaxError(f"{where(line_no)}: the line is not valid UTF-8 (byte "
                              f"{e.start + 1})") from None
      if text.strip():
        yield line_no, text


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


def atomic_write_text(path: str, text: str) -> None:
  """Writes `text` (UTF-8) to `path` whole or not at all (a temporary file, then a rename)."""
  tmp = f"{path}.partial-{uuid.uuid4().hex[:8]}"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(text)
  os.replace(tmp, path)
