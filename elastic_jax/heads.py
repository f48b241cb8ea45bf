"""How heads attend: one vocabulary for the model, the Python API, generation, evaluation and
the command lines (`attention=`, `--attention`).

  full     every head full causal attention (the unmodified backbone)
  elastic  the routers choose full or sparse per (input, layer, KV head), once, at prefill
  forced   a given choice of heads (gates [L, B, K] or [L, K], 1 = full)
  sparse   every head on the sparse side of the pattern pair (streaming for fa-ssa)
  static   one fixed head set for every input: the heads elastic chose most often, at its
           average MSR (evaluation's baseline; it runs as `forced` with those gates)

Not to be confused with the pattern pair (`patterns`: fa-ssa, fa-xa, xa-ssa), which says what
a head routed full or sparse runs.
"""

from __future__ import annotations

from typing import Literal

from elastic_jax.errors import ElasticJaxError

Attention = Literal["full", "elastic", "forced", "sparse", "static"]
ATTENTION: tuple[str, ...] = ("full", "elastic", "forced", "sparse", "static")
# What one forward pass runs: `static` is `forced` with gates derived from elastic's choices.
FORWARD: tuple[str, ...] = ("full", "elastic", "forced", "sparse")


def check_attention(attention: str, allowed: tuple[str, ...] = ATTENTION) -> str:
  """`attention` if it is one of `allowed`, else one sentence naming what is."""
  if attention not in allowed:
    raise ElasticJaxError(f"attention '{attention}' is not available here (available: "
                          f"{', '.join(allowed)})")
  return attention
