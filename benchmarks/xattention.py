"""XAttention heads on the GPU: block scoring and block-sparse attention against dense cuDNN and
the streaming mode, side by side in one run.

    python benchmarks/xattention.py [--lengths 32768 131072] [--sharpness 1 4] [--threshold 0.9]
    python benchmarks/xattention.py --dry-run          # CPU smoke test, tiny shapes, interpret

Shape: B = 1, 32 query / 8 KV heads, head_dim 128, bf16 (the Llama-3.1-8B attention); XA stride
16, block 128; SSA sink 1 + local 16 blocks of 128. Inputs are random normal q, k, v with q
multiplied by --sharpness: at 1 the scores are nearly flat (XAttention must keep most blocks to
reach the threshold), larger values give peakier attention and sparser selections. Real model
activations sit somewhere in between; the density printed is what the selection kept.

Per length and sharpness, every head in the same mode:
  cuDNN causal         jax.nn.dot_product_attention(implementation="cudnn", is_causal=True)
  ours SSA             our fused kernel, every head streaming
  XA scoring (kernel)  the Pallas scoring kernel + selection (`xattention.select`, pallas_gpu)
  XA scoring (jnp)     the plain-jnp scoring + selection (the reference)
  XA attention         our fused kernel with the FA-XA patterns, every head XA, on the kept blocks
  XA total             scoring (kernel) + attention, as a prefill runs them
Times are medians of --reps calls after two warm-ups; a ratio is cuDNN's time over the row's
(> 1: faster than dense). At the first length the XA kernel's output is checked against the
float32 reference on the same kept blocks, and the kernel's block masses against the jnp ones.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from elastic_jax.attention import Streaming  # noqa: E402
from elastic_jax.attention.pallas_gpu import hybrid_forward, xa_hybrid_forward  # noqa: E402
from elastic_jax.attention.reference import dense_hybrid_attention, hybrid_attention  # noqa: E402
from elastic_jax.attention.xattention import (  # noqa: E402
    XAttention, block_mass, block_mass_pallas, kept_fraction, select)


def timed(fn, *args, reps: int):
  for _ in range(2):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
  p.add_argument("--sharpness", type=float, nargs="+", default=[1.0, 4.0])
  p.add_argument("--threshold", type=float, default=0.9)
  p.add_argument("--train-lengths", type=int, nargs="*", default=[16384],
                 help="forward+backward (training) at these lengths, sharpness 1")
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--dry-run", action="store_true")
  args = p.parse_args(argv)
  n, kh, d = 32, 8, 128
  xa = XAttention(stride=16, block=128, threshold=args.threshold)
  st = Streaming(1, 16, 128)
  dtype = jnp.bfloat16
  interpret = args.dry_run
  if args.dry_run:
    n, kh, d = 4, 2, 16
    xa = XAttention(stride=4, block=16, threshold=args.threshold)
    st = Streaming(1, 2, 16)
    args.lengths = [min(x, 256) for x in args.lengths]
    args.reps = 2
    dtype = jnp.float32
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; {n}/{kh} heads, D={d}, "
        f"{jnp.dtype(dtype).name}; XA stride {xa.stride}, block {xa.block}, threshold "
        f"{xa.threshold}", flush=True)
  zeros = jnp.zeros((1, kh), jnp.float32)
  cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, implementation="xla" if args.dry_run else "cudnn"))
  ssa = jax.jit(lambda q, k, v: hybrid_forward(q, k, v, zeros, st, interpret=interpret))
  score_kernel = jax.jit(lambda q, k: select(q, k, xa, attn_impl="pallas_gpu"))
  score_jnp = jax.jit(lambda q, k: select(q, k, xa, attn_impl="reference"))
  xa_attn = jax.jit(lambda q, k, v, keep: xa_hybrid_forward(
      q, k, v, zeros, keep, st, patterns="fa-xa", xa_block=xa.block, interpret=interpret))
  checked = False
  for t in args.lengths:
    for sharp in args.sharpness:
      keys = jax.random.split(jax.random.key(t), 3)
      q = (sharp * jax.random.normal(keys[0], (1, t, n, d), jnp.float32)).astype(dtype)
      k, v = (jax.random.normal(kk, (1, t, kh, d), jnp.float32).astype(dtype)
              for kk in keys[1:])
      keep = score_kernel(q, k)
      density = float(kept_fraction(keep, jnp.asarray([t]), xa.block).mean())
      if not checked:
        checked = True
        mass_k = block_mass_pallas(q, k, xa, interpret=interpret)
        mass_j = block_mass(q, k, xa)
        same = float((keep == score_jnp(q, k)).mean())
        got = xa_attn(q, k, v, keep).astype(jnp.float32)
        if t <= 8192 or args.dry_run:
          want = dense_hybrid_attention(q, k, v, zeros, st, patterns="fa-xa", xa_keep=keep,
                                        xa_block=xa.block)
        else:
          want = hybrid_attention(q, k, v, jnp.zeros((1, t, kh)), st, patterns="fa-xa",
                                  xa_keep=keep, xa_block=xa.block)
        rel = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
        print(f"check at T={t}: block masses kernel vs jnp max |diff| "
              f"{float(jnp.abs(mass_k - mass_j).max()):.2e}; selections agree on "
              f"{same:.4%} of blocks; XA attention vs float32 reference rel. error {rel:.2e}",
              flush=True)
      rows = [("cuDNN causal", timed(cudnn, q, k, v, reps=args.reps)),
              ("ours SSA", timed(ssa, q, k, v, reps=args.reps)),
              ("XA scoring (kernel)", timed(score_kernel, q, k, reps=args.reps)),
              ("XA scoring (jnp)", timed(score_jnp, q, k, reps=args.reps)),
              ("XA attention", timed(xa_attn, q, k, v, keep, reps=args.reps))]
      rows.append(("XA total", rows[2][1] + rows[4][1]))
      base = rows[0][1]
      print(f"\nT={t}, sharpness {sharp:g}: XA density {density:.3f} of the causal pairs")
      for name, sec in rows:
        print(f"  {name:<22} {sec * 1e3:9.2f} ms   {base / sec:6.2f}x cuDNN")
      sys.stdout.flush()

  # Training: gradients of sum(out * cot) w.r.t. q, k, v (and the gate for ours), every head
  # sparse (r = 0): SSA, and XA on the kept blocks (fa-xa); both compute O_FA as well, which
  # the gate's gradient needs.
  from elastic_jax.attention.pallas_gpu import make_hybrid, make_xa_hybrid
  hybrid, xa_fn = make_hybrid(), make_xa_hybrid()
  if args.dry_run:
    args.train_lengths = [min(x, 256) for x in args.train_lengths]

  def grads(fn, n_args):
    return jax.jit(jax.grad(lambda cot, *a: jnp.sum(fn(*a).astype(jnp.float32) * cot),
                            argnums=tuple(range(1, n_args + 1))))

  for t in args.train_lengths:
    keys = jax.random.split(jax.random.key(t + 1), 4)
    q = jax.random.normal(keys[0], (1, t, n, d), jnp.float32).astype(dtype)
    k, v = (jax.random.normal(kk, (1, t, kh, d), jnp.float32).astype(dtype) for kk in keys[1:3])
    cot = jax.random.normal(keys[3], q.shape, jnp.float32)
    keep = score_kernel(q, k)
    density = float(kept_fraction(keep, jnp.asarray([t]), xa.block).mean())
    rows = [("cuDNN causal", timed(grads(lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=True, implementation="xla" if args.dry_run else "cudnn"), 3),
                                   cot, q, k, v, reps=args.reps)),
            ("ours SSA (+O_FA)", timed(grads(lambda q, k, v, g: hybrid(q, k, v, g, st, interpret),
                                             4), cot, q, k, v, zeros, reps=args.reps)),
            ("XA (+O_FA)", timed(grads(lambda q, k, v, g: xa_fn(
                q, k, v, g, keep, st, "fa-xa", xa.block, interpret), 4), cot, q, k, v, zeros,
                reps=args.reps))]
    print(f"\ntraining (forward+backward) at T={t}: XA density {density:.3f}")
    for name, sec in rows:
      print(f"  {name:<22} {sec * 1e3:9.2f} ms   {rows[0][1] / sec:6.2f}x cuDNN")
    sys.stdout.flush()


if __name__ == "__main__":
  main()
