"""Generation speed and memory against the memory-bandwidth bound: full attention and elastic
routing at given MSRs, one device, an 8B-shaped backbone with random weights.

    python benchmarks/generate_speed.py [--model llama3_8b|qwen3_8b] [--lengths 32768 131072]
        [--msr 0.5 0.75] [--batches 1 8 32] [--new-tokens 64] [--unroll] [--peer] [--dry-run]

Per prompt length and setting ("full": every head full attention, dense cache; "MSR x":
forced gates with round(x·L·K) of the (layer, KV head) pairs streaming, chosen at random with
a fixed seed; no trained routers exist here, and what a router chose would cost the same):
  TTFT       `generate` on one prompt: prefill to the first token's logits and the filled
             cache (compiled before, timed on the second call);
  decode     tokens/s of `generate`'s device decode loop: batch 1 from that call (new tokens
             after the first); batches > 1 (B rows each holding T tokens) on a cache filled
             with random keys and values (`kv_cache.allocate`), the same loop and kernels;
  peak       device bytes at the prefill phase's and the decode loop's peak (XLA's buffer
             assignment: `aot.footprint`, weights included; the prefill's ratio also less
             the weights). Prompts longer than --prefill-chunk prefill layer by layer
             (`prefill.by_layer`), as `generate` does by default;
  bound      tokens/s if a step only read the weights and the live cache once, at the
             read bandwidth measured in this run (one jitted pass summing every
             weight array). Streaming slots count their whole sink + ring, full slots the
             keys and values up to the current position.
Batches whose cache and weights would pass 70% of the device memory are skipped. Ratios
against full attention of the same length come next; with --peer, transformers' own
generation on the same shape and lengths (peer_transformers_generate.py, run first in a
subprocess) and our rows against it; then the routers' cost: every layer's
router (pooling and both MLPs) timed alone on one prompt's keys. --dry-run shrinks everything so the
script runs on a CPU.
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

from elastic_jax.generation import aot, kv_cache  # noqa: E402
from elastic_jax import router as rt  # noqa: E402
from elastic_jax.config import config_from_hf_dict  # noqa: E402
from elastic_jax.generation.generate import (SamplingConfig, _decode_tokens, capacity_bucket,  # noqa: E402
                                  decode_impl_for, generate)
from elastic_jax.model import init_params, split_layers  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import SHAPES  # noqa: E402

GiB = 2 ** 30


def timed(fn, repeats: int) -> float:
  """Median seconds of fn() (blocked on its result) after one untimed call."""
  jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def read_bandwidth(params) -> float:
  """Bytes/s of one jitted pass that reads every weight array once (a float32 sum of each):
  the access a decode step makes, at its best."""
  f = jax.jit(lambda p: sum(jnp.sum(x, dtype=jnp.float32) for x in jax.tree.leaves(p)))
  return aot.tree_bytes(params) / timed(lambda: f(params), 10)


def step_bytes(weights: int, gates_lk: np.ndarray, batch: int, pos: int, kv_bytes_per_pos: int,
               width: int) -> int:
  """Bytes one decode step must read: every weight once (the embedding row apart) and each
  row's live cache (full slots up to the position, streaming slots their whole width)."""
  full = int(gates_lk.sum()) * batch
  stream = gates_lk.size * batch - full
  return weights + kv_bytes_per_pos * (full * (pos + 1) + stream * width)


