"""python -m elastic_jax.demo [--out DIR] [--config tiny_qwen3.json]

The conversion-and-logits walk-through on a tiny model made on the spot (no downloads):
  1. write a random Qwen3-architecture model as a Hugging Face directory (config.json +
     safetensors), as `transformers.save_pretrained` would;
  2. convert it to our format with the same code path as `python -m elastic_jax.convert`;
  3. load both, compare logits (they must be bit-identical), export back to HF and check that
     every tensor survives the round trip unchanged; print timings and a greedy continuation.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import numpy as np

def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m elastic_jax.demo", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", default="runs/demo", help="working directory (replaced)")
  from elastic_jax.resources import CONFIGS_DIR
  p.add_argument("--config", default=os.path.join(CONFIGS_DIR, "tiny_qwen3.json"),
                 help="HF config.json of the model to make (default: the shipped tiny one)")
  p.add_argument("--tokens", type=int, default=48, help="prompt length")
  args = p.parse_args(argv)

  import elastic_jax as ej
  from elastic_jax.config import read_config_file
  from elastic_jax.model import init_params
  from safetensors.numpy import load_file

  cfg, raw = read_config_file(args.config)
  hf_dir, ours_dir, back_dir = (os.path.join(args.out, d) for d in ("hf", "converted", "back"))
  print(f"[1/3] making a random {cfg.family} model: {cfg.num_layers} layers, "
        f"{cfg.num_heads}/{cfg.num_kv_heads} heads, {cfg.num_params() / 1e6:.2f}M parameters")
  made = ej.ElasticModel(cfg, init_params(cfg, jax.random.key(0), "float32"), raw)
  ej.save_pretrained(made, hf_dir, overwrite=True)

  t0 = time.perf_counter()
  model = ej.from_pretrained(hf_dir, dtype="float32", show_progress=False)
  ej.save_converted(model, ours_dir, overwrite=True)
  t1 = time.perf_counter()
  print(f"[2/3] converted {hf_dir} -> {ours_dir} in {t1 - t0:.2f}s")

  restored = ej.from_pretrained(ours_dir, dtype="auto", show_progress=False)
  ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=args.tokens)
  a, b = np.asarray(model.logits(ids)), np.asarray(restored.logits(ids))
  same_logits = np.array_equal(a, b)
  ej.save_pretrained(restored, back_dir, overwrite=True)
  orig, back = load_file(os.path.join(hf_dir, "model.safetensors")), load_file(
      os.path.join(back_dir, "model.safetensors"))
  same_tensors = orig.keys() == back.keys() and all(
      np.array_equal(orig[k], back[k]) for k in orig)
  greedy = a[0].argmax(-1)[-8:].tolist()
  print(f"[3/3] logits {list(a.shape)} float32; HF dir vs converted: "
        f"{'identical' if same_logits else 'DIFFERENT'}; HF -> ours -> HF tensors: "
        f"{'identical' if same_tensors else 'DIFFERENT'}; greedy next tokens {greedy}")
  return 0 if same_logits and same_tensors else 1


if __name__ == "__main__":
  from elastic_jax.cli import run_cli
  sys.exit(run_cli(main))
