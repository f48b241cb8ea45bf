"""The training command (`train.py`, `elastic-jax-train`): parse, build, call.

Trains the Attention Routers (and the Lagrange multipliers) of a frozen backbone with the
min-max sparsity objective. Everything is in the YAML config (configs/, and
train/config_schema.py for every key; --print-config lists them); dotted overrides change keys:

  train.py                        # configs/mixture_cpu.yaml: the reproduction, on a CPU
  train.py --config configs/tiny.yaml             # a smoke run: random backbone
  train.py --config configs/qwen3_8b.yaml model.path=/ckpt/Qwen3-8B \\
      data.train_path=data/train.jsonl mesh.fsdp=4 mesh.sequence=2

The run writes RUN_DIR/config.yaml (the resolved config), metrics.jsonl, checkpoints/ (every
checkpoint.every_steps, the last checkpoint.keep kept; SIGTERM saves and stops), eval.json
(held-out MSR per task) and export/ (the routers, ours and the authors' layout; with
export.full_model=true also the backbone with the routers merged in). Running the same
command again resumes from the latest checkpoint (checkpoint.resume=auto). data.train_path
takes our JSONL or the authors' parquet data. A --config given by name (mixture_cpu.yaml), or
as configs/NAME.yaml where no such file is, is the shipped config of that name. An export
folder holding files that no train run exported there is refused (export.overwrite=true
replaces it). --print-config prints the resolved config as YAML that --config reads back.

Many hosts: start one process per host with --distributed (SLURM and TPU pods are detected;
elsewhere give --coordinator HOST:PORT --num-processes N --process-id I).
"""

from __future__ import annotations

import argparse

from elastic_jax.errors import ElasticJaxError

DEFAULT_CONFIG = "mixture_cpu.yaml"


def build_parser() -> argparse.ArgumentParser:
  from elastic_jax.cli import prog_name, with_prog
  prog = prog_name("train.py")
  p = argparse.ArgumentParser(prog=prog, description=with_prog(__doc__, "train.py", prog),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", default=DEFAULT_CONFIG,
                 help=f"YAML run config: a path, or a shipped one by name (tiny.yaml, or "
                      f"configs/tiny.yaml from any directory; default {DEFAULT_CONFIG})")
  p.add_argument("overrides", nargs="*", metavar="section.key=value",
                 help="change keys of the config, the value read as YAML (train.steps=300, "
                      "objective.targets=[0.7,0.7,1,1,1], data.train_path=null)")
  p.add_argument("--print-config", action="store_true",
                 help="print the resolved config as YAML, every key with its comment (what "
                      "--config reads back), then stop")
  p.add_argument("--resume", action="store_true",
                 help="require a checkpoint to resume from (checkpoint.resume=require)")
  p.add_argument("--distributed", action="store_true",
                 help="call jax.distributed.initialize() (multi-host runs)")
  p.add_argument("--coordinator", help="HOST:PORT of process 0 (with --distributed)")
  p.add_argument("--num-processes", type=int,
                 help="number of processes of a multi-host run (with --coordinator)")
  p.add_argument("--process-id", type=int,
                 help="this process's index, 0 .. --num-processes - 1 (with --coordinator)")
  return p


def parse_args(argv=None):
  return build_parser().parse_args(argv)


def config_path(name: str) -> str:
  """A path as given, else a shipped config of that name (`tiny.yaml`, `configs/tiny.yaml`)."""
  from elastic_jax.cli import config_file
  return config_file(name)


def main(argv=None) -> int:
  args = parse_args(argv)
  from elastic_jax.train.run_config import describe_config, load_run_config

  overrides = list(args.overrides) + (["checkpoint.resume=require"] if args.resume else [])
  cfg = load_run_config(config_path(args.config), overrides)  # before any device is touched
  if args.print_config:
    from elastic_jax.cli import prog_name
    print(describe_config(cfg, prog_name("train.py")), end="")
    return 0
  if args.distributed or args.coordinator:
    import jax
    kw = {k: v for k, v in (("coordinator_address", args.coordinator),
                            ("num_processes", args.num_processes),
                            ("process_id", args.process_id)) if v is not None}
    try:
      jax.distributed.initialize(**kw)
    except (RuntimeError, ValueError) as e:
      raise ElasticJaxError(f"jax.distributed.initialize failed: {e}") from None

  from elastic_jax.tasks import TASK_TYPES
  from elastic_jax.train.loop import train
  from elastic_jax.train.metrics import say
  summary = train(cfg)
  if summary["stopped"]:
    return 0
  if "eval_msr" in summary:
    targets = dict(zip(TASK_TYPES, cfg.objective.targets))
    say(f"\nheld-out MSR per task (noiseless routing), step {summary['step']}:")
    say(f"  {'task':<14} {'target':>6} {'MSR':>6}")
    for task, value in summary["eval_msr"].items():
      say(f"  {task:<14} {targets[task]:>6.2f} {value:>6.2f}")
  for kind, path in summary.get("export", {}).items():
    say(f"routers exported ({kind}): {path}")
  return 0


def console() -> int:
  """Entry point of the `elastic-jax-train` command."""
  import sys
  from elastic_jax.cli import run_cli
  sys.exit(run_cli(main))