def decode_batch(params, cfg, rcfg, gates_lk, batch, length, steps, impl, unroll, dtype,
                 extra_bytes):
  """(tokens/s, peak bytes) of the device decode loop over `batch` rows of `length` tokens,
  on a cache of random keys and values; `params` as `generate` passes them (split or not),
  extra_bytes: weights that stay resident besides (the stacked copy when split)."""
  gates = np.broadcast_to(gates_lk[:, None], (cfg.num_layers, batch, cfg.num_kv_heads))
  capacity = capacity_bucket(length + steps + 1)

  def fill(i, shape, dt):
    return jax.random.normal(jax.random.key(10 + i), shape, dt)

  cache = kv_cache.allocate(gates, capacity, rcfg.streaming, cfg.head_dim, dtype, fill)
  tok = jnp.zeros((batch,), jnp.int32)
  lengths = jnp.full((batch,), length, jnp.int32)
  limits = jnp.full((batch,), steps + 1, jnp.int32)
  static = dict(cfg=cfg, rcfg=rcfg, steps=steps, temperature=0.0, top_p=1.0, unroll=unroll,
                impl=impl, keep_logits=False)

  def args(cache):
    return (params, cache, tok, jnp.ones_like(tok), jnp.zeros((batch,), bool), jax.random.key(0),
            lengths, limits, jnp.asarray([-1], jnp.int32))

  run, _ = aot.compiled(_decode_tokens, args(cache), static)
  peak = aot.footprint(run)
  peak = None if peak is None else peak + extra_bytes
  times = []
  for _ in range(3):
    t0 = time.perf_counter()
    out = run(*args(cache))
    jax.block_until_ready(out)
    times.append(time.perf_counter() - t0)
    cache = out[1]
  return batch * steps / statistics.median(times[1:]), peak


