"""Serving many long requests at once: the continuous-batching engine over the paged per-head
cache (elastic_jax.generation.engine), full attention against elastic at fixed budgets.

    python benchmarks/serve.py [--model llama3_8b] [--lengths 32768 131072] [--new-tokens 256]
        [--msr 0.5 0.75] [--rates 0.05 0.1 0.2] [--stream-requests 24] [--page-size 256]
        [--max-batch 64] [--memory-fraction 0.9] [--decode-impl auto] [--prefill-layers 0 4]
        [--peer] [--dry-run]
        [--json results.json]

The backbone has the published shapes of --model with random bf16 weights. "full" keeps every
head full; "MSR m" forces round(m·L·K) of the (layer, KV head) pairs to streaming, chosen at
random with a fixed seed, for every request (what trained routers decide per request at its
prefill; forced gates make the budget exact). Each setting gets its own engine, whose page
pool takes --memory-fraction of the memory free once the weights are in.

1. Offline throughput, per prompt length: as many requests as the pool holds (each reserves
   the pages of its prompt and --new-tokens), submitted together with random prompts; output
   tokens/s over the whole run (prefills included), the largest number decoding at once and
   the peak device memory.
2. A mixed stream: --stream-requests requests with prompt lengths log-uniform over 8K-128K
   (rounded to 8K, so that prefills compile once per length before timing) and outputs of
   128-512 tokens, arriving as a Poisson process at each of --rates requests/s: time to
   first token and time per output token (p50, p99), output tokens/s, requests in flight;
   once per --prefill-layers value (0: each prefill runs whole when admitted, the others'
   decoding waits for it; n: n layers of prefill between two decode steps).
3. Batch-1 decode through the engine against the bandwidth bound (every weight and the live
   cache read once per token at the measured read bandwidth).
4. --peer: transformers' own generate on the same shape (benchmarks/peer_transformers_generate.py,
   a subprocess before JAX takes the device), batch 1 at each --lengths.

Times exclude compilation: every prefill length and the decode step run once untimed first.
--dry-run shrinks the model and lengths and makes arrivals 100 times faster, so that the
script runs on a CPU in about a minute (a pool of --num-pages pages there: a CPU reports no
free memory).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import numpy as np

from elastic_jax.errors import ElasticJaxError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import SHAPES  # noqa: E402

GiB = 2 ** 30


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", choices=sorted(SHAPES), default="llama3_8b")
  p.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
  p.add_argument("--new-tokens", type=int, default=256)
  p.add_argument("--msr", type=float, nargs="+", default=[0.5, 0.75])
  p.add_argument("--rates", type=float, nargs="*", default=[0.05, 0.1, 0.2],
                 help="arrival rates of the mixed stream, requests/s (none: no stream)")
  p.add_argument("--stream-requests", type=int, default=24)
  p.add_argument("--page-size", type=int, default=256)
  p.add_argument("--max-batch", type=int, default=64, help="rows of the decode step")
  p.add_argument("--max-requests", type=int, default=256,
                 help="offline: at most this many requests per length and setting")
  p.add_argument("--memory-fraction", type=float, default=0.9)
  p.add_argument("--num-pages", type=int, help="the pool in pages (instead of a fraction)")
  p.add_argument("--decode-impl", default="auto", help="the engine's attention over pages")
  p.add_argument("--prefill-layers", type=int, nargs="+", default=[0],
                 help="the mixed stream once per value: 0 prefills whole at admission, n "
                      "interleaves n layers of prefill per decode step")
  p.add_argument("--peer", action="store_true", help="transformers' generate, batch 1")
  p.add_argument("--json", help="write every figure here")
  p.add_argument("--dry-run", action="store_true")
  args = p.parse_args(argv)
  if args.new_tokens < 2 or args.stream_requests < 1 or args.max_batch < 1:
    raise ElasticJaxError("--new-tokens must be >= 2, --stream-requests and --max-batch >= 1")
  if any(n < 0 for n in args.prefill_layers):
    raise ElasticJaxError("--prefill-layers values are >= 0 (0: prefills run whole)")
  if any(not 0 <= m < 1 for m in args.msr) or any(r <= 0 for r in args.rates):
    raise ElasticJaxError("--msr values lie in [0, 1) and --rates are > 0")
  return args


def percentile(xs, q):
  return float(np.percentile(np.asarray(xs, np.float64), q)) if xs else float("nan")


class Clock:
  """Per request: submit, first token and end times, and its output tokens."""

  def __init__(self):
    self.submitted, self.first, self.done, self.tokens = {}, {}, {}, {}

  def see(self, events, now):
    for e in events:
      rid = e.request.id
      self.first.setdefault(rid, now)
      self.tokens[rid] = self.tokens.get(rid, 0) + len(e.tokens)
      if e.finished:
        self.done[rid] = now

  def ttft(self):
    return [self.first[r] - self.submitted[r] for r in self.done]

  def tpot(self):
    return [(self.done[r] - self.first[r]) / (self.tokens[r] - 1) for r in self.done
            if self.tokens[r] > 1]


def make_engine(params, cfg, rcfg, gates, args):
  from elastic_jax.generation.engine import Engine
  pool = (dict(num_pages=args.num_pages) if args.num_pages
          else dict(memory_fraction=args.memory_fraction))
  how = (dict(attention="full") if gates is None
         else dict(attention="forced", gates=gates))
  return Engine(params, cfg, rcfg=rcfg, page_size=args.page_size, max_batch=args.max_batch,
                attn_impl="reference" if args.dry_run else "auto",
                decode_impl="reference" if args.dry_run else args.decode_impl,
                prefill_chunk=None if args.dry_run else 8192, **pool, **how)


def warm(engine, lengths, vocab, rng):
  """Every prefill length and the decode step compiled once (a 2-token request each)."""
  for t in sorted(set(lengths)):
    engine.submit(rng.integers(0, vocab, t).tolist(), max_new_tokens=2)
    engine.run()


def offline(engine, t, args, vocab, rng):
  """As many requests of t tokens as the pool holds, submitted together."""
  per = engine.tables.need(engine.known_full, t + args.new_tokens - 1)   # Request.positions
  n = max(1, min(args.max_requests, engine.num_pages // per))
  reqs = [engine.submit(rng.integers(0, vocab, t).tolist(), max_new_tokens=args.new_tokens)
          for _ in range(n)]
  busiest, t0 = 0, time.perf_counter()
  for _ in engine.events():
    busiest = max(busiest, sum(r is not None for r in engine.rows))
  wall = time.perf_counter() - t0
  out = sum(len(r.tokens) for r in reqs)
  return {"requests": n, "pages_each": per, "wall_s": wall, "tokens_per_s": out / wall,
          "most_decoding": busiest}


def stream(engine, rate, args, vocab, rng, lengths, outs):
  """Poisson arrivals at `rate`/s of the given (prompt length, output length) pairs."""
  gaps = rng.exponential(1.0 / rate, len(lengths))
  arrive = np.cumsum(gaps) - gaps[0]
  clock, pending, inflight = Clock(), list(range(len(lengths))), []
  t0 = time.perf_counter()
  while pending or not engine.idle:
    now = time.perf_counter() - t0
    while pending and arrive[pending[0]] <= now:
      i = pending.pop(0)
      r = engine.submit(rng.integers(0, vocab, lengths[i]).tolist(), max_new_tokens=outs[i])
      clock.submitted[r.id] = now
    if engine.idle:
      time.sleep(max(0.0, arrive[pending[0]] - now))
      continue
    events = engine.step()
    now = time.perf_counter() - t0
    clock.see(events, now)
    inflight.append(sum(r is not None for r in engine.rows) + len(engine.queue))
  wall = time.perf_counter() - t0
  ttft, tpot = clock.ttft(), clock.tpot()
  return {"rate": rate, "wall_s": wall, "tokens_per_s": sum(clock.tokens.values()) / wall,
          "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
          "tpot_p50": percentile(tpot, 50), "tpot_p99": percentile(tpot, 99),
          "in_flight_mean": float(np.mean(inflight)) if inflight else 0.0}


def batch_one(engine, t, args, vocab, rng):
  """One request alone: its decode tokens/s (tokens after the first over their time)."""
  clock = Clock()
  r = engine.submit(rng.integers(0, vocab, t).tolist(), max_new_tokens=args.new_tokens)
  clock.submitted[r.id] = 0.0
  t0 = time.perf_counter()
  for e in engine.events():
    clock.see([e], time.perf_counter() - t0)
  return 1.0 / statistics.median(clock.tpot())


def main(argv=None) -> int:
  args = parse_args(argv)         # before jax and the model load: bad input fails at once
  import jax
  import jax.numpy as jnp

  from elastic_jax.config import config_from_hf_dict
  from elastic_jax.generation import aot
  from elastic_jax.generation.kv_cache import stream_width
  from elastic_jax.model import init_params
  from elastic_jax.router import RouterConfig
  from generate_speed import read_bandwidth, run_peer, step_bytes
  peer = run_peer(args) if args.peer and not args.dry_run else {}
  hf = dict(SHAPES[args.model], max_position_embeddings=max(max(args.lengths), 131072) + 1024)
  rcfg = RouterConfig()
  lo, hi, bucket = 8192, 131072, 8192
  if args.dry_run:
    hf.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=512,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=1024)
    rcfg = RouterConfig(block=16, local_blocks=4)
    args.lengths = sorted({min(n, 256) for n in args.lengths})
    args.new_tokens, args.stream_requests = min(args.new_tokens, 8), min(args.stream_requests, 4)
    args.page_size, args.max_batch = 16, min(args.max_batch, 4)
    args.num_pages = args.num_pages or 256
    args.rates = [100 * r for r in args.rates]      # the same stream, 100 times faster
    lo, hi, bucket = 64, 256, 64
  cfg = config_from_hf_dict(hf, f"{args.model} shape")
  dtype = jnp.float32 if args.dry_run else jnp.bfloat16
  params = init_params(cfg, jax.random.key(0), jnp.dtype(dtype).name)
  dev = jax.devices()[0]
  l, k = cfg.num_layers, cfg.num_kv_heads
  weights = aot.tree_bytes(params)
  bw = read_bandwidth(params)
  print(f"{args.model}: {l} layers, {cfg.num_heads}/{k} heads, weights {weights / GiB:.2f} GiB; "
        f"{dev.device_kind}, jax {jax.__version__}; read bandwidth {bw / 1e12:.2f} TB/s; "
        f"pages of {args.page_size} tokens, decode over pages {args.decode_impl}", flush=True)
  rng = np.random.default_rng(0)
  settings = [("full", None)]
  for m in args.msr:
    g = np.ones(l * k, np.float32)
    g[rng.permutation(l * k)[:round(m * l * k)]] = 0.0
    settings.append((f"MSR {1 - g.mean():.2f}", g.reshape(l, k)))
  n = args.stream_requests
  s_len = np.minimum(hi, np.maximum(lo, np.round(np.exp(rng.uniform(
      np.log(lo), np.log(hi), n)) / bucket) * bucket)).astype(int)
  s_out = rng.integers(128 if not args.dry_run else 2, (512 if not args.dry_run else 8) + 1, n)
  kv_per_pos = 2 * cfg.head_dim * jnp.dtype(dtype).itemsize
  read_weights = weights - (0 if cfg.tie_word_embeddings else params["embed"].nbytes)
  results = {"model": args.model, "device": dev.device_kind, "jax": jax.__version__,
             "page_size": args.page_size, "decode_impl": args.decode_impl, "peer": peer,
             "settings": {}}
  for name, gates in settings:
    engine = make_engine(params, cfg, rcfg, gates, args)
    row = results["settings"][name] = {"pool_pages": engine.num_pages, "offline": {},
                                       "stream": [], "batch1": {}}
    print(f"\n{name}: a pool of {engine.num_pages} pages "
          f"({engine.num_pages * args.page_size * kv_per_pos * 1.0 / GiB:.1f} GiB)", flush=True)
    warm(engine, list(args.lengths) + (list(s_len) if args.rates else []), cfg.vocab_size, rng)
    gl = np.ones((l, k)) if gates is None else gates
    for t in args.lengths:
      r = row["offline"][t] = offline(engine, t, args, cfg.vocab_size, rng)
      b1 = batch_one(engine, t, args, cfg.vocab_size, rng)
      bound = bw / step_bytes(read_weights, gl, 1, t + args.new_tokens // 2, kv_per_pos,
                              stream_width(rcfg.streaming))
      row["batch1"][t] = {"tokens_per_s": b1, "bound": bound}
      print(f"  T={t:>7} offline: {r['requests']} requests ({r['pages_each']} pages each), "
            f"{r['tokens_per_s']:,.0f} output tokens/s, at most {r['most_decoding']} "
            f"decoding at once; batch 1: {b1:.1f} tokens/s = {b1 / bound:.0%} of the "
            f"bandwidth bound", flush=True)
    warmed = 0
    for rate, layers in ((r, n) for n in args.prefill_layers for r in args.rates):
      engine.prefill_layers = layers or None          # the engine is idle between streams
      if layers != warmed:                            # the other prefill path compiled
        warm(engine, list(s_len), cfg.vocab_size, rng)
        warmed = layers
      r = stream(engine, rate, args, cfg.vocab_size, rng, s_len, s_out)
      r["prefill_layers"] = layers
      row["stream"].append(r)
      how = f"{layers} layers of prefill a step" if layers else "prefills whole"
      print(f"  stream at {rate:g}/s, {how}: {r['tokens_per_s']:,.0f} output tokens/s, in flight "
            f"{r['in_flight_mean']:.1f}; TTFT p50 {r['ttft_p50']:.2f} s p99 "
            f"{r['ttft_p99']:.2f} s; TPOT p50 {r['tpot_p50'] * 1e3:.1f} ms p99 "
            f"{r['tpot_p99'] * 1e3:.1f} ms", flush=True)
    stats = dev.memory_stats() or {}
    row["peak_bytes"] = stats.get("peak_bytes_in_use")
    del engine
    gc.collect()
  full = results["settings"]["full"]
  print("\nagainst full attention, same run:")
  for name, row in results["settings"].items():
    if name == "full":
      continue
    for t in args.lengths:
      print(f"  {name}, T={t}: offline output tokens/s "
            f"{row['offline'][t]['tokens_per_s'] / full['offline'][t]['tokens_per_s']:.2f}x "
            f"(pool holds {row['offline'][t]['requests']} requests against "
            f"{full['offline'][t]['requests']})")
  for t, p in peer.items():
    ours = full["batch1"].get(int(t))
    if ours:
      print(f"  transformers generate, T={t}: decode {p['decode']:.1f} tokens/s; the engine's "
            f"full-attention batch 1 {ours['tokens_per_s'] / p['decode']:.2f}x it")
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(results, f, indent=1, default=float)
  return 0


if __name__ == "__main__":
  from elastic_jax.cli import run_cli
  sys.exit(run_cli(main))
