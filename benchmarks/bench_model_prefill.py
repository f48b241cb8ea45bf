"""Prefill of a whole (random) model with a fixed head routing: the fused kernels inside the
model (attn_impl="auto", on a Hopper GPU the Mosaic GPU forward; attn_impl="pallas_gpu", the Triton one)
against the plain-jnp reference, side by side in one run.

    python benchmarks/bench_model_prefill.py [--length 8192] [--msr 0.75]

The model is a random Qwen3-architecture backbone (8 layers, hidden 1024, 16/4 heads,
head_dim 128, bf16). It checks that the kernels give the reference's logits (relative
error of the float32 logits), then times a forward pass of each (median of --reps).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import elastic_jax as ej
from elastic_jax.model import init_params
from elastic_jax.router import RouterConfig

CONFIG = dict(model_type="qwen3", vocab_size=32000, hidden_size=1024, intermediate_size=3072,
              num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
              head_dim=128, max_position_embeddings=262144)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--length", type=int, default=8192)
  p.add_argument("--msr", type=float, default=0.75)
  p.add_argument("--reps", type=int, default=10)
  args = p.parse_args()
  cfg = ej.config_from_hf_dict(CONFIG)
  model = ej.ElasticModel(cfg, init_params(cfg, jax.random.key(0), "bfloat16"),
                          cfg.to_hf_dict(), router_config=RouterConfig())
  ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, args.length))
  l, k = cfg.num_layers, cfg.num_kv_heads
  n_sparse = round(args.msr * l * k)
  gates = np.ones(l * k, np.float32)
  gates[np.random.default_rng(1).permutation(l * k)[:n_sparse]] = 0.0
  gates = gates.reshape(l, k)
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, T={args.length}, "
        f"MSR {n_sparse / (l * k):.2f}")
  run = {impl: (lambda attn_impl=impl: model.logits(ids, attention="forced", gates=gates,
                                               attn_impl=impl))
         for impl in ("auto", "pallas_gpu", "reference")}
  outs = {impl: fn() for impl, fn in run.items()}
  for impl in ("auto", "pallas_gpu"):
    rel = float(jnp.linalg.norm(outs[impl] - outs["reference"])
                / jnp.linalg.norm(outs["reference"]))
    print(f"logits {impl} vs reference: rel err {rel:.2e}")
    assert rel < 2e-2, (impl, rel)
  times = {}
  for impl, fn in run.items():
    ts = []
    for _ in range(args.reps):
      t0 = time.perf_counter()
      jax.block_until_ready(fn())
      ts.append(time.perf_counter() - t0)
    times[impl] = statistics.median(ts)
  for impl, sec in times.items():
    print(f"{impl:<10} {sec * 1e3:9.2f} ms  speed-up vs reference "
          f"{times['reference'] / sec:5.2f}")


if __name__ == "__main__":
  main()
