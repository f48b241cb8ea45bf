"""The decode attention kernel (`elastic_jax/generation/decode.py`) natively: its outputs and the
keys/values it writes against the float32 jnp reference, and its time beside the reference's
on the same inputs (the caches donated and fed back, as the decode loop runs it).

    python benchmarks/decode_attention.py [--impl pallas_gpu] [--dry-run]

Three layer shapes of an 8B model (head dim 128, 4 query heads per KV head): a 128K full layer
at batch 1 (8 full slots); an MSR 0.75 layer at 128K (2 full, 6 streaming slots at positions
from 3 to the end, in a pool of 64 slots read from slot 30); a batch of 8 at 32K with slots of
both kinds at scattered positions and empty slots. Prints per case the largest differences
and times, live bytes read and the bandwidth they come to. --dry-run: small shapes, the
kernel in interpret mode, on a CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from elastic_jax.generation import kv_cache
from elastic_jax.generation import decode
from elastic_jax.attention.reference import Streaming


def case(impl, streaming, pool, capacity, n_full, n_stream, n_layers, group, head_dim,
         full_pos, stream_pos, start, layer, repeats, dtype=jnp.bfloat16) -> float:
  """One call's inputs (random; position -1 marks an empty slot), checked and timed; returns
  the largest difference against the reference."""
  width = kv_cache.stream_width(streaming)
  keys = iter(jax.random.split(jax.random.key(0), 8))
  normal = lambda shape: jax.random.normal(next(keys), shape, dtype)
  full_k, full_v = normal((pool, capacity, head_dim)), normal((pool, capacity, head_dim))
  st_k, st_v = (normal((n_layers, n_stream, width, head_dim)) for _ in range(2))
  rows = n_full + n_stream
  q, k_new, v_new = normal((rows, group, head_dim)), normal((rows, head_dim)), normal(
      (rows, head_dim))
  full_row = jnp.asarray([i if p >= 0 else -1 for i, p in enumerate(full_pos)], jnp.int32)
  st_row = jnp.asarray([n_full + i if p >= 0 else -1 for i, p in enumerate(stream_pos)],
                       jnp.int32)
  args = (q, k_new, v_new, full_k, full_v, jnp.int32(start), full_row,
          jnp.asarray(full_pos, jnp.int32), st_k, st_v, jnp.int32(layer), st_row,
          jnp.asarray(stream_pos, jnp.int32))
  kw = dict(sink_len=streaming.block * streaming.sink_blocks,
            ring=streaming.block * streaming.local_blocks, streaming=streaming,
            scale=head_dim ** -0.5)
  as32 = [a.astype(jnp.float32) if a.dtype == dtype else a for a in args]
  want = jax.jit(lambda *a: decode.reference(*a, **kw))(*as32)
  got = jax.jit(lambda *a: decode.attention(impl, *a, **kw))(*args)
  outs = [float(jnp.abs(a - b).max()) for a, b in zip(got[0], want[0])]
  written = max(float(jnp.abs(a.astype(jnp.float32) - b).max()) for a, b in zip(got[1], want[1]))

  def seconds(name):
    fn = jax.jit(lambda *a: decode.attention(name, *a, **kw), donate_argnums=(3, 4, 8, 9))
    a = list(jax.tree.map(jnp.copy, args))
    times = []
    for _ in range(repeats + 1):
      t0 = time.perf_counter()
      out = fn(*a)
      jax.block_until_ready(out)
      times.append(time.perf_counter() - t0)
      a[3], a[4], a[8], a[9] = out[1]
    return statistics.median(times[1:])

  t_ref, t_kernel = seconds("reference"), seconds(impl)
  live = (sum(p + 1 for p in full_pos if p >= 0) + width * sum(p >= 0 for p in stream_pos)
          ) * head_dim * 2 * jnp.dtype(dtype).itemsize
  print(f"pool {pool} x {capacity}, {n_full} full / {n_stream} streaming slots: max |diff| "
        f"full {outs[0]:.2e}, streaming {outs[1]:.2e}, written keys/values {written:.2e}; "
        f"jnp reference {t_ref * 1e3:.3f} ms, {impl} {t_kernel * 1e3:.3f} ms "
        f"({t_ref / t_kernel:.2f}x); live {live / 2 ** 20:.1f} MiB -> "
        f"{live / t_kernel / 1e12:.2f} TB/s", flush=True)
  return max(outs + [written])


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--impl", default="pallas_gpu", help="decode.attention implementation")
  p.add_argument("--repeats", type=int, default=20)
  p.add_argument("--dry-run", action="store_true")
  args = p.parse_args(argv)
  streaming, impl, repeats = Streaming(), args.impl, args.repeats
  big, mid = 147456, 36864                 # capacities of 128K and 32K prompts
  end, mid_end = 131072, 32768
  if args.dry_run:
    streaming, impl, repeats = Streaming(1, 2, 16), args.impl + ":interpret", 1
    big, mid, end, mid_end = 256, 128, 200, 100
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, decode attention {impl}",
        flush=True)
  worst = max(
      case(impl, streaming, 8, big, 8, 1, 1, 4, 128, [end + 5] * 8, [-1], 0, 0, repeats),
      case(impl, streaming, 64, big, 2, 6, 32, 4, 128, [end + 7] * 2,
           [end + 7, 5, end - 72, min(3000, end - 1), 200, end], 30, 17, repeats),
      case(impl, streaming, 40, mid, 5, 4, 4, 4, 128,
           [mid - 100, 100, -1, mid // 2, mid - 1], [mid_end - 50, 40, 70, -1], 3, 2, repeats))
  print(f"largest difference against the float32 reference: {worst:.2e} (bf16 inputs)")


if __name__ == "__main__":
  main()