def prefill_chunk_arg(text: str) -> int | None:
  """--prefill-chunk: 'none' or a positive integer."""
  if text == "none":
    return None
  if not text.isdigit() or int(text) < 1:
    raise argparse.ArgumentTypeError(f"expected 'none' or an integer >= 1, got {text!r}")
  return int(text)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", choices=sorted(SHAPES), default="llama3_8b")
  p.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
  p.add_argument("--msr", type=float, nargs="+", default=[0.5, 0.75])
  p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
  p.add_argument("--new-tokens", type=int, default=64)
  p.add_argument("--unroll", action="store_true", help="unroll the decode step's layer loop")
  p.add_argument("--layer-loop", choices=("split", "scan"), default="split",
                 help="decode over a per-layer copy of the weights (generate's default where "
                      "it fits) or a scan over the stacked weights")
  p.add_argument("--attn-impl", default="auto")
  p.add_argument("--prefill-chunk", default=8192, type=prefill_chunk_arg,
                 help="generate's prefill_chunk: prompts longer than this prefill layer by "
                      "layer, the MLP this many tokens at a time; 'none': in one call")
  p.add_argument("--peer", action="store_true",
                 help="also run transformers' generate on the same shape first "
                      "(peer_transformers_generate.py, a subprocess; needs torch and CUDA)")
  p.add_argument("--routers-only", action="store_true",
                 help="time only the routers of every layer at each --lengths")
  p.add_argument("--dry-run", action="store_true")
  args = p.parse_args(argv)
  peer = run_peer(args) if args.peer and not args.dry_run else {}
  hf = dict(SHAPES[args.model], max_position_embeddings=max(args.lengths) + 1024)
  rcfg = rt.RouterConfig()
  if args.dry_run:
    hf.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=512,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    args.lengths = sorted({min(n, 300) for n in args.lengths})
    args.new_tokens = min(args.new_tokens, 8)
    rcfg = rt.RouterConfig(block=16, local_blocks=4)
    args.prefill_chunk = None if args.prefill_chunk is None else 128
  chunk = args.prefill_chunk
  cfg = config_from_hf_dict(hf, f"{args.model} shape")
  dtype = jnp.float32 if args.dry_run else jnp.bfloat16
  if args.routers_only:
    print(f"{args.model}: {cfg.num_layers} layers, {cfg.num_kv_heads} KV heads; "
          f"{jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    for t in args.lengths:
      router_overhead(cfg, rcfg, t, dtype)
    return
  params = init_params(cfg, jax.random.key(0), jnp.dtype(dtype).name)
  l, k = cfg.num_layers, cfg.num_kv_heads
  weights = aot.tree_bytes(params)
  read_weights = weights - (0 if cfg.tie_word_embeddings else params["embed"].nbytes)
  kv_per_pos = 2 * cfg.head_dim * jnp.dtype(dtype).itemsize
  width = kv_cache.stream_width(rcfg.streaming)
  impl = "reference" if args.dry_run else args.attn_impl
  dev = jax.devices()[0]
  free = (dev.memory_stats() or {}).get("bytes_limit")
  bw = read_bandwidth(params)
  print(f"{args.model}: {l} layers, {cfg.num_heads}/{k} heads, weights {weights / GiB:.2f} GiB; "
        f"{dev.device_kind}, jax {jax.__version__}; read bandwidth {bw / 1e12:.2f} TB/s; "
        f"decode attention {decode_impl_for(impl)}; {args.new_tokens} new tokens; "
        f"layer loop {args.layer_loop}{' unrolled' if args.unroll else ''}; prefill chunk "
        f"{chunk}", flush=True)
  rng = np.random.default_rng(0)
  settings = [("full", np.ones((l, k), np.float32))]
  for m in args.msr:
    g = np.ones(l * k, np.float32)
    g[rng.permutation(l * k)[:round(m * l * k)]] = 0.0
    settings.append((f"MSR {1 - g.mean():.2f}", g.reshape(l, k)))
  layers_bytes = aot.tree_bytes(params["layers"])
  step_params, extra = params, 0
  if args.layer_loop == "split":
    step_params, extra = split_layers(params), layers_bytes
  results = {}
  for t in args.lengths:
    prompt = [rng.integers(0, cfg.vocab_size, t).tolist()]
    for name, gates in settings:
      kw = (dict(attention="full") if name == "full"
            else dict(attention="forced", gates=gates))
      run = lambda: generate(params, cfg, prompt, rcfg=rcfg, attn_impl=impl,
                             unroll_decode=args.unroll, layer_loop=args.layer_loop,
                             prefill_chunk=chunk,
                             sampling=SamplingConfig(max_new_tokens=args.new_tokens), **kw)
      t0 = time.perf_counter()
      run()
      first = time.perf_counter() - t0
      gen = run()
      n_new = len(gen.tokens[0])
      row = {"ttft": gen.prefill_seconds, "cache": gen.cache_bytes,
             "prefill_peak": gen.info["prefill_peak_bytes"], "prefill": gen.info["prefill"],
             "decode": {1: (n_new - 1) / gen.decode_seconds},
             "decode_peak": {1: gen.info["decode_peak_bytes"]}, "bound": {}}
      mid = t + n_new // 2
      for bsz in args.batches:
        row["bound"][bsz] = bsz * bw / step_bytes(read_weights, gates, bsz, mid, kv_per_pos,
                                                  width)
        if bsz == 1:
          continue
        need = weights + extra + gen.cache_bytes * bsz
        row["decode"][bsz] = row["decode_peak"][bsz] = None
        if free and need > 0.7 * free:
          continue
        try:
          row["decode"][bsz], row["decode_peak"][bsz] = decode_batch(
              step_params, cfg, rcfg, gates, bsz, t, args.new_tokens,
              decode_impl_for(impl), args.unroll, dtype, extra)
        except jax.errors.JaxRuntimeError as e:
          if "RESOURCE_EXHAUSTED" not in str(e):
            raise
          print(f"  B={bsz}: out of device memory ({need / GiB:.0f} GiB of weights and cache)")
      results[(t, name)] = row
      gib = lambda x: "n/a" if x is None else f"{x / GiB:.1f}"
      dec = "  ".join(
          f"B={b_}: " + ("skipped (memory)" if row["decode"][b_] is None else
                         f"{row['decode'][b_]:7.1f} tok/s ({row['decode'][b_] / row['bound'][b_]:.0%}"
                         f" of {row['bound'][b_]:.0f}), peak {gib(row['decode_peak'][b_])} GiB")
          for b_ in args.batches)
      print(f"T={t:>7} {name:<9} TTFT {row['ttft']:7.3f} s  prefill ({row['prefill']}) peak "
            f"{gib(row['prefill_peak'])} GiB  cache {row['cache'] / GiB:.2f} GiB  {dec}  "
            f"[first call {first:.1f} s]", flush=True)
  print("\nratios against full attention of the same length (batch 1 unless named):")
  for t in args.lengths:
    base = results[(t, "full")]
    for name, _ in settings[1:]:
      r = results[(t, name)]
      peak = ("n/a" if not (r["prefill_peak"] and base["prefill_peak"]) else
              f"{r['prefill_peak'] / base['prefill_peak']:.2f}x (less the weights "
              f"{(r['prefill_peak'] - weights) / (base['prefill_peak'] - weights):.2f}x)")
      batch = ", ".join(
          f"B={b_} {r['decode'][b_] / r['decode'][1]:.1f}x B=1" for b_ in args.batches[1:]
          if r["decode"].get(b_))
      print(f"T={t:>7} {name:<9} decode {r['decode'][1] / base['decode'][1]:.2f}x  TTFT "
            f"{r['ttft'] / base['ttft']:.2f}x  prefill peak {peak}  cache "
            f"{r['cache'] / base['cache']:.2f}x  ({batch})")
  for t, row in sorted(peer.items()):
    ours = results[(t, "full")]
    line = (f"T={t:>7} transformers {row['transformers']} (torch {row['torch']}, SDPA, dynamic "
            f"cache), batch 1: TTFT {row['ttft']:.3f} s, decode {row['decode']:.1f} tok/s, "
            f"prefill peak {row['prefill_peak'] / GiB:.1f} GiB; ours against it:")
    for name, _ in settings:
      r = results[(t, name)]
      line += (f"\n    {name:<9} decode {r['decode'][1] / row['decode']:.2f}x  TTFT "
               f"{r['ttft'] / row['ttft']:.2f}x")
    print(line + f"\n    (full's prefill peak {ours['prefill_peak'] / row['prefill_peak']:.2f}x "
          "theirs)" if ours["prefill_peak"] else line)
  router_overhead(cfg, rcfg, max(args.lengths), dtype)


def run_peer(args) -> dict:
  """transformers' generation on the same shape and lengths, in a subprocess that ends before
  JAX takes the device: {length: its JSON row}."""
  import json
  import subprocess
  script = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                        "peer_transformers_generate.py")
  done = subprocess.run(
      [sys.executable, script, "--model", args.model, "--new-tokens", str(args.new_tokens),
       "--lengths", *map(str, args.lengths)], capture_output=True, text=True)
  if done.returncode:       # reported, and the rest of the run goes on without the peer
    print(f"the transformers peer failed (exit {done.returncode}): "
          f"{(done.stderr.strip().splitlines() or [''])[-1]}", flush=True)
  rows = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
  print("peer: " + "; ".join(json.dumps(r) for r in rows), flush=True)
  return {r["length"]: r for r in rows}


