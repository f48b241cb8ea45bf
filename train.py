"""python train.py [--config FILE] [section.key=value ...] [--print-config] [--resume]

Trains the routers of a frozen backbone with the min-max sparsity objective, from a YAML run
config (configs/; every key: --print-config). The logic is in elastic_jax/train/ (cli.py:
parse, build, call). Installed from the wheel, the same command is `elastic-jax-train`.
"""

import sys

from elastic_jax.train.cli import main

if __name__ == "__main__":
  from elastic_jax.cli import run_cli
  sys.exit(run_cli(main))
