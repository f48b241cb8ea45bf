"""Shared behaviour of the command-line entry points."""

from __future__ import annotations

import logging
import signal
import sys
from typing import Callable

from elastic_jax.errors import ElasticJaxError


def _sigterm_to_exit(signum, frame):  # pragma: no cover - exercised by signals
  raise SystemExit(128 + signum)


class _BackgroundFailures(logging.Filter):
  """Drops orbax's logs of a background save that failed: the checkpointer reports the same
  failure as the run's one-line error (a full disk would otherwise print pages of them)."""

  def filter(self, record: logging.LogRecord) -> bool:
    return "raised an exception" not in record.getMessage()


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
  """Runs `main`; bad input becomes one line on stderr and exit status 2.

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
