"""Files written safely: atomic directories and texts, outputs kept apart from inputs, a
directory lock, stale temporary folders cleaned, torn JSONL tails repaired; UTF-8 lines."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import uuid
from typing import Callable, Iterable, Iterator

from elastic_jax.errors import ElasticJaxError


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


# Why a write failed that is about the place written to, not about the program: a full disk, a
# read-only or forbidden folder. Such failures are said in one sentence naming the path.
WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG,
                errno.EIO)
# The same, as libraries that wrap the system's error in their own exception word them
# (tensorstore under orbax: "... No space left on device [os_error_code='28']").
WRITE_FAILURES = tuple(os.strerror(e) for e in WRITE_ERRNOS)


def write_failure(exc: BaseException) -> tuple[str, str | None] | None:
  """(reason, path or None) when `exc`, or an exception it was raised from, is a write that the
  place refused (`WRITE_ERRNOS`: a full disk, a read-only or forbidden folder); else None."""
  seen = set()
  e: BaseException | None = exc
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, OSError) and e.errno in WRITE_ERRNOS:
      path = e.filename if isinstance(e.filename, (str, bytes, os.PathLike)) else None
      return os.strerror(e.errno), None if path is None else os.fsdecode(path)
    if not isinstance(e, OSError):
      text = str(e)
      for reason in WRITE_FAILURES:
        if reason in text:
          return reason, None
    e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
  return None


def write_error(path: str | os.PathLike, exc: BaseException, note: str = "",
                inside: str | None = None) -> ElasticJaxError | None:
  """The one-sentence error for a write to `path` that failed with `exc` when the place refused
  it (`write_failure`), else None (the exception is the program's, not the place's, or already
  one sentence, or an interruption). `inside`: where the writer wrote (a temporary folder or
  file); a refusal that names a file elsewhere (an input that could not be read) names it."""
  if not isinstance(exc, Exception) or isinstance(exc, ElasticJaxError):
    return None
  found = write_failure(exc)
  if found is None:
    return None
  reason, where = found
  mine = [os.path.abspath(os.fspath(path))] + ([os.path.abspath(inside)] if inside else [])
  if where is not None and not any(os.path.abspath(where) == m or os.path.abspath(
      where).startswith(m.rstrip(os.sep) + os.sep) for m in mine):
    return ElasticJaxError(f"{where}: {reason}; {os.fspath(path)} was not written")
  return ElasticJaxError(f"{os.fspath(path)}: could not be written ({reason}){note}")


def _real(path: str | os.PathLike) -> str:
  return os.path.realpath(os.path.abspath(os.fspath(path)))


def check_apart(out: str | os.PathLike, protected: Iterable[str | os.PathLike | None],
                what: str = "the input") -> None:
  """Refuses an output directory that is, contains or lies inside a protected one (paths
  resolved, symlinks followed): replacing it could delete the input."""
  o = _real(out)
  for p in protected:
    if p is None:
      continue
    q = _real(p)
    if o == q:
      rel = "is"
    elif q.startswith(o.rstrip(os.sep) + os.sep):
      rel = "contains"
    elif o.startswith(q.rstrip(os.sep) + os.sep):
      rel = "lies inside"
    else:
      continue
    raise ElasticJaxError(f"{os.fspath(out)}: the output {rel} {what} ({os.fspath(p)}); "
                          "choose an output directory apart from it")


def check_creatable(path: str | os.PathLike, what: str) -> None:
  """Refuses a directory path that exists as a file, or whose nearest existing ancestor is a
  file or not writable: found before any work is done, without creating anything."""
  path = os.path.abspath(os.fspath(path))
  if os.path.exists(path):
    if not os.path.isdir(path):
      raise ElasticJaxError(f"{what} '{path}': is a file, not a directory")
    if not os.access(path, os.W_OK):
      raise ElasticJaxError(f"{what} '{path}': is not writable")
    return
  parent = os.path.dirname(path)
  while not os.path.exists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    raise ElasticJaxError(f"{what} '{path}': cannot be created ({parent} is a file)")
  if not os.access(parent, os.W_OK):
    raise ElasticJaxError(f"{what} '{path}': cannot be created ({parent} is not writable)")


_PARTIAL = ".partial-"


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def _clean_stale_partials(parent: str, name: str) -> list[str]:
  """Removes `.NAME.partial-*` folders of `name` left by runs that died (their process is
  gone, or an older layout without a process id); returns what it removed."""
  removed = []
  prefix = f".{name}{_PARTIAL}"
  try:
    entries = os.listdir(parent)
  except OSError:
    return removed
  for entry in entries:
    if not entry.startswith(prefix):
      continue
    rest = entry[len(prefix):].removesuffix(".old")
    pid = rest.split("-", 1)[0]
    if pid.isdigit() and "-" in rest and _pid_alive(int(pid)):
      continue                                   # another live run is writing it
    path = os.path.join(parent, entry)
    if os.path.isdir(path) and not os.path.islink(path):
      shutil.rmtree(path, ignore_errors=True)
    else:
      with contextlib.suppress(OSError):
        os.remove(path)
    removed.append(path)
  return removed


def _remove(path: str) -> None:
  if os.path.isdir(path) and not os.path.islink(path):
    shutil.rmtree(path, ignore_errors=True)
  else:
    with contextlib.suppress(OSError):
      os.remove(path)


@contextlib.contextmanager
def atomic_directory(target: str, overwrite: bool = False,
                     protect: Iterable[str | os.PathLike | None] = ()) -> Iterator[str]:
  """Yields a fresh temporary directory beside `target`; renames it to `target` on success.

  On any failure (an exception, Ctrl-C, SIGTERM turned into SystemExit) the temporary
  directory is removed and `target` is left as it was: a reader never sees a half-written
  output. With `overwrite`, an existing `target` (directory or file) is replaced only after
  the new one is whole. `protect`: inputs the target must neither be, contain nor lie inside
  (`check_apart`). Temporary folders of the same target that a killed run left behind are
  removed first.
  """
  target = os.path.abspath(target)
  check_apart(target, protect)
  if os.path.exists(target) and not overwrite:
    raise ElasticJaxError(f"{target}: already exists (pass --overwrite to replace it)")
  parent = os.path.dirname(target)
  try:
    os.makedirs(parent, exist_ok=True)
  except OSError as e:
    raise ElasticJaxError(f"{parent}: cannot create the output's folder "
                          f"({e.strerror or e})") from None
  _clean_stale_partials(parent, os.path.basename(target))
  tmp = os.path.join(parent, f".{os.path.basename(target)}{_PARTIAL}{os.getpid()}-"
                             f"{uuid.uuid4().hex[:8]}")
  try:
    os.makedirs(tmp)
  except OSError as e:
    raise ElasticJaxError(f"{parent}: cannot write there ({e.strerror or e})") from None
  existed = os.path.lexists(target)
  try:
    yield tmp
    if os.path.lexists(target):
      old = tmp + ".old"
      os.replace(target, old)
      os.replace(tmp, target)
      _remove(old)
    else:
      os.replace(tmp, target)
  except BaseException as e:
    shutil.rmtree(tmp, ignore_errors=True)
    error = write_error(target, e, "; the one there before is kept" if existed else
                        "; nothing was left there", inside=tmp)
    if error is not None:
      raise error from None
    raise


@contextlib.contextmanager
def atomic_file(path: str) -> Iterator[str]:
  """Yields a temporary path beside `path` to write a file to; renames it over `path` once the
  block ends (keeping its suffix, so writers that go by it, like matplotlib, still do). On
  failure the temporary file is removed and `path` is left as it was. The one atomic file
  writer of the package."""
  root, ext = os.path.splitext(path)
  tmp = f"{root}.partial-{uuid.uuid4().hex[:8]}{ext}"
  existed = os.path.lexists(path)
  try:
    yield tmp
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
  except BaseException as e:
    with contextlib.suppress(OSError):
      os.remove(tmp)
    error = write_error(path, e, "; the one there before is kept" if existed else "",
                        inside=tmp)
    if error is not None:
      raise error from None
    raise


def atomic_write_text(path: str, text: str) -> None:
  """Writes `text` (UTF-8) to `path` whole or not at all, flushed to disk (`atomic_file`)."""
  with atomic_file(path) as tmp:
    with open(tmp, "w", encoding="utf-8") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())


def append_whole(f, data: bytes) -> None:
  """Appends `data` (one JSONL line) to `f`, a file opened with open(path, "ab", buffering=0),
  whole or not at all: a write that fails part way (a full disk) is cut back off the file."""
  start = f.seek(0, os.SEEK_END)
  try:
    while data:
      data = data[f.write(data):]
  except OSError:
    with contextlib.suppress(OSError):
      f.truncate(start)          # else the next append drops the torn line (repair_jsonl_tail)
    raise


def repair_jsonl_tail(path: str) -> bool:
  """Drops a torn last line (a run killed while writing it) from a JSONL file that is
  appended to, so that the next append starts on a fresh line; True if it changed the file.
  A complete last line that only lacks its newline gets one."""
  import json
  if not os.path.isfile(path):
    return False
  with open(path, "rb+") as f:
    f.seek(0, os.SEEK_END)
    size = f.tell()
    if size == 0:
      return False
    f.seek(max(0, size - 1))
    if f.read(1) == b"\n":
      return False
    # Find the start of the last line.
    pos, chunk = size, 1 << 16
    start = 0
    while pos > 0:
      read = min(chunk, pos)
      f.seek(pos - read)
      block = f.read(read)
      i = block.rfind(b"\n")
      if i >= 0:
        start = pos - read + i + 1
        break
      pos -= read
    f.seek(start)
    last = f.read()
    try:
      json.loads(last.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
      f.truncate(start)
      return True
    f.write(b"\n")
    return True


class DirectoryLock:
  """An exclusive lock on a directory, held by a live process (`flock` on DIR/.lock).

  A second holder is refused with one sentence naming the first (its pid and start time). A
  lock left by a process that died is free again (the kernel drops it with the process), so
  the next run takes it over and says so through `taken_over`. A directory the lock created
  and that holds nothing else when it is released is removed again.
  """

  def __init__(self, directory: str, what: str = "run directory"):
    self.directory, self.what = directory, what
    self.path = os.path.join(directory, ".lock")
    self.taken_over: str | None = None
    self._file = None

  def __enter__(self) -> "DirectoryLock":
    import fcntl
    import json
    import time
    self._created = not os.path.isdir(self.directory)
    try:
      os.makedirs(self.directory, exist_ok=True)
      f = open(self.path, "a+")
    except OSError as e:
      raise ElasticJaxError(f"{self.directory}: cannot create the {self.what} "
                            f"({e.strerror or e})") from None
    f.seek(0)
    before = f.read().strip()
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      f.close()
      holder = "another process"
      with contextlib.suppress(ValueError, TypeError):
        info = json.loads(before)
        holder = f"process {info['pid']} (started {info['started']})"
      raise ElasticJaxError(f"{self.directory}: this {self.what} is in use by {holder}; wait "
                            f"for it to finish or choose another one") from None
    if before:
      with contextlib.suppress(ValueError, TypeError, KeyError):
        info = json.loads(before)
        if info.get("pid") != os.getpid():
          self.taken_over = f"process {info['pid']} (started {info['started']})"
    f.seek(0)
    f.truncate()
    f.write(json.dumps({"pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}))
    f.flush()
    self._file = f
    return self

  def __exit__(self, *exc) -> None:
    if self._file is not None:
      with contextlib.suppress(OSError):
        self._file.seek(0)
        self._file.truncate()
      empty = False
      with contextlib.suppress(OSError):
        if self._created and os.listdir(self.directory) == [".lock"]:
          os.remove(self.path)    # while still held: no other process can hold this file
          empty = True
      self._file.close()          # releases the lock
      self._file = None
      if empty:
        with contextlib.suppress(OSError):
          os.rmdir(self.directory)
