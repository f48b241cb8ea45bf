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
import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

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

  Tokens are taken `chunk` at a time and a chunk with no loss position is skipped: at 64K
  tokens and a 128K vocabulary the full float32 logits would take 32 GiB, while answers are a
  small share of the tokens. The gradient has its own rule (`_chunked_ce_sum`): the backward
  pass walks the chunks again, recomputing each chunk's logits, and keeps nothing per chunk.
  Left to autodiff, a scan keeps the output head once per chunk for its backward pass (one
  [E, V] copy per 1,024 tokens: 31 GiB at 32K tokens for an 8B model's 128K vocabulary).
  The head's gradient is computed only when the head is differentiated (it is frozen in
  router training).
  """
  b, t, e = x_bte.shape
  c = min(chunk, t)
  pad = -t % c
  mask = loss_mask_bt.astype(jnp.float32)
  if pad:
    x_bte = jnp.pad(x_bte, ((0, 0), (0, pad), (0, 0)))
    targets_bt = jnp.pad(targets_bt, ((0, 0), (0, pad)))
    mask = jnp.pad(mask, ((0, 0), (0, pad)))
  with jax.named_scope("loss"):        # a label for profiles (benchmarks/xprof.py)
    total = _chunked_ce_sum(c, x_bte, head_ev, targets_bt, mask)
  return total / jnp.maximum(mask.sum(), 1.0)


def _chunks(c, a):
  """[B, T, ...] -> [T / c, B, c, ...]: the scan's leading axis."""
  b, t = a.shape[:2]
  return jnp.moveaxis(a.reshape((b, t // c, c) + a.shape[2:]), 1, 0)


def _chunk_logits(x_bce, head_ev):
  return jnp.einsum("bce,ev->bcv", x_bce, head_ev, preferred_element_type=jnp.float32)


def _ce_sum_fwd_only(c, x_bte, head_ev, targets_bt, mask_bt):
  def body(total, xs):
    x_bce, tgt_bc, m_bc = xs

    def part(x_bce, tgt_bc, m_bc):
      logits = _chunk_logits(x_bce, head_ev)
      logz = jax.nn.logsumexp(logits, axis=-1)
      picked = jnp.take_along_axis(logits, tgt_bc[..., None], axis=-1)[..., 0]
      return jnp.sum((logz - picked) * m_bc)

    skip = lambda *_: jnp.zeros((), jnp.float32)
    return total + jax.lax.cond(jnp.any(m_bc > 0), part, skip, x_bce, tgt_bc, m_bc), None

  total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32),
                          (_chunks(c, x_bte), _chunks(c, targets_bt), _chunks(c, mask_bt)))
  return total


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked_ce_sum(c, x_bte, head_ev, targets_bt, mask_bt):
  """Sum over positions of mask * (logsumexp(x @ head) - (x @ head)[target]), float32."""
  return _ce_sum_fwd_only(c, x_bte, head_ev, targets_bt, mask_bt)


def _chunked_ce_sum_fwd(c, x, head, targets, mask):
  total = _ce_sum_fwd_only(c, x.value, head.value, targets.value, mask.value)
  return total, (x.value, head.value, targets.value, mask.value, head.perturbed)


def _chunked_ce_sum_bwd(c, res, g):
  x_bte, head_ev, targets_bt, mask_bt, head_grad = res
  if isinstance(g, SymbolicZero):
    return None, None, None, None
  e, v = head_ev.shape

  def body(dhead, xs):
    x_bce, tgt_bc, m_bc = xs

    def part(dhead, x_bce, tgt_bc, m_bc):
      logits = _chunk_logits(x_bce, head_ev)
      # d/dlogits of mask * (logsumexp - picked): mask * (softmax - onehot(target)).
      dlogits = jax.nn.softmax(logits, axis=-1) - jax.nn.one_hot(tgt_bc, v, dtype=jnp.float32)
      dlogits = dlogits * (m_bc * g)[..., None]
      dx = jnp.einsum("bcv,ev->bce", dlogits.astype(head_ev.dtype), head_ev,
                      preferred_element_type=jnp.float32).astype(x_bce.dtype)
      if head_grad:
        dhead = dhead + jnp.einsum("bce,bcv->ev", x_bce, dlogits.astype(x_bce.dtype),
                                   preferred_element_type=jnp.float32)
      return dhead, dx

    def skip(dhead, x_bce, tgt_bc, m_bc):
      return dhead, jnp.zeros_like(x_bce)

    return jax.lax.cond(jnp.any(m_bc > 0), part, skip, dhead, x_bce, tgt_bc, m_bc)

  dhead0 = jnp.zeros((e, v) if head_grad else (), jnp.float32)
  dhead, dx_nbce = jax.lax.scan(body, dhead0, (_chunks(c, x_bte), _chunks(c, targets_bt),
                                               _chunks(c, mask_bt)))
  dx_bte = jnp.moveaxis(dx_nbce, 0, 1).reshape(x_bte.shape)
  return dx_bte, (dhead.astype(head_ev.dtype) if head_grad else None), None, None


_chunked_ce_sum.defvjp(_chunked_ce_sum_fwd, _chunked_ce_sum_bwd, symbolic_zeros=True)


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
