"""Ahead-of-time compilation kept per argument shapes: timed calls then run the executables
alone (reported times exclude compilation), and each executable's memory footprint is known
from XLA's buffer assignment before it runs."""

from __future__ import annotations

import time

import jax

_EXECUTABLES: dict = {}
_FOOTPRINTS: dict = {}         # id of an executable kept in _EXECUTABLES -> its footprint


def compiled(fn, args: tuple, static: dict, before=None):
  """`fn` (a jitted function) lowered and compiled for these arguments' shapes, dtypes and
  shardings and these static arguments, once per process; its memory footprint is asked of
  XLA then too. Returns (executable, seconds spent compiling now: 0 when it was already
  compiled). before: called first when a compilation is due (e.g. to let the device finish
  its queue, so that a timed span can leave the compilation out exactly)."""
  leaves, tree = jax.tree.flatten(args)
  key = (fn, tree, tuple((tuple(x.shape), str(x.dtype), getattr(x, "sharding", None))
                         for x in leaves),
         tuple(sorted(static.items())))
  if key not in _EXECUTABLES:
    if before is not None:
      before()
    start = time.perf_counter()
    _EXECUTABLES[key] = fn.lower(*args, **static).compile()
    footprint(_EXECUTABLES[key])
    return _EXECUTABLES[key], time.perf_counter() - start
  return _EXECUTABLES[key], 0.0


def tree_bytes(tree) -> int:
  """Bytes of every array in a pytree (from shapes and dtypes: donated arrays count too)."""
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def footprint(executable) -> int | None:
  """Device bytes a call of `executable` holds at its peak: arguments, outputs (less those
  that reuse a donated argument's buffer) and temporaries. None where the backend does not
  report it."""
  key = id(executable)
  if key not in _FOOTPRINTS:    # asking XLA takes milliseconds: once per executable
    m = executable.memory_analysis()
    _FOOTPRINTS[key] = None if m is None else int(
        m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
        + m.temp_size_in_bytes)
    if not any(x is executable for x in _EXECUTABLES.values()):
      return _FOOTPRINTS.pop(key)   # not kept alive here: its id could be reused
  return _FOOTPRINTS[key]
