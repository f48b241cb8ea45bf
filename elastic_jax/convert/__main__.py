"""python -m elastic_jax.convert SRC_DIR OUT_DIR [--dtype D] [--to-hf] [--routers R]

SRC_DIR is an HF directory (safetensors, single or sharded), one of the authors' released
Elastic-Attention models (PawQwen3ForCausalLM / PawLlamaForCausalLM: backbone and routers in
one directory), or one this command or save_pretrained wrote. OUT_DIR receives our format
(orbax params + config + tokenizer files, and the routers if there are any), or with --to-hf
an HF directory that `transformers` loads. Routers go where --layout says: by default the
authors' full-model layout when it can hold them (their code loads it too), else ours, a
router export in OUT_DIR/routers/. --routers merges a train.py router export into the output.
The output appears only once it is complete.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

from elastic_jax.cli import run_cli
from elastic_jax.errors import ElasticJaxError


def _positive_float(text: str) -> float:
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
  if not math.isfinite(value) or value <= 0:
    raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
  return value


def build_parser() -> argparse.ArgumentParser:
  from elastic_jax.cli import prog_name, with_prog
  prog = prog_name("python -m elastic_jax.convert")
  p = argparse.ArgumentParser(
      prog=prog, description=with_prog(__doc__, "python -m elastic_jax.convert", prog),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("src", help="HF model directory, or an elastic_jax checkpoint directory")
  p.add_argument("out", help="output directory (must not exist unless --overwrite)")
  p.add_argument("--dtype", default="auto",
                 help="auto (default: keep the source's own dtype, as transformers loads it) | "
                      "bfloat16 | float32 | float16")
  p.add_argument("--to-hf", action="store_true",
                 help="write HF safetensors instead of an elastic_jax checkpoint")
  p.add_argument("--max-shard-gb", type=_positive_float, default=5.0,
                 help="with --to-hf: largest safetensors shard, in GiB (default 5)")
  p.add_argument("--allow-pickle", action="store_true",
                 help="also read PyTorch *.bin weights (torch.load with weights_only=True)")
  p.add_argument("--routers", help="a router export of train.py (export/elastic_jax) to merge "
                                   "in; it replaces any routers SRC_DIR holds")
  p.add_argument("--layout", choices=("auto", "authors", "elastic_jax"), default="auto",
                 help="where the routers go: the authors' layout (refused, with the reason, "
                      "for routers it cannot hold), ours (a router export in OUT/routers/), "
                      "or auto (theirs when it holds them, else ours; default)")
  p.add_argument("--no-routers", action="store_true",
                 help="write the backbone alone, leaving out SRC_DIR's routers")
  p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
  p.add_argument("--quiet", action="store_true", help="no progress bars")
  return p


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  import elastic_jax as ej
  t0 = time.perf_counter()
  if args.routers and args.no_routers:
    raise ElasticJaxError("--routers and --no-routers exclude each other")
  from elastic_jax.files import check_apart
  check_apart(args.out, [args.src, args.routers], "an input (SRC_DIR or --routers)")
  if os.path.exists(args.out) and not args.overwrite:   # said in the command's own words
    raise ElasticJaxError(f"{args.out}: already exists (pass --overwrite to replace it)")
  model = ej.from_pretrained(args.src, dtype=args.dtype, allow_pickle=args.allow_pickle,
                             show_progress=not args.quiet, routers=args.routers)
  t1 = time.perf_counter()
  keep = not args.no_routers
  if args.to_hf:
    ej.save_pretrained(model, args.out, max_shard_size=int(args.max_shard_gb * 2**30),
                       overwrite=args.overwrite, show_progress=not args.quiet, routers=keep,
                       layout=args.layout)
  else:
    ej.save_converted(model, args.out, overwrite=args.overwrite, routers=keep,
                      layout=args.layout)
  t2 = time.perf_counter()
  n = model.config.num_params()
  print(f"converted {model.config.family} ({n / 1e6:.1f}M parameters, {model.dtype}) "
        f"{args.src} -> {args.out}: read {t1 - t0:.1f}s, wrote {t2 - t1:.1f}s")
  if model.router_params is not None and keep:
    r = model.router_config
    print(f"routers: {model.config.num_layers} layers x {model.config.num_kv_heads} KV heads, "
          f"patterns {r.patterns}, sink {r.sink_blocks} + window {r.local_blocks} blocks of "
          f"{r.block}, {r.relaxation} relaxation"
          + (" (the authors' layout)" if _authors_layout(model, args.layout)
             else " (our layout: OUT/routers)"))
  return 0


def _authors_layout(model, layout: str) -> bool:
  from elastic_jax.router_io import authors_layout_problem
  return layout != "elastic_jax" and authors_layout_problem(model.router_config) is None


def console() -> int:
  """Entry point of the `elastic-jax-convert` command."""
  sys.exit(run_cli(main))


if __name__ == "__main__":
  console()
