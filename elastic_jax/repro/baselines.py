"""The paper's static baselines, trained in this harness: DuoAttention's and PruLong's recipes.

  python -m elastic_jax.repro.baselines duo [--config mixture.yaml] [section.key=value ...]
  python -m elastic_jax.repro.baselines prulong [--config mixture.yaml] [section.key=value ...]

Both learn one number per (layer, KV head), the same for every input, and mix each head's
outputs as the elastic training does, O = g O_full + (1 - g) O_streaming (the router
section's streaming pattern); they differ in what the number is and what trains it:

  duo      DuoAttention (Xiao et al., 2024): g = alpha in [0, 1] (starts at 1, clipped to
           [0, 1] after each step); loss = the mean squared distance between the final hidden
           states of this model and of the full-attention model at the supervised (answer)
           positions + --l1 x the sum of the alphas. Its data: synthetic retrieval, here
           the backbone's own copy task (a string of 10-20 names and numbers planted in filler,
           recalled from its first two tokens; --records of them are written to
           RUN_DIR_passkey.jsonl and replace the config's data; --records 0 keeps it).
           Left out: their passkeys are many 32-word strings in real essays, recalled all
           at once.
  prulong  PruLong (Bhaskar et al., 2025): g = z, a hard-concrete mask per head with a learned
           log alpha (beta 2/3, stretch to [-0.1, 1.1], starting at --init), one draw per
           step; loss = the answer tokens' next-token cross-entropy + l1 (s - t) + l2 (s - t)^2
           with s the expected share of heads streaming (1 - E[z != 0] averaged) and t the
           target (--target, default the mean of objective.targets), the multipliers raised by
           gradient ascent (train.lambda_lr). The data: data.train_path (the elastic routers'
           own records by default). Left out: their long SFT corpus and schedule.

Each run writes RUN_DIR/export/elastic_jax: a static router (router.static) whose logit margin
is the learned number (alpha - 1/2, or log alpha), so that ranking heads by it at a budget
(`repro.frontier score`, the deployments of both papers) or its own decisions (margin > 0:
alpha > 1/2, log alpha > 0) are read as for the trained static gate; RUN_DIR/metrics.jsonl has
the loss and the gates every log.every_steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

import numpy as np

from elastic_jax.errors import ElasticJaxError

# Hard concrete (Louizos et al., 2018) as PruLong uses it.
BETA, GAMMA, ZETA = 2.0 / 3.0, -0.1, 1.1


def hard_concrete(log_alpha, u):
  """A mask in [0, 1] from uniform noise u (same shape)."""
  import jax
  import jax.numpy as jnp
  s = jax.nn.sigmoid((jnp.log(u) - jnp.log1p(-u) + log_alpha) / BETA)
  return jnp.clip(s * (ZETA - GAMMA) + GAMMA, 0.0, 1.0)


def kept_probability(log_alpha):
  """P(mask != 0) of each head: the expected L0 norm's terms."""
  import jax
  return jax.nn.sigmoid(log_alpha - BETA * math.log(-GAMMA / ZETA))


def passkey_records(path: str, n: int, seed: int, min_len: int, max_len: int) -> int:
  """n copy-task records (train.py JSONL) with prompts of min_len..max_len tokens."""
  from elastic_jax.eval import mixture
  from elastic_jax.files import atomic_write_text
  rng = np.random.default_rng([seed, 7])
  lines = []
  for _ in range(n):
    s = mixture.copy_sample(rng, int(rng.integers(min_len, max_len + 1)))
    lines.append(json.dumps({"context": mixture.decode(s.context),
                             "question": mixture.decode(s.question),
                             "answer": mixture.decode(s.answer), "task": "Single QA",
                             "name": "copy"}))
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  atomic_write_text(path, "\n".join(lines) + "\n")
  return n


