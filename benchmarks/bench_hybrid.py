"""Hybrid FA/SSA attention forward: our kernel and its peers, side by side in one run.

    python benchmarks/bench_hybrid.py [--lengths 8192 32768] [--reps 20]

Shape: B=1, 32 query / 8 KV heads, head_dim 128, bf16 (Llama-3-8B attention). For each length
it first checks the kernel against the float32 reference on the same inputs (relative error
||out - ref|| / ||ref||), then times (median of --reps after warm-up):
  cudnn_causal      jax.nn.dot_product_attention(implementation="cudnn", is_causal=True)
  cudnn_window      the same with a causal sliding window of sink+local tokens (no sink):
                    what an all-streaming model costs with cuDNN
  ours_msr{0,0.75,1}[tiles] the fused kernel with 0, 6 or 8 of the 8 KV heads streaming,
                    for each --tiles variant
  reference_msr0.75 the plain-jnp reference (only up to --reference-max tokens)
and prints each time with its ratio to cudnn_causal. TFLOP/s counts the work each pattern
needs (causal pairs, or the pairs SSA keeps).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp

from elastic_jax.attention import Streaming
from elastic_jax.attention.pallas_gpu import hybrid_forward
from elastic_jax.attention.reference import hybrid_attention as reference
from elastic_jax.router import streaming_kept_fraction


def timeit(fn, reps):
  jax.block_until_ready(fn())
  jax.block_until_ready(fn())
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
  p.add_argument("--reps", type=int, default=20)
  p.add_argument("--tiles", nargs="+", default=["64x64x2"],
                 help="kernel variants to time, each block_q x block_k x num_stages")
  p.add_argument("--reference-max", type=int, default=8192)
  args = p.parse_args()
  st = Streaming(1, 16, 128)
  b, n, k, d = 1, 32, 8, 128
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
  kernels = {}
  for spec in args.tiles:
    bq, bk, stages = (int(x) for x in spec.split("x"))
    kernels[spec] = jax.jit(functools.partial(
        hybrid_forward, streaming=st, block_q=bq, block_k=bk, num_stages=stages))
  rows = []
  for t in args.lengths:
    keys = jax.random.split(jax.random.key(t), 3)
    q = jax.random.normal(keys[0], (b, t, n, d), jnp.bfloat16)
    kk = jax.random.normal(keys[1], (b, t, k, d), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, t, k, d), jnp.bfloat16)
    gates = {m: jnp.asarray([[1.0] * round(8 * (1 - m)) + [0.0] * round(8 * m)])
             for m in (0.0, 0.75, 1.0)}
    mixed = jnp.asarray([[1.0, 0.0, 0.5, 0.0, 1.0, 0.0, 0.2, 0.0]])
    # Correctness first, on these very inputs (float32 reference).
    if t <= 16384:
      up = lambda x: x.astype(jnp.float32)
      for name, g in (("msr0.75", gates[0.75]), ("mixed", mixed)):
        want = reference(up(q), up(kk), up(v), jnp.broadcast_to(g[:, None], (b, t, k)), st)
        for spec, kern in list(kernels.items()):
          try:
            got = kern(q, kk, v, g).astype(jnp.float32)
          except jax.errors.JaxRuntimeError as e:  # e.g. tiles over the shared-memory limit
            print(f"T={t} [{spec}] does not run here, dropped: {str(e).splitlines()[0][:100]}")
            del kernels[spec]
            continue
          rel = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
          print(f"T={t} check {name} [{spec}]: rel err {rel:.2e} (bf16: expect 1e-3..1e-2)")
          assert rel < 2e-2 and bool(jnp.isfinite(got).all()), rel
    causal_flops = 4 * b * n * d * t * (t + 1) / 2
    kept = float(streaming_kept_fraction(jnp.asarray(t), st))
    work = {"cudnn_causal": causal_flops,
            "cudnn_window": 4 * b * n * d * min(t, st.block * (st.sink_blocks + st.local_blocks))
            * t}
    fns = {
        "cudnn_causal": lambda: jax.nn.dot_product_attention(
            q, kk, v, is_causal=True, implementation="cudnn"),
        "cudnn_window": lambda: jax.nn.dot_product_attention(
            q, kk, v, is_causal=True, implementation="cudnn",
            local_window_size=(st.block * (st.sink_blocks + st.local_blocks) - 1, 0)),
    }
    for spec, kern in kernels.items():
      for m, g in gates.items():
        fns[f"ours_msr{m:g}[{spec}]"] = functools.partial(kern, q, kk, v, g)
        work[f"ours_msr{m:g}[{spec}]"] = causal_flops * ((1 - m) + m * kept)
    if t <= args.reference_max:
      ref = jax.jit(lambda q, kk, v, g: reference(q, kk, v, g, st))
      g_ref = jnp.broadcast_to(gates[0.75][:, None], (b, t, k))
      fns["reference_msr0.75"] = functools.partial(ref, q, kk, v, g_ref)
      work["reference_msr0.75"] = causal_flops * (0.25 + 0.75 * kept)
    base = None
    for name, fn in fns.items():
      try:
        sec = timeit(fn, args.reps)
      except Exception as e:  # a peer that does not run here is reported, not fatal
        print(f"T={t} {name}: failed ({type(e).__name__}: {str(e)[:120]})")
        continue
      base = sec if name == "cudnn_causal" else base
      rows.append((t, name, sec * 1e3, work[name] / sec / 1e12,
                   (base / sec) if base else float("nan")))
  print(f"\n{'T':>7} {'impl':<26} {'ms':>9} {'TFLOP/s':>8} {'speed-up vs cudnn_causal':>25}")
  for t, name, ms, tf, ratio in rows:
    print(f"{t:>7} {name:<26} {ms:>9.3f} {tf:>8.1f} {ratio:>25.2f}")


if __name__ == "__main__":
  main()
