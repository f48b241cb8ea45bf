"""The min-max objective (docs/method.md §7).

    L = CE(answer tokens)
        + mean over task types present in the batch of
            mean over that type's samples of  l1[task] |MSR - t| + l2[task] (MSR - t)^2

minimised over the router parameters and maximised over the multipliers l1, l2 (one pair per
task type). A "sample" is one packed segment; its MSR is computed from the straight-through
gates, so the penalty's gradient reaches the routers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# The authors' task types, in the order of their multiplier vectors.
TASK_TYPES = ("single_qa", "multihop_qa", "summarization", "code", "icl")
# Targets: sparsity-robust types 1.0, sensitive ones 0.7 (paper; docs/method.md §7).
DEFAULT_TARGETS = (0.7, 0.7, 1.0, 1.0, 1.0)


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
  targets: tuple[float, ...] = DEFAULT_TARGETS   # target MSR per task type
  linear_term: str = "abs"        # abs: l1 |MSR - t| (the authors' code); signed: l1 (MSR - t)
                                  # (the paper's eq. 8)

  def __post_init__(self):
    if self.linear_term not in ("abs", "signed"):
      raise ValueError(f"objective linear_term '{self.linear_term}' is unknown (abs, signed)")
    if len(self.targets) != len(TASK_TYPES):
      raise ValueError(f"targets needs {len(TASK_TYPES)} values, one per task type "
                       f"{TASK_TYPES}, got {len(self.targets)}")
    if not all(0.0 <= t <= 1.0 for t in self.targets):
      raise ValueError(f"targets must lie in [0, 1], got {self.targets}")


def init_lambdas(key: jax.Array) -> dict:
  """l1, l2 per task type, U[0, 0.5)."""
  k1, k2 = jax.random.split(key)
  n = len(TASK_TYPES)
  return {"l1": jax.random.uniform(k1, (n,), maxval=0.5),
          "l2": jax.random.uniform(k2, (n,), maxval=0.5)}


def answer_cross_entropy(logits_btv, targets_bt, loss_mask_bt):
  """Mean token cross-entropy over the positions with loss_mask (answer tokens). The plain
  form; the train step uses `chunked_answer_cross_entropy`."""
  logz = jax.nn.logsumexp(logits_btv, axis=-1)
  picked = jnp.take_along_axis(logits_btv, targets_bt[..., None], axis=-1)[..., 0]
  mask = loss_mask_bt.astype(jnp.float32)
  return jnp.sum((logz - picked) * mask) / jnp.maximum(mask.sum(), 1.0)


def chunked_answer_cross_entropy(x_bte, head_ev, targets_bt, loss_mask_bt, chunk: int = 1024):
  """`answer_cross_entropy` of the logits x @ head, without the [B, T, V] logits tensor.

  Tokens are taken `chunk` at a time (a scan; each chunk's logits are recomputed in the
  backward pass), and a chunk with no loss position is skipped: at 64K tokens and a 128K
  vocabulary the full float32 logits would take 32 GiB, while answers are a small share of
  the tokens.
  """
  b, t, e = x_bte.shape
  c = min(chunk, t)
  pad = -t % c
  if pad:
    x_bte = jnp.pad(x_bte, ((0, 0), (0, pad), (0, 0)))
    targets_bt = jnp.pad(targets_bt, ((0, 0), (0, pad)))
    loss_mask_bt = jnp.pad(loss_mask_bt, ((0, 0), (0, pad)))
  n = (t + pad) // c
  split = lambda a: jnp.moveaxis(a.reshape((b, n, c) + a.shape[2:]), 1, 0)
  mask = loss_mask_bt.astype(jnp.float32)

  @jax.checkpoint
  def chunk_loss(x_bce, tgt_bc, m_bc):
    logits = jnp.einsum("bce,ev->bcv", x_bce, head_ev,
                        preferred_element_type=jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, tgt_bc[..., None], axis=-1)[..., 0]
    return jnp.sum((logz - picked) * m_bc)

  def body(total, xs):
    x_bce, tgt_bc, m_bc = xs
    part = jax.lax.cond(jnp.any(m_bc > 0), chunk_loss, lambda *_: jnp.zeros((), jnp.float32),
                        x_bce, tgt_bc, m_bc)
    return total + part, None

  total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32),
                          (split(x_bte), split(targets_bt), split(mask)))
  return total / jnp.maximum(mask.sum(), 1.0)


def sparsity_penalty(msr_bs, task_bs, lambdas, ocfg: ObjectiveConfig):
  """Per-task Lagrangian term, averaged over samples of a task, then over tasks present.

  msr_bs: [B, S] MSR per sample; task_bs: [B, S] task index, -1 for an empty slot.
  Returns (penalty, per-task mean MSR [n_tasks] (NaN where absent), per-task sample counts).
  """
  n = len(TASK_TYPES)
  onehot = jax.nn.one_hot(task_bs, n, dtype=jnp.float32)            # -1 -> all zeros
  count = onehot.sum((0, 1))
  present = count > 0
  t = jnp.asarray(ocfg.targets, jnp.float32)[None, None]
  dev_bsn = msr_bs[..., None] - t                                    # [B, S, n]
  linear = jnp.abs(dev_bsn) if ocfg.linear_term == "abs" else dev_bsn
  per_sample = (lambdas["l1"][None, None] * linear
                + lambdas["l2"][None, None] * dev_bsn ** 2)
  per_task = (per_sample * onehot).sum((0, 1)) / jnp.maximum(count, 1.0)
  penalty = jnp.sum(jnp.where(present, per_task, 0.0)) / jnp.maximum(present.sum(), 1)
  msr_task = jnp.where(present, (msr_bs[..., None] * onehot).sum((0, 1))
                       / jnp.maximum(count, 1.0), jnp.nan)
  return penalty, msr_task, count
