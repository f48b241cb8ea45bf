"""Shared behaviour of the command-line entry points."""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Callable

from elastic_jax.errors import ElasticJaxError

# The installed console commands (pyproject's [project.scripts]).
CONSOLE_COMMANDS = ("elastic-jax-train", "elastic-jax-eval", "elastic-jax-convert",
                    "elastic-jax-serve")


def prog_name(default: str) -> str:
  """The command's name for its usage line: the console command it was started as
  (`elastic-jax-train`), else `default` (`train.py`, `python -m elastic_jax.convert`)."""
  invoked = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
  return invoked if invoked in CONSOLE_COMMANDS else default


def with_prog(text: str, default: str, prog: str) -> str:
  """`text` (a help page's examples) with its command lines that start with `default` starting
  with `prog` instead."""
  if prog == default:
    return text
  lines = []
  for line in text.split("\n"):
    stripped = line.lstrip()
    if stripped == default or stripped.startswith(default + " "):
      line = line[:len(line) - len(stripped)] + prog + stripped[len(default):]
    lines.append(line)
  return "\n".join(lines)


def config_file(name: str, what: str = "config file") -> str:
  """A config path as given when it exists; else the shipped config of that name (the package's
  elastic_jax.configs, the repository's configs/), for a bare name (`tiny.yaml`) and for the
  form the help pages show (`configs/tiny.yaml`), from any directory."""
  from elastic_jax.resources import CONFIGS_DIR
  if os.path.exists(name):
    return name
  norm = os.path.normpath(name)
  if not os.path.isabs(name) and os.path.dirname(norm) in ("", "configs"):
    shipped = os.path.join(CONFIGS_DIR, os.path.basename(norm))
    if os.path.isfile(shipped):
      return shipped
  raise ElasticJaxError(f"{name}: no such {what} (nor a shipped config of that name in "
                        f"{CONFIGS_DIR})")


def _sigterm_to_exit(signum, frame):  # pragma: no cover - exercised by signals
  raise SystemExit(128 + signum)


class _BackgroundFailures(logging.Filter):
  """Drops orbax's logs of a background save that failed: the checkpointer (or the atomic
  writer) reports the same failure as the run's one-line error (a full disk would otherwise
  print pages of them)."""

  def filter(self, record: logging.LogRecord) -> bool:
    text = record.getMessage()
    return "raised an exception" not in text and "background save thread" not in text


def _quiet_unraisable(previous):
  def hook(unraisable):
    # tensorstore callbacks that land after orbax closed its event loop (after a failed
    # write): noise about a failure that is reported once already.
    value = unraisable.exc_value
    if isinstance(value, RuntimeError) and str(value) == "Event loop is closed":
      return
    previous(unraisable)
  return hook


def run_cli(main: Callable[[], int]) -> int:
  """Runs `main`; bad input becomes one line on stderr and exit status 2, and so does a write
  that the place refused (a full disk, a read-only or forbidden folder: `files.write_failure`)
  wherever it happens, naming the path where it is known.

  SIGTERM is turned into SystemExit so that `finally` blocks (atomic writes) clean up.
  """
  signal.signal(signal.SIGTERM, _sigterm_to_exit)
  logging.getLogger("absl").addFilter(_BackgroundFailures())
  sys.unraisablehook = _quiet_unraisable(sys.unraisablehook)
  try:
    return main()
  except ElasticJaxError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    return 130
  except Exception as e:
    from elastic_jax.files import write_failure
    found = write_failure(e)
    if found is None:
      raise
    reason, path = found
    print(f"error: {path or 'a file'}: {reason}", file=sys.stderr)
    return 2
