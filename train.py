"""python train.py [--steps N] [--model-config FILE] [--out DIR] ...

Router training. Today's embedded default is a smoke run that needs no data and no weights: a
tiny random Qwen3-architecture backbone (configs/tiny_qwen3.json), frozen, and a synthetic
two-task batch source (train/synthetic.py) with targets code = 1.0 and single_qa = 0.3. The
routers and Lagrange multipliers train with the real min-max objective and train step; the run
prints progress (loss, MSR per task, temperature, multipliers, tokens/s, ETA), writes metrics
to OUT/metrics.jsonl and ends with the noiseless (inference) MSR per task on held-out batches.
YAML configs, real data, meshes and checkpoints are not here yet.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model-config", default=os.path.join(ROOT, "configs", "tiny_qwen3.json"),
                 help="HF config.json of the random backbone")
  p.add_argument("--steps", type=int, default=120)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--length", type=int, default=128, help="tokens per row")
  p.add_argument("--lr", type=float, default=1e-2)
  p.add_argument("--code-target", type=float, default=1.0)
  p.add_argument("--qa-target", type=float, default=0.3)
  p.add_argument("--block", type=int, default=8, help="SSA block size (tokens)")
  p.add_argument("--local-blocks", type=int, default=2)
  p.add_argument("--sink-blocks", type=int, default=1)
  p.add_argument("--log-every", type=int, default=10)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default="runs/train")
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  import jax
  import jax.numpy as jnp
  import numpy as np

  from elastic_jax.config import read_config_file
  from elastic_jax.errors import ElasticJaxError
  from elastic_jax.model import forward_routed_jit, init_params
  from elastic_jax.router import RouterConfig, msr
  from elastic_jax.train.objective import DEFAULT_TARGETS, TASK_TYPES, ObjectiveConfig
  from elastic_jax.train.step import TrainConfig, init_train_state, train_step
  from elastic_jax.train.synthetic import TASKS, synthetic_batch

  if args.steps < 1 or args.batch < 2 or args.length < 2:
    raise ElasticJaxError("--steps must be >= 1, --batch >= 2 and --length >= 2")
  cfg, _ = read_config_file(args.model_config)
  targets = list(DEFAULT_TARGETS)
  targets[TASKS[0]], targets[TASKS[1]] = args.code_target, args.qa_target
  try:
    rcfg = RouterConfig(block=args.block, sink_blocks=args.sink_blocks,
                        local_blocks=args.local_blocks, boundary=args.length // 8,
                        max_segments=2)
    ocfg = ObjectiveConfig(targets=tuple(targets))
    tcfg = TrainConfig(steps=args.steps, lr=args.lr, remat=False)
  except ValueError as e:
    raise ElasticJaxError(str(e)) from None
  if args.length > cfg.max_position_embeddings:
    raise ElasticJaxError(f"--length {args.length} exceeds the model's max_position_embeddings "
                          f"({cfg.max_position_embeddings})")

  key = jax.random.key(args.seed)
  backbone = init_params(cfg, jax.random.fold_in(key, 0), "float32")
  state = init_train_state(cfg, rcfg, tcfg, jax.random.fold_in(key, 1))
  os.makedirs(args.out, exist_ok=True)
  names = [TASK_TYPES[t] for t in TASKS]
  print(f"router training (smoke run): random {cfg.family} backbone, {cfg.num_layers} layers x "
        f"{cfg.num_kv_heads} KV heads, {args.steps} steps of {args.batch} x {args.length} "
        f"tokens; targets {names[0]}={args.code_target} {names[1]}={args.qa_target}", flush=True)

  def batch_at(step, seed):
    b = synthetic_batch(step, args.batch, args.length, cfg.vocab_size, seed=seed)
    return {k: jnp.asarray(v) for k, v in b.items()}

  def held_out_msr(router):
    per_task = {n: [] for n in names}
    for step in range(4):
      b = batch_at(step, args.seed + 1000)
      _, stats = forward_routed_jit(backbone, b["input_ids"], b["positions"], b["segment_ids"],
                                    b["prompt_mask"], cfg=cfg, rcfg=rcfg, router_params=router)
      m = np.asarray(msr(stats["gate"]))[:, 1]
      for row, t in enumerate(np.asarray(b["task_ids"])[:, 1]):
        per_task[TASK_TYPES[t]].append(m[row])
    return {n: float(np.mean(v)) for n, v in per_task.items()}

  start_msr = held_out_msr(state.trainable["router"])
  t_start = time.perf_counter()
  t_first = None
  with open(os.path.join(args.out, "metrics.jsonl"), "w") as log:
    for step in range(args.steps):
      state, m = train_step(state, backbone, batch_at(step, args.seed), cfg=cfg, rcfg=rcfg,
                            ocfg=ocfg, tcfg=tcfg)
      if step == 0:
        jax.block_until_ready(m["loss"])
        t_first = time.perf_counter()
      if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
        m = jax.device_get(m)
        done = step + 1
        rate = (done - 1) * args.batch * args.length / max(time.perf_counter() - t_first, 1e-9)
        eta = (args.steps - done) * args.batch * args.length / max(rate, 1e-9)
        msr_t = {n: float(m["msr_task"][t]) for n, t in zip(names, TASKS)}
        lam = {n: float(m["lambda1"][t]) for n, t in zip(names, TASKS)}
        print(f"step {done:4d}/{args.steps}  loss {m['loss']:.4f}  lm {m['lm_loss']:.4f}  "
              f"msr {names[0]} {msr_t[names[0]]:.2f} {names[1]} {msr_t[names[1]]:.2f}  "
              f"tau {m['tau']:.2f}  l1 {lam[names[0]]:.3f}/{lam[names[1]]:.3f}  "
              f"{rate:,.0f} tok/s  eta {eta:.0f}s", flush=True)
        log.write(json.dumps({"step": done, "loss": float(m["loss"]),
                              "lm_loss": float(m["lm_loss"]), "penalty": float(m["penalty"]),
                              "msr_task": msr_t, "tau": float(m["tau"]), "lambda1": lam,
                              "tokens_per_s": rate}) + "\n")
  end_msr = held_out_msr(state.trainable["router"])
  total = time.perf_counter() - t_start
  print(f"\nheld-out inference MSR (noiseless routing), {total:.0f}s total "
        f"(first step incl. compilation {t_first - t_start:.1f}s):")
  print(f"  {'task':<12} {'target':>6} {'before':>7} {'after':>6}")
  for n, t in zip(names, (args.code_target, args.qa_target)):
    print(f"  {n:<12} {t:>6.2f} {start_msr[n]:>7.2f} {end_msr[n]:>6.2f}")
  return 0


if __name__ == "__main__":
  from elastic_jax.cli import run_cli
  sys.exit(run_cli(main))
