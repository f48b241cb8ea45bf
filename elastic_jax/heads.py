"""How heads attend: one vocabulary for the model, the Python API, generation, evaluation and
the command lines (`attention=`, `--attention`).

  full     every head full causal attention (the unmodified backbone)
  elastic  the routers choose full or sparse per (input, layer, KV head), once, at prefill
  forced   a given choice of heads (gates [L, B, K] or [L, K], 1 = full)
  sparse   every head on the sparse side of the pattern pair (streaming for fa-ssa)
  most-chosen
           one fixed head set for every input: the heads elastic chose most often, at its
           average MSR (evaluation's baseline; it runs as `forced` with those gates). Its
           old name `static` still works, with a DeprecationWarning: "static" now names only
           what is input-independent in general, e.g. a static router (`router.static`), an
           input-independent gate trained by the same objective.

Not to be confused with the pattern pair (`patterns`: fa-ssa, fa-xa, xa-ssa), which says what
a head routed full or sparse runs.
"""

from __future__ import annotations

import warnings
from typing import Literal

from elastic_jax.errors import ElasticJaxError

Attention = Literal["full", "elastic", "forced", "sparse", "most-chosen"]
ATTENTION: tuple[str, ...] = ("full", "elastic", "forced", "sparse", "most-chosen")
# What one forward pass runs: `most-chosen` is `forced` with gates derived from elastic's
# choices.
FORWARD: tuple[str, ...] = ("full", "elastic", "forced", "sparse")
# Old names, kept for one release: {old: new}.
RENAMED = {"static": "most-chosen"}


def canonical(attention: str, *, warn: bool = True) -> str:
  """The current name of a way of attending (`static` -> `most-chosen`, with a
  DeprecationWarning unless `warn` is false, e.g. when reading records written before)."""
  new = RENAMED.get(attention)
  if new is None:
    return attention
  if warn:
    warnings.warn(f"attention '{attention}' is now called '{new}'", DeprecationWarning,
                  stacklevel=3)
  return new


def check_attention(attention: str, allowed: tuple[str, ...] = ATTENTION) -> str:
  """`attention` (its current name) if it is one of `allowed`, else one sentence naming what
  is."""
  attention = canonical(attention)
  if attention not in allowed:
    raise ElasticJaxError(f"attention '{attention}' is not available here (available: "
                          f"{', '.join(allowed)})")
  return attention
