"""Conversion time and peak host memory on a large random checkpoint.

    python benchmarks/bench_convert.py [--preset qwen3-1.7b] [--workdir DIR]

Writes a random bf16 checkpoint of the preset's shape in HF format (with our own streamed
writer), then runs `python -m elastic_jax.convert` HF -> orbax and HF -> HF in subprocesses,
sampling their memory every 0.1 s. Reported: wall time and peak anonymous resident memory
(RssAnon; the memory-mapped weight files also show in plain RSS but are page cache, which the
kernel can drop), next to the size of the weights. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

PRESETS = {
    "qwen3-1.7b": dict(model_type="qwen3", vocab_size=151936, hidden_size=2048,
                       intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                       max_position_embeddings=40960),
    "qwen3-0.6b": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024,
                       intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                       max_position_embeddings=40960),
}


def run_sampled(args):
  """Runs a command; returns (seconds, peak RssAnon in bytes)."""
  t0 = time.perf_counter()
  proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  peak = 0
  while proc.poll() is None:
    try:
      with open(f"/proc/{proc.pid}/status") as f:
        for line in f:
          if line.startswith("RssAnon:"):
            peak = max(peak, int(line.split()[1]) * 1024)
    except OSError:
      pass
    time.sleep(0.1)
  out = proc.stdout.read()
  if proc.returncode:
    raise SystemExit(f"{' '.join(args)} failed:\n{out}")
  return time.perf_counter() - t0, peak


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--preset", default="qwen3-1.7b", choices=sorted(PRESETS))
  p.add_argument("--workdir", default=None)
  args = p.parse_args()
  import jax
  import elastic_jax as ej
  from elastic_jax.model import init_params

  work = args.workdir or tempfile.mkdtemp(prefix="bench_convert_")
  hf_dir = os.path.join(work, "hf")
  cfg = ej.config_from_hf_dict(PRESETS[args.preset])
  if not os.path.isdir(hf_dir):
    model = ej.ElasticModel(cfg, init_params(cfg, jax.random.key(0), "bfloat16"),
                            cfg.to_hf_dict())
    ej.save_pretrained(model, hf_dir)
    del model
  weights = 2 * cfg.num_params()
  print(f"jax {jax.__version__}, {args.preset}: {cfg.num_params() / 1e9:.2f} B parameters, "
        f"{weights / 2**30:.2f} GiB of bf16 weights")
  for name, extra in (("HF -> orbax", []), ("HF -> HF", ["--to-hf"])):
    out = os.path.join(work, "out")
    shutil.rmtree(out, ignore_errors=True)
    sec, peak = run_sampled([sys.executable, "-m", "elastic_jax.convert", hf_dir, out,
                             "--dtype", "auto", "--quiet", *extra])
    print(f"{name:<12} {sec:6.1f} s   peak RssAnon {peak / 2**30:5.2f} GiB "
          f"({peak / weights:.2f}x the weights)")
  shutil.rmtree(os.path.join(work, "out"), ignore_errors=True)
  if not args.workdir:
    shutil.rmtree(work)


if __name__ == "__main__":
  main()
