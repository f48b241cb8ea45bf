"""Where a decode step's time goes: one device decode loop (`generate._decode_tokens`) traced
with `jax.profiler`, its GPU kernels counted and summed per token.

    python benchmarks/decode_profile.py [--model llama3_8b] [--cases full:128 msr0.75:131072]
        [--steps 32] [--top 40] [--dry-run]

Each case is SETTING:LENGTH (SETTING full, or msrX for round(X·L·K) (layer, KV head) pairs
streaming at random, fixed seed) at batch 1, on per-layer weights (`model.split_layers`) and
one cache per layer of random keys and values (`kv_cache.allocate` per layer: what the
layer-by-layer prefill leaves), the Triton decode kernel. Prints the loop's wall time per token
(median of 3 after 2 warm-up loops), kernels per token, the device's busy time and span per
token, and the costliest kernels (time per token, launches per token, time per launch).
--dry-run: tiny shapes on a CPU (no GPU kernels to count; checks the script runs).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from elastic_jax.generation import kv_cache
from elastic_jax import router as rt
from elastic_jax.config import config_from_hf_dict
from elastic_jax.generation.generate import _decode_tokens
from elastic_jax.model import init_params, split_layers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import SHAPES  # noqa: E402


def case_arg(text: str) -> tuple[float, int]:
  """SETTING:LENGTH -> (MSR, length)."""
  setting, _, length = text.partition(":")
  try:
    msr = 0.0 if setting == "full" else float(setting.removeprefix("msr"))
    if not (setting == "full" or setting.startswith("msr")) or not 0 <= msr <= 1:
      raise ValueError
    return msr, int(length)
  except ValueError:
    raise argparse.ArgumentTypeError(
        f"expected full:LENGTH or msrX:LENGTH (X in [0, 1]), got {text!r}") from None


def kernel_table(trace_dir: str, steps: int, top: int) -> None:
  """Per-token sums of the GPU kernels in a trace (nothing on a CPU)."""
  from xprof import trace_planes
  planes = [p for p in trace_planes(trace_dir) if "GPU" in p.name]
  for plane in planes:
    for line in plane.lines:
      events = list(line.events)
      if len(events) < 50:
        continue
      total, count = collections.Counter(), collections.Counter()
      for ev in events:
        total[ev.name] += ev.duration_ns
        count[ev.name] += 1
      span = (max(e.start_ns + e.duration_ns for e in events)
              - min(e.start_ns for e in events))
      print(f"  {plane.name} / {line.name}: {len(events) / steps:.0f} kernels a token, busy "
            f"{sum(total.values()) / 1e6 / steps:.3f} ms, span {span / 1e6 / steps:.3f} ms "
            "a token")
      for name, ns in total.most_common(top):
        print(f"    {ns / 1e6 / steps:7.3f} ms  x{count[name] / steps:6.1f}  "
              f"{ns / count[name] / 1e3:7.1f} us each  {name[:90]}")
  if not planes:
    print("  (no GPU kernels in the trace)")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", choices=sorted(SHAPES), default="llama3_8b")
  p.add_argument("--cases", type=case_arg, nargs="+",
                 default=[(0.0, 128), (0.75, 131072)], metavar="SETTING:LENGTH")
  p.add_argument("--steps", type=int, default=32)
  p.add_argument("--top", type=int, default=40)
  p.add_argument("--dry-run", action="store_true")
  args = p.parse_args(argv)
  hf = dict(SHAPES[args.model],
            max_position_embeddings=max(t for _, t in args.cases) + 1024)
  rcfg, impl, dtype = rt.RouterConfig(), "triton", jnp.bfloat16
  if args.dry_run:
    hf.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=512,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    rcfg, impl, dtype = rt.RouterConfig(block=16, local_blocks=4), "reference", jnp.float32
    args.cases = [(m, min(t, 300)) for m, t in args.cases]
    args.steps = min(args.steps, 4)
  cfg = config_from_hf_dict(hf, f"{args.model} shape")
  params = split_layers(init_params(cfg, jax.random.key(0), jnp.dtype(dtype).name))
  l, k, steps = cfg.num_layers, cfg.num_kv_heads, args.steps
  print(f"{args.model}: {jax.devices()[0].device_kind}, jax {jax.__version__}, decode "
        f"attention {impl}, {steps} steps a loop", flush=True)
  for msr, t in args.cases:
    gates = np.ones(l * k, np.float32)
    gates[np.random.default_rng(0).permutation(l * k)[:round(msr * l * k)]] = 0.0
    gates = gates.reshape(l, 1, k)
    fill = lambda i, shape, dt: jax.random.normal(jax.random.key(10 + i), shape, dt)
    cache = [kv_cache.allocate(gates[i:i + 1], t + 256, rcfg.streaming, cfg.head_dim, dtype,
                               fill) for i in range(l)]
    tok = jnp.zeros((1,), jnp.int32)

    def loop_args(c):
      return (params, c, tok, tok + 1, jnp.zeros((1,), bool), jax.random.key(0),
              jnp.full((1,), t, jnp.int32), jnp.full((1,), steps + 8, jnp.int32),
              jnp.asarray([-1], jnp.int32))

    run = _decode_tokens.lower(*loop_args(cache), cfg=cfg, rcfg=rcfg, steps=steps,
                               temperature=0.0, top_p=1.0, unroll=False, impl=impl,
                               keep_logits=False).compile()
    times = []
    for i in range(5):
      t0 = time.perf_counter()
      out = jax.block_until_ready(run(*loop_args(cache)))
      times.append(time.perf_counter() - t0)
      cache = out[1]
    trace_dir = tempfile.mkdtemp()
    with jax.profiler.trace(trace_dir):
      cache = jax.block_until_ready(run(*loop_args(cache)))[1]
    print(f"== MSR {1 - gates.mean():.2f}, T={t}, batch 1: "
          f"{statistics.median(times[2:]) / steps * 1e3:.3f} ms a token (wall)", flush=True)
    kernel_table(trace_dir, steps, args.top)


if __name__ == "__main__":
  main()
