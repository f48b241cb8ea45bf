"""The five task types of the method (docs/method.md §7): our ids, the authors' names, and a
lookup that takes either."""

from __future__ import annotations

from elastic_jax.errors import ElasticJaxError

# Our ids, in the order of the multiplier vectors.
TASK_TYPES = ("single_qa", "multihop_qa", "summarization", "code", "icl")
# The authors' names (their data's metadata and checkpoints), in the same order.
AUTHORS_TASKS = ("Single QA", "MultiHop QA", "Summarization", "Code", "In-Context Learning")
TASK_IDS = {name.lower(): i for names in (AUTHORS_TASKS, TASK_TYPES)
            for i, name in enumerate(names)}
KNOWN_TASKS = f"{', '.join(AUTHORS_TASKS)}, or {', '.join(TASK_TYPES)}"


def task_id(name: str) -> int:
  """Index into TASK_TYPES of an authors' task name or one of our ids (case-insensitive)."""
  try:
    return TASK_IDS[name.strip().lower()]
  except KeyError:
    raise ElasticJaxError(f"task '{name}' is unknown (known: {KNOWN_TASKS})") from None
