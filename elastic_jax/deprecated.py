"""Old module paths kept for one release: importing one warns (DeprecationWarning) and gives
the module that now holds its code (the same object, so attributes and patches are shared)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "elastic_jax.generate": "elastic_jax.generation.generate",
    "elastic_jax.prefill": "elastic_jax.generation.prefill",
    "elastic_jax.kv_cache": "elastic_jax.generation.kv_cache",
    "elastic_jax.aot": "elastic_jax.generation.aot",
    "elastic_jax.attention.decode": "elastic_jax.generation.decode",
    "elastic_jax.attention.mosaic_gpu_backward": "elastic_jax.attention.mosaic_gpu.backward",
    "elastic_jax.attention.mosaic_gpu_scoring": "elastic_jax.attention.mosaic_gpu.scoring",
}


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Finds the old paths in `MOVED`."""

  def find_spec(self, fullname, path=None, target=None):
    if fullname in MOVED:
      return importlib.util.spec_from_loader(fullname, self)
    return None

  def create_module(self, spec):
    new = MOVED[spec.name]
    warnings.warn(f"module {spec.name} is now {new}; the old path goes in the next release",
                  DeprecationWarning, stacklevel=2)
    return importlib.import_module(new)

  def exec_module(self, module):
    """The module is already executed under its new path."""


def install() -> None:
  if not any(isinstance(f, MovedModules) for f in sys.meta_path):
    sys.meta_path.append(MovedModules())
