"""Prefill (time to first token), decode speed and decode-cache memory: full attention against
forced elastic routing at a given MSR, one device, an 8B-shaped backbone with random weights.

    python benchmarks/generate_speed.py [--model llama3_8b|qwen3_8b] [--lengths 32768 131072]
        [--msr 0.75] [--new-tokens 16] [--dry-run]

Both settings run through `elastic_jax.generate.generate` in the same process, one prompt per
length: "full" (every head full attention, dense cache) and "forced" gates with round(MSR·L·K)
of the (layer, KV head) pairs streaming, chosen at random with a fixed seed (no trained routers
exist here; what a router would choose costs the same). Each case runs once to compile and is
then timed; decode tokens/s counts the new tokens after the first. Router overhead: the
routers of every layer (pooling and both MLPs) timed alone on one prompt's keys.
--dry-run shrinks everything so the script runs on a CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from elastic_jax import router as rt  # noqa: E402
from elastic_jax.config import config_from_hf_dict  # noqa: E402
from elastic_jax.generate import SamplingConfig, generate  # noqa: E402
from elastic_jax.model import init_params  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_router import SHAPES  # noqa: E402


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", choices=sorted(SHAPES), default="llama3_8b")
  p.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
  p.add_argument("--msr", type=float, default=0.75)
  p.add_argument("--new-tokens", type=int, default=16)
  p.add_argument("--dry-run", action="store_true")
  args = p.parse_args(argv)
  hf = dict(SHAPES[args.model], max_position_embeddings=max(args.lengths) + 1024)
  rcfg = rt.RouterConfig()
  if args.dry_run:
    hf.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=512,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    args.lengths = [min(n, 300) for n in args.lengths]
    rcfg = rt.RouterConfig(block=16, local_blocks=4)
  cfg = config_from_hf_dict(hf, f"{args.model} shape")
  dtype = "float32" if args.dry_run else "bfloat16"
  params = init_params(cfg, jax.random.key(0), dtype)
  l, k = cfg.num_layers, cfg.num_kv_heads
  rng = np.random.default_rng(0)
  gates = np.ones(l * k, np.float32)
  gates[rng.permutation(l * k)[:round(args.msr * l * k)]] = 0.0
  gates = gates.reshape(l, k)
  impl = "reference" if args.dry_run else "auto"
  dev = jax.devices()[0]
  print(f"{args.model}: {l} layers, {cfg.num_heads}/{k} heads; {dev.device_kind}, "
        f"jax {jax.__version__}; MSR {1 - gates.mean():.3f}, {args.new_tokens} new tokens",
        flush=True)
  rows = []
  for t in args.lengths:
    prompt = [rng.integers(0, cfg.vocab_size, t).tolist()]
    base = None
    for name, kw in (("full", dict(attention="full")),
                     (f"elastic@MSR{1 - gates.mean():.2f}", dict(attention="forced",
                                                               gates=gates))):
      run = lambda: generate(params, cfg, prompt, rcfg=rcfg, attn_impl=impl,
                             sampling=SamplingConfig(max_new_tokens=args.new_tokens), **kw)
      t0 = time.perf_counter()
      run()
      first = time.perf_counter() - t0
      gen = run()
      decode_tps = (len(gen.tokens[0]) - 1) / gen.decode_seconds
      base = base or gen.prefill_seconds
      row = (t, name, gen.prefill_seconds, base / gen.prefill_seconds, decode_tps,
             gen.cache_bytes / 2**30, gen.dense_cache_bytes / 2**30)
      rows.append(row)
      print(f"T={t:>7} {name:<16} prefill {row[2]:8.3f} s ({row[3]:.2f}x full)  decode "
            f"{row[4]:7.1f} tok/s  cache {row[5]:6.2f} GiB (dense {row[6]:.2f})  "
            f"[first call {first:.1f} s]", flush=True)
  # Router overhead: every layer's router on one prompt's keys (pooling + MLPs), as the model
  # runs it on one input per row (boundary tokens gathered), and with the weighted sum over
  # every token that packed rows need.
  router = rt.init_router_params(cfg, rcfg, jax.random.key(1))
  t = args.lengths[-1]
  keys = jnp.asarray(rng.normal(size=(l, 1, t, k, cfg.head_dim)), params["embed"].dtype)
  seg = jnp.ones((1, t), jnp.int32)
  pos = jnp.arange(t, dtype=jnp.int32)[None]

  def routers_with(pool):
    @jax.jit
    def routers(router, keys):
      def one(layer_router, k_btkh):
        return rt.gate_from_logits(rt.router_logits(layer_router, pool(k_btkh)), rcfg)[0]
      return jax.vmap(one)(router, keys)
    return routers

  for name, pool in (("boundary tokens", lambda x: rt.pool_prompt_prefix(x, seg, seg > 0, rcfg, 2)),
                     ("packed pooling", lambda x: rt.pool_prompt(x, seg, pos, seg > 0, rcfg, 2))):
    routers = routers_with(pool)
    jax.block_until_ready(routers(router, keys))
    times = []
    for _ in range(10):
      t0 = time.perf_counter()
      jax.block_until_ready(routers(router, keys))
      times.append(time.perf_counter() - t0)
    print(f"routers of all {l} layers at T={t} ({name}): "
          f"{statistics.median(times) * 1e3:.3f} ms (median of 10; the paper reports about "
          f"0.2 ms)")


if __name__ == "__main__":
  main()
