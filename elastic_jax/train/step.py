"""Train state, optimizer, temperature schedule and the jitted router train step.

Only the routers and the multipliers train. The backbone is an argument of the step, never
differentiated and never given optimizer state; it comes out untouched.

A batch is a dict of arrays (B rows of T tokens, S segment slots per row), optionally with a
leading micro-batch axis [M, B/M, ...] whose gradients are accumulated:
  input_ids [B, T] int32     targets [B, T] int32 (next token)   loss_mask [B, T] (answer)
  segment_ids [B, T] int32 (0 = padding, 1.. = packed segments; must be < max_segments)
  positions [B, T] int32 (within the segment)   prompt_mask [B, T] bool
  task_ids [B, S] int32 (task type of each segment slot, -1 = empty slot)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from elastic_jax.config import ModelConfig
from elastic_jax.model import forward_routed, output_head
from elastic_jax.router import RouterConfig, init_router_params, msr
from elastic_jax.train.objective import (ObjectiveConfig, chunked_answer_cross_entropy,
                                         init_lambdas, sparsity_penalty)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = 300                  # total optimizer steps (schedules are relative to it)
  lr: float = 5e-4                  # router peak learning rate
  warmup_frac: float = 0.2          # linear warm-up share of the steps, then cosine decay
  b1: float = 0.9                   # AdamW betas (the multipliers' Adam uses them too)
  b2: float = 0.95
  weight_decay: float = 0.1         # AdamW weight decay of the routers
  clip_norm: float = 5.0            # global-norm clip of the router gradient
  lambda_lr: float = 1e-3           # multipliers: Adam on the negated gradient (ascent)
  tau_schedule: str = "cosine"      # cosine: tau_init -> tau_final over tau_frac of the steps
  tau_init: float = 1.5             # exponential: max(tau_final, tau_init * exp(-0.6 p))
  tau_final: float = 1.0            # the temperature's floor
  tau_frac: float = 0.6             # cosine: share of the steps over which tau anneals
  packed: bool = True               # rows may hold several samples or padding; False promises
                                    # one unpadded sample per row, so the fused kernels run

  def __post_init__(self):
    if self.steps < 1:
      raise ValueError(f"train steps must be >= 1, got {self.steps}")
    if self.tau_schedule not in ("cosine", "exponential"):
      raise ValueError(f"tau_schedule '{self.tau_schedule}' is unknown (cosine, exponential)")
    for name in ("lr", "lambda_lr", "tau_init", "tau_final", "clip_norm"):
      value = getattr(self, name)
      if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        what = "temperature" if name.startswith("tau") else "value"
        raise ValueError(f"train.{name} must be a finite {what} > 0, got {value!r}")
    if not 0 <= self.warmup_frac < 1 or not 0 < self.tau_frac <= 1:
      raise ValueError(f"train.warmup_frac must lie in [0, 1) and tau_frac in (0, 1], got "
                       f"{self.warmup_frac} and {self.tau_frac}")
    if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1 and self.weight_decay >= 0):
      raise ValueError(f"train.b1 and b2 must lie in [0, 1) and weight_decay >= 0, got "
                       f"{self.b1}, {self.b2} and {self.weight_decay}")


def temperature(step, tcfg: TrainConfig):
  """Gumbel-softmax temperature at `step` (docs/method.md §4)."""
  p = jnp.asarray(step, jnp.float32) / tcfg.steps
  if tcfg.tau_schedule == "cosine":
    frac = jnp.clip(p / tcfg.tau_frac, 0.0, 1.0)
    return tcfg.tau_final + (tcfg.tau_init - tcfg.tau_final) * 0.5 * (1 + jnp.cos(math.pi * frac))
  return jnp.maximum(tcfg.tau_final, tcfg.tau_init * jnp.exp(-0.6 * p))


def learning_rate(tcfg: TrainConfig):
  """The routers' learning-rate schedule: linear warm-up over warmup_frac, then cosine."""
  warmup = max(1, int(tcfg.warmup_frac * tcfg.steps))
  return optax.warmup_cosine_decay_schedule(0.0, tcfg.lr, warmup, max(tcfg.steps, warmup + 1))


