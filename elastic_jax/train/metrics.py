"""What a training run reports: progress lines for people, metrics.jsonl (and TensorBoard)
for tools."""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

import jax
import numpy as np

from elastic_jax.errors import ElasticJaxError
from elastic_jax.files import append_whole, repair_jsonl_tail, write_error
from elastic_jax.tasks import TASK_TYPES
from elastic_jax.train.run_config import RunConfig


def say(msg: str) -> None:
  """Progress for people: printed by the first process only."""
  if jax.process_index() == 0:
    print(msg, flush=True)



class Metrics:
  """metrics.jsonl (appended, one object per logged step) and TensorBoard when asked."""

  def __init__(self, cfg: RunConfig):
    self.jsonl = self.tb = None
    if jax.process_index() != 0:
      return
    self.path = os.path.join(cfg.log_dir, "metrics.jsonl")
    try:
      os.makedirs(cfg.log_dir, exist_ok=True)
      if cfg.log.jsonl:
        repair_jsonl_tail(self.path)       # a line a killed run left half-written
        self.jsonl = open(self.path, "ab", buffering=0)
    except OSError as e:
      raise ElasticJaxError(f"log.dir '{cfg.log_dir}': cannot be created or written there "
                            f"({e.strerror or e})") from None
    if cfg.log.tensorboard:
      try:
        from tensorboardX import SummaryWriter
      except ImportError:
        raise ElasticJaxError("log.tensorboard needs tensorboardX: pip install "
                              "'elastic-jax[tensorboard]', or set log.tensorboard=false"
                              ) from None
      self.tb = SummaryWriter(os.path.join(cfg.log_dir, "tensorboard"))

  def write(self, record: dict[str, Any]) -> None:
    if self.jsonl:
      try:
        append_whole(self.jsonl, (json.dumps(record) + "\n").encode("utf-8"))
      except OSError as e:
        error = write_error(self.path, e, "; checkpoints written before are kept")
        if error is None:
          raise
        raise error from None
    if self.tb:
      for k, v in _flatten(record).items():
        if k != "step" and isinstance(v, (int, float)):
          self.tb.add_scalar(k, v, record["step"])

  def close(self) -> None:
    for f in (self.jsonl, self.tb):
      if f is not None:
        with contextlib.suppress(OSError):    # a full disk is said where the write failed
          f.close()
    self.jsonl = self.tb = None


def _flatten(d: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flatten(v, f"{prefix}{k}/"))
    else:
      out[f"{prefix}{k}"] = v
  return out


def step_record(step: int, m: dict, tokens_per_s: float | None, eta_s: float | None) -> dict:
  """One metrics record from a train step's (host) metrics; rates are None until a step after
  the compiling one has been timed. Per-task values are keyed by task type (TASK_TYPES)."""
  count = np.asarray(m["task_count"])
  seen = [t for t in range(len(TASK_TYPES)) if count[t] > 0]
  return {
      "step": step, "loss": float(m["loss"]), "lm_loss": float(m["lm_loss"]),
      "penalty": float(m["penalty"]), "msr": float(m["msr"]), "tau": float(m["tau"]),
      "lr": float(m["lr"]),
      "router_grad_norm_per_layer": [float(x) for x in np.asarray(
          m["router_grad_norm_per_layer"])],
      "router_saturated_per_layer": [round(float(x), 4) for x in np.asarray(
          m["router_saturated_per_layer"])],
      "msr_task": {TASK_TYPES[t]: float(m["msr_task"][t]) for t in seen},
      "lambda1": {TASK_TYPES[t]: float(m["lambda1"][t]) for t in seen},
      "lambda2": {TASK_TYPES[t]: float(m["lambda2"][t]) for t in seen},
      "tokens_per_s": tokens_per_s, "eta_s": eta_s}


def progress_line(r: dict, steps: int, names: dict[str, str] | None = None) -> str:
  """One line for people: loss, MSR per task (named as the data names them, e.g. the
  mixture's kv / hop / ..., else by task type), temperature, the l1 multipliers per task,
  learning rate, the largest per-layer router gradient norm, rate and ETA."""
  names = names or {}
  label = lambda k: names.get(k, k)
  tasks = " ".join(f"{label(k)} {v:.2f}" for k, v in r["msr_task"].items())
  lam = " ".join(f"{label(k)} {v:.3f}" for k, v in r["lambda1"].items())
  grad = max(r["router_grad_norm_per_layer"], default=0.0)
  rate, eta = r["tokens_per_s"], r["eta_s"]
  eta = "?" if eta is None else time.strftime("%H:%M:%S", time.gmtime(eta))
  rate = "?" if rate is None else f"{rate:,.0f}"
  return (f"step {r['step']:5d}/{steps}  loss {r['loss']:.4f}  lm {r['lm_loss']:.4f}  "
          f"msr {r['msr']:.2f} [{tasks}]  tau {r['tau']:.2f}  l1 [{lam}]  lr {r['lr']:.2e}  "
          f"grad {grad:.2e}  {rate} tok/s  eta {eta}")


