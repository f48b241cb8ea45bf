"""Compiled temporary memory of the reference hybrid attention (XLA's own accounting).

    python benchmarks/memory_hybrid.py [--lengths 16384] [--heads 32 8] [--head-dim 128]

For each length: the forward and the forward+backward temporaries of
`hybrid_attention(attn_impl="reference")` in bf16, next to the size of one head's float32
[T, T] score matrix, the thing a memory-safe implementation must never build.
"""

import argparse

import jax
import jax.numpy as jnp

from elastic_jax import hybrid_attention


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--lengths", type=int, nargs="+", default=[16384])
  p.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("N", "K"))
  p.add_argument("--head-dim", type=int, default=128)
  args = p.parse_args()
  n, k = args.heads
  print(f"jax {jax.__version__}, backend {jax.default_backend()}, B=1, {n}/{k} heads, "
        f"D={args.head_dim}, bf16")
  for t in args.lengths:
    q = jax.ShapeDtypeStruct((1, t, n, args.head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, t, k, args.head_dim), jnp.bfloat16)
    g = jax.ShapeDtypeStruct((1, k), jnp.float32)

    def loss(q, kk, v, gate):
      return hybrid_attention(q, kk, v, gate).astype(jnp.float32).sum()

    for name, fn in (("forward", hybrid_attention),
                     ("forward+backward", jax.grad(loss, argnums=(0, 1, 2, 3)))):
      temp = jax.jit(fn).lower(q, kv, kv, g).compile().memory_analysis().temp_size_in_bytes
      print(f"T={t:>7} {name:<17} {temp / 2**20:9.0f} MiB   (one head's fp32 [T, T]: "
            f"{t * t * 4 / 2**20:.0f} MiB)")


if __name__ == "__main__":
  main()
