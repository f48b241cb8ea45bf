"""A synthetic two-task batch source, for smoke runs of router training with no data at all.

Each row is one input of one of two task types whose prompts differ in a way the router can
read from the keys: "code" rows draw their tokens from the lower half of the vocabulary,
"single_qa" rows from the upper half. With targets 1.0 and 0.3 a working objective must send
the two kinds of input to different sparsity. It says nothing about quality: the backbone is
random. Real data pipelines come with train.py's configs.
"""

from __future__ import annotations

import numpy as np

from elastic_jax.tasks import TASK_TYPES

TASKS = (TASK_TYPES.index("code"), TASK_TYPES.index("single_qa"))


def synthetic_batch(step: int, batch: int, length: int, vocab: int, prompt_frac: float = 0.75,
                    max_segments: int = 2, seed: int = 0) -> dict[str, np.ndarray]:
  """One batch (see train/step.py for the fields); deterministic in (seed, step)."""
  rng = np.random.default_rng([seed, step])
  half = vocab // 2
  prompt = max(1, int(prompt_frac * length))
  ids = np.empty((batch, length), np.int32)
  task = np.full((batch, max_segments), -1, np.int32)
  for i in range(batch):
    kind = (i + step) % 2
    ids[i] = rng.integers(kind * half, (kind + 1) * half, length)
    task[i, 1] = TASKS[kind]
  ar = np.broadcast_to(np.arange(length, dtype=np.int32), (batch, length))
  return {"input_ids": ids, "targets": np.roll(ids, -1, axis=1),
          "loss_mask": ar >= prompt, "segment_ids": np.ones((batch, length), np.int32),
          "positions": np.array(ar), "prompt_mask": ar < prompt, "task_ids": task}