def make_optimizer(tcfg: TrainConfig) -> optax.GradientTransformation:
  schedule = learning_rate(tcfg)
  router_tx = optax.chain(
      optax.clip_by_global_norm(tcfg.clip_norm),
      optax.adamw(schedule, b1=tcfg.b1, b2=tcfg.b2, weight_decay=tcfg.weight_decay))
  # Gradient ascent for the multipliers: flip the sign, then a plain Adam step.
  lambda_tx = optax.chain(optax.scale(-1.0), optax.adam(tcfg.lambda_lr, b1=tcfg.b1, b2=tcfg.b2))
  return optax.multi_transform({"router": router_tx, "lambda": lambda_tx},
                               {"router": "router", "lambdas": "lambda"})


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  trainable: dict              # {"router": stacked router params, "lambdas": {"l1", "l2"}}
  opt_state: Any
  key: jax.Array


def init_train_state(cfg: ModelConfig, rcfg: RouterConfig, tcfg: TrainConfig,
                     key: jax.Array) -> TrainState:
  k_router, k_lambda, k_state = jax.random.split(key, 3)
  trainable = {"router": init_router_params(cfg, rcfg, k_router),
               "lambdas": init_lambdas(k_lambda)}
  return TrainState(jnp.zeros((), jnp.int32), trainable,
                    make_optimizer(tcfg).init(trainable), k_state)


def _loss(trainable, backbone, batch, key, tau, *, cfg, rcfg, ocfg, tcfg, attn_impl, remat,
          rules, mlp_chunk):
  hidden, stats = forward_routed(
      backbone, batch["input_ids"], batch["positions"], batch["segment_ids"],
      batch["prompt_mask"], cfg=cfg, rcfg=rcfg, attention="elastic",
      router_params=trainable["router"], key=key, tau=tau, attn_impl=attn_impl, remat=remat,
      rules=rules, packed=tcfg.packed, num_segments=batch["task_ids"].shape[-1],
      return_hidden=True, mlp_chunk=mlp_chunk)
  lm = chunked_answer_cross_entropy(hidden, output_head(backbone, cfg), batch["targets"],
                                    batch["loss_mask"])
  msr_bs = msr(stats["gate"])
  penalty, msr_task, count = sparsity_penalty(msr_bs, batch["task_ids"], trainable["lambdas"],
                                              ocfg)
  valid = batch["task_ids"] >= 0
  aux = {"lm_loss": lm, "penalty": penalty, "msr_task": msr_task, "task_count": count,
         "msr": jnp.sum(jnp.where(valid, msr_bs, 0.0)) / jnp.maximum(valid.sum(), 1),
         "router_saturated_per_layer": saturated_share(stats["logits"], valid, tau)}
  return lm + penalty, aux


# A decision whose logit margin over the temperature exceeds this passes a relaxed gradient
# below soft (1 - soft) = 3e-7: it no longer learns (docs/results.md, the router diagnosis).
SATURATED_MARGIN = 15.0


def saturated_share(logits_lbskc, valid_bs, tau):
  """Per layer, the share of the batch's (segment, KV head) decisions whose logit margin
  |z1 - z0| / tau (one logit: |z| / tau, before any head norm) exceeds SATURATED_MARGIN: [L].
  A static router's logits count the same way."""
  z = jax.lax.stop_gradient(logits_lbskc)
  margin = jnp.abs(z[..., 1] - z[..., 0]) if z.shape[-1] == 2 else jnp.abs(z[..., 0])
  hit = (margin / tau > SATURATED_MARGIN).astype(jnp.float32)        # [L, B, S, K]
  w = valid_bs.astype(jnp.float32)[None, :, :, None]
  return (hit * w).sum((1, 2, 3)) / jnp.maximum(w.sum() * z.shape[3], 1.0)