def make_loss(kind: str, args, cfg, mcfg, attn_impl: str):
  """loss(trainable, backbone, batch, key) -> (loss, metrics) of the recipe."""
  import jax
  import jax.numpy as jnp
  from elastic_jax.model import forward_routed, output_head
  from elastic_jax.train.objective import chunked_answer_cross_entropy

  def run(backbone, batch, attention, gates_lk=None):
    g = None
    if gates_lk is not None:
      b, s = batch["task_ids"].shape
      g = jnp.broadcast_to(gates_lk[:, None, None, :], (gates_lk.shape[0], b, s,
                                                         gates_lk.shape[1]))
    hidden, _ = forward_routed(backbone, batch["input_ids"], batch["positions"],
                               batch["segment_ids"], batch["prompt_mask"], cfg=mcfg,
                               rcfg=cfg.router, attention=attention, forced_gates=g,
                               attn_impl=attn_impl, packed=True,
                               num_segments=batch["task_ids"].shape[-1], return_hidden=True)
    return hidden

  mask = lambda batch: batch["loss_mask"].astype(jnp.float32)

  def duo(trainable, backbone, batch, key):
    alpha = trainable["alpha"]
    mixed = run(backbone, batch, "forced", alpha)
    full = jax.lax.stop_gradient(run(backbone, batch, "full"))
    m = mask(batch)
    # The supervised positions' squared distance, summed over the hidden size, averaged.
    dist = jnp.sum(jnp.square(mixed.astype(jnp.float32) - full.astype(jnp.float32)), -1)
    distill = jnp.sum(dist * m) / jnp.maximum(m.sum(), 1.0)
    reg = jnp.sum(alpha)
    return distill + args.l1 * reg, {"distill": distill, "l1_term": reg,
                                     "streaming": jnp.mean(alpha < 0.5)}

  def prulong(trainable, backbone, batch, key):
    log_alpha, lam = trainable["log_alpha"], trainable["lambdas"]
    z = hard_concrete(log_alpha, jax.random.uniform(key, log_alpha.shape, minval=1e-6,
                                                    maxval=1 - 1e-6))
    hidden = run(backbone, batch, "forced", z)
    ce = chunked_answer_cross_entropy(hidden, output_head(backbone, mcfg), batch["targets"],
                                      batch["loss_mask"])
    s = 1.0 - jnp.mean(kept_probability(log_alpha))
    d = s - args.target
    penalty = lam[0] * d + lam[1] * d * d
    return ce + penalty, {"ce": ce, "expected_streaming": s, "l1": lam[0], "l2": lam[1],
                          "streaming": jnp.mean(log_alpha < 0)}

  return {"duo": duo, "prulong": prulong}[kind]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m elastic_jax.repro.baselines", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("recipe", choices=("duo", "prulong"))
  p.add_argument("--config", default="mixture.yaml",
                 help="the run config (model, router pattern, data, train, run_dir)")
  p.add_argument("overrides", nargs="*", metavar="section.key=value")
  p.add_argument("--l1", type=float, default=0.05, help="duo: weight of the alphas' L1 term")
  p.add_argument("--records", type=int, default=5000,
                 help="duo: copy-task records made and trained on (0: the config's data)")
  p.add_argument("--target", type=float, help="prulong: target share of heads streaming "
                 "(default: the mean of objective.targets)")
  p.add_argument("--init", type=float, default=3.0, help="prulong: initial log alpha "
                 "(3: P(mask != 0) about 0.99)")
  args = p.parse_intermixed_args(argv)
  from elastic_jax.train.cli import config_path
  from elastic_jax.train.run_config import load_run_config
  overrides = list(args.overrides)
  passkeys = args.recipe == "duo" and args.records > 0
  if passkeys:        # its own data in place of the config's
    overrides += ["data.train_path=null", "data.eval_path=null"]
  cfg = load_run_config(config_path(args.config), overrides)
  if args.records < 0:
    raise ElasticJaxError(f"--records must be >= 0, got {args.records}")
  if not (math.isfinite(args.l1) and args.l1 >= 0):
    raise ElasticJaxError(f"--l1 must be a finite number >= 0, got {args.l1}")
  if args.target is None:
    args.target = float(np.mean(cfg.objective.targets))
  if not 0.0 <= args.target <= 1.0:
    raise ElasticJaxError(f"--target must lie in [0, 1], got {args.target}")
  from elastic_jax.files import check_creatable
  check_creatable(cfg.run_dir, "run_dir")
  if passkeys:
    path = os.path.normpath(cfg.run_dir) + "_passkey.jsonl"      # beside the run, not in it
    passkey_records(path, args.records, cfg.seed, 256, 640)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, train_path=path))
  return train(args, cfg)


