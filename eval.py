"""python eval.py {ruler,longbench,longbench-v2,mixture,ppl} [options]

Long-context quality, sparsity and speed of a model under full, elastic, sparse and static
attention, on benchmarks generated or read locally. `python eval.py BENCHMARK --help` lists a
benchmark's options; the logic is in elastic_jax/eval/ (cli.py: parse, build, call). Installed
from the wheel, the same command is `elastic-jax-eval`.
"""

import sys

from elastic_jax.eval.cli import main

if __name__ == "__main__":
  from elastic_jax.cli import run_cli
  sys.exit(run_cli(main))
