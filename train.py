"""python train.py [--config FILE] [section.key=value ...] [--resume] [--distributed ...]

Trains the Attention Routers (and the Lagrange multipliers) of a frozen backbone with the
min-max sparsity objective. Everything is in the YAML config (see configs/ and
elastic_jax/train/run_config.py); dotted overrides change single keys:

  python train.py                 # configs/mixture_cpu.yaml: the reproduction, on a CPU
  python train.py --config configs/tiny.yaml        # a smoke run: random backbone
  python train.py --config configs/qwen3_8b.yaml model.path=/ckpt/Qwen3-8B \\
      data.train_path=data/train.jsonl mesh.fsdp=4 mesh.sequence=2

The run writes RUN_DIR/config.yaml (the resolved config), metrics.jsonl, checkpoints/ (every
checkpoint.every_steps, the last checkpoint.keep kept; SIGTERM saves and stops), eval.json
(held-out MSR per task) and export/ (the routers, ours and the authors' layout; with
export.full_model=true also the backbone with the routers merged in, the authors' full-model
layout). Running the same command again resumes from the latest checkpoint
(checkpoint.resume=auto). data.train_path takes our JSONL or the authors' parquet data.

Many hosts: start one process per host with --distributed (SLURM and TPU pods are detected;
elsewhere give --coordinator HOST:PORT --num-processes N --process-id I).
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", default=os.path.join(ROOT, "configs", "mixture_cpu.yaml"),
                 help="YAML run config (default: configs/mixture_cpu.yaml)")
  p.add_argument("overrides", nargs="*", metavar="section.key=value")
  p.add_argument("--resume", action="store_true",
                 help="require a checkpoint to resume from (checkpoint.resume=require)")
  p.add_argument("--distributed", action="store_true",
                 help="call jax.distributed.initialize() (multi-host runs)")
  p.add_argument("--coordinator", help="HOST:PORT of process 0 (with --distributed)")
  p.add_argument("--num-processes", type=int)
  p.add_argument("--process-id", type=int)
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  from elastic_jax.errors import ElasticJaxError
  from elastic_jax.train.run_config import load_run_config

  overrides = list(args.overrides) + (["checkpoint.resume=require"] if args.resume else [])
  cfg = load_run_config(args.config, overrides)  # checked before any device is touched
  if args.distributed or args.coordinator:
    import jax
    kw = {k: v for k, v in (("coordinator_address", args.coordinator),
                            ("num_processes", args.num_processes),
                            ("process_id", args.process_id)) if v is not None}
    try:
      jax.distributed.initialize(**kw)
    except (RuntimeError, ValueError) as e:
      raise ElasticJaxError(f"jax.distributed.initialize failed: {e}") from None

  from elastic_jax.train.loop import say, train
  summary = train(cfg)
  if summary["stopped"]:
    return 0
  if "eval_msr" in summary:
    from elastic_jax.train.objective import TASK_TYPES
    targets = dict(zip(TASK_TYPES, cfg.objective.targets))
    say(f"\nheld-out MSR per task (noiseless routing), step {summary['step']}:")
    say(f"  {'task':<14} {'target':>6} {'MSR':>6}")
    for task, value in summary["eval_msr"].items():
      say(f"  {task:<14} {targets[task]:>6.2f} {value:>6.2f}")
  for kind, path in summary.get("export", {}).items():
    if kind != "notes":
      say(f"routers exported ({kind}): {path}")
  return 0


if __name__ == "__main__":
  from elastic_jax.cli import run_cli
  sys.exit(run_cli(main))