def router_overhead(cfg, rcfg, length: int, dtype, segments: int = 16) -> None:
  """The routers of every layer (pooling and both MLPs) timed alone on one row of keys: one
  input per row read by its boundary tokens (`pool_prompt_prefix`), the same row through the
  packed pooling (`pool_prompt`), and a row packing `segments` inputs of equal length, each
  with its own routing slot, as in packed training."""
  l, k = cfg.num_layers, cfg.num_kv_heads
  router = rt.init_router_params(cfg, rcfg, jax.random.key(1))
  keys = jax.random.normal(jax.random.key(2), (l, 1, length, k, cfg.head_dim), dtype)
  seg = jnp.ones((1, length), jnp.int32)
  pos = jnp.arange(length, dtype=jnp.int32)[None]
  each = length // segments
  seg_p = jnp.minimum(jnp.arange(length) // each + 1, segments)[None].astype(jnp.int32)
  pos_p = (jnp.arange(length) - (seg_p[0] - 1) * each)[None].astype(jnp.int32)
  prompt_p = pos_p < (3 * each) // 4
  for name, slots, pool in (
      ("boundary tokens, 1 input", 2, lambda x: rt.pool_prompt_prefix(x, seg, seg > 0, rcfg, 2)),
      ("packed pooling, 1 input", 2, lambda x: rt.pool_prompt(x, seg, pos, seg > 0, rcfg, 2)),
      (f"packed pooling, {segments} inputs", segments + 1,
       lambda x: rt.pool_prompt(x, seg_p, pos_p, prompt_p, rcfg, segments + 1))):
    routers = jax.jit(lambda router, keys: jax.vmap(
        lambda r, x: rt.gate_from_logits(rt.router_logits(r, pool(x)), rcfg)[0])(router, keys))
    print(f"routers of all {l} layers at T={length} ({name}): "
          f"{timed(lambda: routers(router, keys), 10) * 1e3:.3f} ms (median of 10; the paper "
          f"reports about 0.2 ms)", flush=True)


if __name__ == "__main__":
  main()
