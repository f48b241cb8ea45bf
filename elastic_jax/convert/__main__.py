"""python -m elastic_jax.convert SRC_DIR OUT_DIR [--dtype D] [--to-hf] [--allow-pickle]

SRC_DIR is an HF directory (safetensors, single or sharded) or one this command wrote.
OUT_DIR receives our format (orbax params + config + tokenizer files), or with --to-hf an HF
directory that `transformers` loads. The output appears only once it is complete.
"""

from __future__ import annotations

import argparse
import sys
import time

from elastic_jax.cli import run_cli


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m elastic_jax.convert", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("src", help="HF model directory, or an elastic_jax checkpoint directory")
  p.add_argument("out", help="output directory (must not exist unless --overwrite)")
  p.add_argument("--dtype", default="bfloat16",
                 help="bfloat16 | float32 | float16 | auto (keep the source dtype); "
                      "default bfloat16")
  p.add_argument("--to-hf", action="store_true",
                 help="write HF safetensors instead of an elastic_jax checkpoint")
  p.add_argument("--max-shard-gb", type=float, default=5.0,
                 help="with --to-hf: largest safetensors shard, in GiB (default 5)")
  p.add_argument("--allow-pickle", action="store_true",
                 help="also read PyTorch *.bin weights (torch.load with weights_only=True)")
  p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
  p.add_argument("--quiet", action="store_true", help="no progress bars")
  return p


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  import elastic_jax as ej
  t0 = time.perf_counter()
  model = ej.from_pretrained(args.src, dtype=args.dtype, allow_pickle=args.allow_pickle,
                             show_progress=not args.quiet)
  t1 = time.perf_counter()
  if args.to_hf:
    ej.save_pretrained(model, args.out, max_shard_size=int(args.max_shard_gb * 2**30),
                       overwrite=args.overwrite, show_progress=not args.quiet)
  else:
    ej.save_converted(model, args.out, overwrite=args.overwrite)
  t2 = time.perf_counter()
  n = model.config.num_params()
  print(f"converted {model.config.family} ({n / 1e6:.1f}M parameters, {model.dtype}) "
        f"{args.src} -> {args.out}: read {t1 - t0:.1f}s, wrote {t2 - t1:.1f}s")
  return 0


if __name__ == "__main__":
  sys.exit(run_cli(main))
