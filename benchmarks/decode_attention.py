"""The decode attention kernel (`elastic_jax/generation/decode.py`) natively: its outputs and the
keys/values it writes against the float32 jnp reference, and its time beside the reference's
on the same inputs (the caches donated and fed back, as the decode loop runs it).

    python benchmarks/decode_attention.py [--impl pallas_gpu] [--dry-run]
    python benchmarks/decode_attention.py --paged [--page-size 256] [--dry-run]

Three layer shapes of an 8B model (head dim 128, 4 query heads per KV head): a 128K full layer
at batch 1 (8 full slots); an MSR 0.75 layer at 128K (2 full, 6 streaming slots at positions
from 3 to the end, in a pool of 64 slots read from slot 30); a batch of 8 at 32K with slots of
both kinds at scattered positions and empty slots. Prints per case the largest differences
and times, live bytes read and the bandwidth they come to. --dry-run: small shapes, the
kernel in interpret mode, on a CPU.

--paged: the engine's attention over pages instead (`pallas_gpu.paged.paged_attention`, the
Triton kernel that reads only each slot's own pages) against `decode_reference.paged_reference`
(the plain-jnp spec, which gathers every slot's whole page table) on one layer of a batch of
--rows requests (8 KV heads, 4 query heads each, head dim 128) in a shuffled pool: full slots
at 32K and 128K positions on and off page boundaries, streaming slots, an empty row, and a
page past each slot's use holding NaN (which the kernel must not read). Prints the largest
difference and both times.
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


def paged(args) -> None:
  import numpy as np
  from elastic_jax.attention import decode_reference
  from elastic_jax.attention.pallas_gpu.paged import paged_attention
  from elastic_jax.generation import paged as pg
  st, page, rows, kh, g, h = Streaming(), args.page_size, args.rows, 8, 4, 128
  longest = 131072
  if args.dry_run:
    st, page, rows, kh, g, h, longest = Streaming(1, 2, 16), 16, 4, 2, 2, 16, 300
  rng = np.random.default_rng(0)
  pos = rng.integers(longest // 4, longest, rows).astype(np.int32)
  pos[0], pos[-1] = longest - 1, -1                  # the longest request, an empty row
  full = rng.random((rows, kh)) < 0.5
  width = longest // page + 1
  need = [(0 if p < 0 else (p // page + 1 if f else pg.stream_pages(st, page)))
          for p, row in zip(pos, full) for f in row]
  num_pages = sum(need) + len(need)
  order = iter(rng.permutation(num_pages).tolist())
  table = np.full((rows, kh, width), num_pages, np.int32)
  spare = []
  for i in range(rows):
    for j in range(kh):
      n = need[i * kh + j]
      table[i, j, :n] = [next(order) for _ in range(n)]
      spare.append(next(order))
      if n < width:
        table[i, j, n] = spare[-1]
  dt = jnp.bfloat16
  k_pool = jax.random.normal(jax.random.key(1), (num_pages, page, h), dt)
  v_pool = jax.random.normal(jax.random.key(2), (num_pages, page, h), dt)
  nan = jnp.asarray(spare)
  dirty = [x.at[nan].set(jnp.nan) for x in (k_pool, v_pool)]
  q = jax.random.normal(jax.random.key(3), (rows, kh, g, h), dt)
  kw = dict(sink_len=st.block * st.sink_blocks, ring=st.block * st.local_blocks, streaming=st,
            scale=h ** -0.5)
  args_k = (q, *dirty, jnp.asarray(table), jnp.asarray(full), jnp.asarray(pos))
  kernel = jax.jit(lambda *a: paged_attention(*a, interpret=args.dry_run, **kw))
  spec = jax.jit(lambda *a: decode_reference.paged_reference(*a, **kw))
  got = kernel(*args_k)
  want = spec(*(x.astype(jnp.float32) for x in (q, k_pool, v_pool)), *args_k[3:])
  err = float(jnp.abs(got - want).max())
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}: {rows} rows x {kh} KV heads, "
        f"pages of {page}, a pool of {num_pages} pages ({sum(need)} in use, "
        f"{int(full.sum())} full slots, positions up to {int(pos.max()) + 1}); largest "
        f"difference against the float32 spec {err:.2e}, finite: "
        f"{bool(jnp.isfinite(got).all())}", flush=True)
  clean = (q, k_pool, v_pool, *args_k[3:])
  times = {}
  for name, fn, a in (("kernel over pages", kernel, args_k), ("plain-jnp spec", spec, clean)):
    jax.block_until_ready(fn(*a))
    samples = []
    for _ in range(1 if args.dry_run else args.repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*a))
      samples.append(time.perf_counter() - t0)
    times[name] = statistics.median(samples)
  read = sum(need) * page * h * 2 * 2                          # keys and values, bf16
  for name, sec in times.items():
    print(f"  {name:<18} {sec * 1e3:8.3f} ms  ({read / sec / 1e12:.2f} TB/s of the pages in "
          f"use)")
  print(f"  the spec's time / the kernel's: {times['plain-jnp spec'] / times['kernel over pages']:.1f}")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--impl", default="pallas_gpu", help="decode.attention implementation")
  p.add_argument("--repeats", type=int, default=20)
  p.add_argument("--dry-run", action="store_true")
  p.add_argument("--paged", action="store_true", help="the attention over pages (docstring)")
  p.add_argument("--page-size", type=int, default=256)
  p.add_argument("--rows", type=int, default=16, help="--paged: requests in the batch")
  args = p.parse_args(argv)
  if args.rows < 2 or args.page_size < 16 or args.page_size & (args.page_size - 1):
    p.error("--rows must be >= 2 (one of them empty) and --page-size a power of two >= 16, "
            f"got {args.rows} and {args.page_size}")
  if args.paged:
    return paged(args)
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