def _loss_and_grads(trainable, backbone, batch, key, tau, **kw):
  """Loss, metrics and gradients; a batch with a leading micro-batch axis [M, B/M, ...] is
  run one micro-batch at a time (`lax.scan`) and its gradients averaged."""
  grad_fn = functools.partial(jax.value_and_grad(_loss, has_aux=True), **kw)
  # Micro-batch i draws its noise from fold_in(key, i): one micro-batch is the plain step.
  if batch["input_ids"].ndim == 2:
    return grad_fn(trainable, backbone, batch, jax.random.fold_in(key, 0), tau)
  m = batch["input_ids"].shape[0]

  def body(acc, xs):
    mb, k = xs
    (loss, aux), grads = grad_fn(trainable, backbone, mb, k, tau)
    # Per-task MSR is NaN where a micro-batch has no sample of the task: sum it count-weighted.
    aux = dict(aux, msr_task=jnp.where(aux["task_count"] > 0,
                                       aux["msr_task"] * aux["task_count"], 0.0))
    return jax.tree.map(jnp.add, acc, ((loss, aux), grads)), None

  zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(
      grad_fn, trainable, backbone, jax.tree.map(lambda x: x[0], batch), key, tau))
  keys = jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(m))
  total, _ = jax.lax.scan(body, zeros, (batch, keys))
  (loss, aux), grads = jax.tree.map(lambda x: x / m, total)
  count = aux["task_count"] * m  # a count, not a mean
  aux = dict(aux, task_count=count,
             msr_task=jnp.where(count > 0, aux["msr_task"] * m / jnp.maximum(count, 1), jnp.nan))
  return (loss, aux), grads


@functools.partial(jax.jit, static_argnames=("cfg", "rcfg", "ocfg", "tcfg", "attn_impl",
                                             "remat", "rules", "mlp_chunk"),
                   donate_argnums=0)
def train_step(state: TrainState, backbone: dict, batch: dict, *, cfg: ModelConfig,
               rcfg: RouterConfig, ocfg: ObjectiveConfig, tcfg: TrainConfig,
               attn_impl: str = "reference", remat: bool = False,
               rules: tuple | None = None, mlp_chunk: int = 0):
  """One optimizer step on the routers (descent) and multipliers (ascent). attn_impl, remat
  and mlp_chunk: how the frozen backbone runs (the run config's model section). `rules`: the
  logical-axis rules of the mesh in use (`sharding.rules_for`), None on one device."""
  key, step_key = jax.random.split(state.key)
  tau = temperature(state.step, tcfg)
  backbone = jax.lax.stop_gradient(backbone)
  (loss, aux), grads = _loss_and_grads(state.trainable, backbone, batch, step_key, tau,
                                       cfg=cfg, rcfg=rcfg, ocfg=ocfg, tcfg=tcfg,
                                       attn_impl=attn_impl, remat=remat, rules=rules,
                                       mlp_chunk=mlp_chunk)
  with jax.named_scope("optimizer"):   # a label for profiles (benchmarks/xprof.py)
    updates, opt_state = make_optimizer(tcfg).update(grads, state.opt_state, state.trainable)
    trainable = optax.apply_updates(state.trainable, updates)
  per_layer_norm = jnp.sqrt(sum(jnp.sum(g.reshape(g.shape[0], -1) ** 2, axis=1)
                                for g in jax.tree.leaves(grads["router"])))
  # A non-finite loss or gradient leaves the state as it was (step included): the host
  # stops at the first one it sees (`finite`), and nothing non-finite is ever saved.
  finite = jnp.isfinite(loss) & jnp.all(jnp.asarray(
      [jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
  metrics = {"loss": loss, "tau": tau, "lr": learning_rate(tcfg)(state.step),
             "lambda1": state.trainable["lambdas"]["l1"],
             "lambda2": state.trainable["lambdas"]["l2"],
             "router_grad_norm_per_layer": per_layer_norm, "finite": finite, **aux}
  new = TrainState(state.step + 1, trainable, opt_state, key)
  return jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, state), metrics


def all_finite(tree) -> bool:
  """Whether every floating-point leaf of `tree` (on the host or devices) is finite."""
  import numpy as np
  for leaf in jax.tree.leaves(tree):
    if jnp.issubdtype(jnp.result_type(leaf), jnp.floating) and not np.all(
        np.isfinite(np.asarray(jax.device_get(leaf)))):
      return False
  return True
