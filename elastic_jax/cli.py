"""Shared behaviour of the command-line entry points."""

from __future__ import annotations

import signal
import sys
from typing import Callable

from elastic_jax.errors import ElasticJaxError


def _sigterm_to_exit(signum, frame):  # pragma: no cover - exercised by signals
  raise SystemExit(128 + signum)


def run_cli(main: Callable[[], int]) -> int:
  """Runs `main`; bad input becomes one line on stderr and exit status 2.

  SIGTERM is turned into SystemExit so that `finally` blocks (atomic writes) clean up.
  """
  signal.signal(signal.SIGTERM, _sigterm_to_exit)
  try:
    return main()
  except ElasticJaxError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    return 130
