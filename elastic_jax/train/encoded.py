"""Tokenized records, the form both data readers produce (train/data.py for JSONL,
train/authors_data.py for the authors' parquet files) and the batcher packs."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Encoded:
  """Kept records as one flat token array. tokens[starts[i]:starts[i + 1]] is record i."""
  tokens: np.ndarray              # [total] int32
  starts: np.ndarray              # [N + 1] int64
  prompt_len: np.ndarray          # [N] int32
  task_ids: np.ndarray            # [N] int32
  targets: np.ndarray | None = None  # [total] bool, tokens the loss predicts; None: every
                                     # token after the prompt (the answer and its EOS)

  @property
  def lengths(self) -> np.ndarray:
    return np.diff(self.starts)

  def __len__(self) -> int:
    return len(self.prompt_len)