def train(args, cfg) -> int:
  """Trains the recipe's gates on cfg's data and exports them (the module's docstring)."""
  import jax
  import jax.numpy as jnp
  import optax
  from elastic_jax import router_io
  from elastic_jax.train.run_config import dump_run_config
  from elastic_jax.train.setup import (batch_sharding, load_backbone, make_data, mesh_layout,
                                       preflight, to_global)
  from elastic_jax.train.step import learning_rate
  _, mesh, _, micro = mesh_layout(cfg)
  if micro:
    raise ElasticJaxError("the baselines train without micro-batches (data.micro_batch unset)")
  preflight(cfg)
  mcfg, backbone = load_backbone(cfg, mesh)
  backbone = jax.lax.stop_gradient(backbone)
  data = make_data(cfg, mcfg.vocab_size, cfg.data.train_path)
  lk = (mcfg.num_layers, mcfg.num_kv_heads)
  if args.recipe == "duo":
    trainable = {"alpha": jnp.ones(lk, jnp.float32)}
  else:
    trainable = {"log_alpha": jnp.full(lk, args.init, jnp.float32),
                 "lambdas": jnp.zeros(2, jnp.float32)}
  tc = cfg.train
  tx = {"alpha": optax.adam(learning_rate(tc), b1=tc.b1, b2=tc.b2),
        "log_alpha": optax.adam(learning_rate(tc), b1=tc.b1, b2=tc.b2),
        "lambdas": optax.chain(optax.scale(-1.0), optax.adam(tc.lambda_lr, b1=tc.b1, b2=tc.b2))}
  tx = optax.multi_transform(tx, {k: k for k in trainable})
  opt = tx.init(trainable)
  loss_fn = make_loss(args.recipe, args, cfg, mcfg, cfg.model.attn_impl)

  @jax.jit
  def step(trainable, opt, backbone, batch, key):
    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable, backbone,
                                                                    batch, key)
    updates, opt = tx.update(grads, opt, trainable)
    new = optax.apply_updates(trainable, updates)
    if "alpha" in new:
      new = dict(new, alpha=jnp.clip(new["alpha"], 0.0, 1.0))
    finite = jnp.isfinite(loss) & jnp.all(jnp.asarray([jnp.all(jnp.isfinite(g))
                                                       for g in jax.tree.leaves(grads)]))
    return new, opt, dict(aux, loss=loss, finite=finite)

  os.makedirs(cfg.run_dir, exist_ok=True)
  os.makedirs(cfg.log_dir, exist_ok=True)
  dump_run_config(cfg, os.path.join(cfg.run_dir, "config.yaml"))
  shardings = batch_sharding(mesh, False)
  key = jax.random.key(cfg.seed)
  t0 = time.perf_counter()
  tokens = cfg.data.global_batch * cfg.data.seq_len
  with jax.set_mesh(mesh), open(os.path.join(cfg.log_dir, "metrics.jsonl"), "w") as log:
    for i in range(tc.steps):
      batch = to_global(next(data), shardings, None)
      key, sub = jax.random.split(key)
      trainable, opt, m = step(trainable, opt, backbone, batch, sub)
      done = i + 1
      if done % cfg.log.every_steps == 0 or done == tc.steps:
        m = jax.device_get(m)
        if not m["finite"]:
          raise ElasticJaxError(f"step {done}: the loss or a gradient is not finite; nothing "
                                "was exported")
        el = time.perf_counter() - t0
        rate = done * tokens / el
        gate = np.asarray(jax.device_get(trainable.get("alpha", trainable.get("log_alpha"))))
        rec = {"step": done, **{k: float(v) for k, v in m.items() if k != "finite"},
               "gates": np.round(gate, 4).tolist(), "tokens_per_s": round(rate)}
        log.write(json.dumps(rec) + "\n")
        log.flush()
        print(f"{args.recipe} step {done}/{tc.steps} loss {rec['loss']:.4f} heads streaming "
              f"{rec['streaming']:.2f} | {rate:,.0f} tok/s, eta "
              f"{(tc.steps - done) * el / done:.0f}s", flush=True)
  gate = np.asarray(jax.device_get(trainable.get("alpha", trainable.get("log_alpha"))),
                    np.float32)
  if not np.all(np.isfinite(gate)):
    raise ElasticJaxError("the learned gates hold NaN or inf; nothing was exported")
  margin = gate - 0.5 if args.recipe == "duo" else gate
  logits = np.stack([np.zeros_like(margin), margin], axis=-1)          # index 1 = full
  rcfg = dataclasses.replace(cfg.router, static=True)
  routers = router_io.Routers({"static_logits": logits}, rcfg, None)
  path = router_io.save_routers(os.path.join(cfg.export_dir, "elastic_jax"), routers, mcfg,
                                targets=(args.target,) * 5 if args.recipe == "prulong"
                                else cfg.objective.targets, recipe=args.recipe)
  print(f"{args.recipe}: {int((margin <= 0).sum())} of {margin.size} heads streaming by its own "
        f"decisions; routers exported to {path}", flush=True)
  return 0


if __name__ == "__main__":
  from elastic_jax.cli import run_cli
  sys.exit(run_cli(main))
