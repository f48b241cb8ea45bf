"""Router training speed and memory on an 8B-shaped backbone at long context, one device.

    python benchmarks/train_router.py [--model llama3_8b|qwen3_8b] [--seq-len 65536]
        [--steps 4] [--attn-impl auto] [--packed] [--profile] [--top-buffers N] [--dry-run]
    python benchmarks/train_router.py --layout packed ...     # one layout only

The backbone has the published shapes of Llama-3.1-8B or Qwen3-8B (the config dicts below,
read through the same allow-list as a real `config.json`) with random bf16 weights: no
weights are downloaded, and speed does not depend on their values. One row of --seq-len
tokens per step, 3/4 of each sample prompt, the rest answer; the routers start at the neutral
init. Layouts: "unpacked", one sample per row (`train.packed=false`); "packed", the paper's
recipe (`train.packed=true`): samples of 8K-64K tokens (log-uniform, like the authors' SFT
mix) packed into the row, the rest padding, segment ids and positions through the packed
kernels. --packed runs both, each in its own process (so that each peak memory is its own),
and prints them side by side. It times --steps optimizer steps after
a compiling one and prints tokens/s, the step time and the device's peak memory, beside the
authors' figure from ANCHORS (≈2.1K tokens/s per A800 for an 8B backbone at 64K; another
machine and another day: a reference point, not a side-by-side comparison).
--dry-run shrinks everything to a few layers and 512 tokens so the script runs on a CPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import statistics
import time

# An 8B backbone at 64K tokens needs ~100 GiB of temporaries: let XLA take 95% of the device
# rather than its default 75% (set the variable to override).
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
# --top-buffers and --profile ask XLA for its optimised HLO and buffer assignment of the train
# step, which only a flag set before jax starts can do.
_DUMP = None
if "--top-buffers" in sys.argv or "--profile" in sys.argv:
  import tempfile
  _DUMP = tempfile.mkdtemp(prefix="train_step_hlo_")
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={_DUMP}"
                             " --xla_dump_hlo_module_re=.*train_step.* --xla_dump_hlo_as_text")

import jax  # noqa: E402
import jax.numpy as jnp
import numpy as np

from elastic_jax.config import config_from_hf_dict
from elastic_jax.model import init_params
from elastic_jax.router import RouterConfig
from elastic_jax.train.objective import ObjectiveConfig
from elastic_jax.train.step import TrainConfig, init_train_state, train_step
from elastic_jax.train.synthetic import TASKS, synthetic_batch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import SHAPES  # noqa: E402



def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", choices=sorted(SHAPES), default="llama3_8b")
  p.add_argument("--seq-len", type=int, default=65536)
  p.add_argument("--steps", type=int, default=4)
  p.add_argument("--attn-impl", default="auto")
  p.add_argument("--packed", action="store_true",
                 help="run the unpacked and the packed layout, side by side")
  p.add_argument("--layout", choices=("unpacked", "packed"), default="unpacked")
  p.add_argument("--no-remat", action="store_true")
  p.add_argument("--mlp-chunk", type=int, default=0, metavar="TOKENS",
                 help="model.mlp_chunk: each layer's MLP this many tokens at a time, each "
                      "chunk rematerialised (0: whole rows)")
  p.add_argument("--top-buffers", type=int, default=0, metavar="N",
                 help="print the N largest buffers of XLA's buffer assignment of the step, "
                      "with the operation that produces each")
  p.add_argument("--profile", action="store_true",
                 help="trace one more step and split its device time by part of the model "
                      "(attention, router, MLP, loss, optimizer, the rest) and by phase "
                      "(forward, remat's recomputation, backward): benchmarks/xprof.py")
  p.add_argument("--dry-run", action="store_true", help="tiny shapes, runs on a CPU")
  args = p.parse_args(argv)
  if args.mlp_chunk < 0:
    p.error(f"--mlp-chunk must be >= 0 (0: whole rows), got {args.mlp_chunk}")
  if args.packed:
    return compare_layouts(argv)
  hf = dict(SHAPES[args.model])
  block, local = 128, 16
  if args.dry_run:
    hf.update(hidden_size=128, intermediate_size=256, num_hidden_layers=2, vocab_size=1024,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    args.seq_len, block, local = min(args.seq_len, 512), 16, 4
  cfg = config_from_hf_dict(hf, f"{args.model} shape")
  rcfg = RouterConfig(block=block, local_blocks=local)
  packed = args.layout == "packed"
  tcfg = TrainConfig(steps=1000, packed=packed)
  remat = not args.no_remat
  ocfg = ObjectiveConfig()
  dev = jax.devices()[0]
  print(f"{args.model}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_heads}/{cfg.num_kv_heads} heads, vocab {cfg.vocab_size}; T={args.seq_len}, "
        f"attn {args.attn_impl}, layout {args.layout}, remat={remat}, "
        f"MLP chunk {args.mlp_chunk or 'none'}; "
        f"{dev.device_kind}, jax {jax.__version__}", flush=True)

  t0 = time.perf_counter()
  backbone = jax.jit(lambda key: init_params(cfg, key, "bfloat16"))(jax.random.key(0))
  state = init_train_state(cfg, rcfg, tcfg, jax.random.key(1))
  jax.block_until_ready(backbone)
  print(f"random backbone: {sum(x.size for x in jax.tree.leaves(backbone)) / 1e9:.2f} B "
        f"parameters in {time.perf_counter() - t0:.1f}s", flush=True)

  t = args.seq_len
  if packed:
    lo = 64 if args.dry_run else 8192
    batch, lengths = packed_batch(t, lo, cfg.vocab_size)
    print(f"packed row: segments of {lengths} tokens, {t - sum(lengths)} padding", flush=True)
  else:
    batch = synthetic_batch(0, 1, t, cfg.vocab_size, prompt_frac=0.75, max_segments=2)
  batch = {k: jnp.asarray(v) for k, v in batch.items()}
  kw = dict(cfg=cfg, rcfg=rcfg, ocfg=ocfg, tcfg=tcfg, attn_impl=args.attn_impl, remat=remat,
            mlp_chunk=args.mlp_chunk)

  t0 = time.perf_counter()
  state, m = train_step(state, backbone, batch, **kw)
  jax.block_until_ready(m["loss"])
  print(f"first step (compiles): {time.perf_counter() - t0:.1f}s, loss {float(m['loss']):.3f}",
        flush=True)
  times = []
  for _ in range(args.steps):
    t0 = time.perf_counter()
    state, m = train_step(state, backbone, batch, **kw)
    jax.block_until_ready(m["loss"])
    times.append(time.perf_counter() - t0)
  sec = statistics.median(times)
  stats = dev.memory_stats() or {}
  peak = stats.get("peak_bytes_in_use")
  real = int((batch["segment_ids"] > 0).sum())
  print(f"RESULT {args.layout} {real / sec:.0f} {0 if peak is None else peak / 2**30:.1f}")
  print(f"step {sec * 1e3:.0f} ms (median of {len(times)}), {real / sec:,.0f} tokens/s "
        f"(real tokens), "
        f"MSR {float(m['msr']):.2f}, peak device memory "
        f"{'n/a' if peak is None else f'{peak / 2**30:.1f} GiB'}")
  if args.top_buffers and _DUMP:
    print_top_buffers(_DUMP, args.top_buffers)
  if args.profile:
    import tempfile
    import xprof
    trace_dir = tempfile.mkdtemp(prefix="train_step_trace_")
    with jax.profiler.trace(trace_dir):
      state, m = train_step(state, backbone, batch, **kw)
      jax.block_until_ready(m["loss"])
    print("profile of one step (jax.profiler; benchmarks/xprof.py):")
    split = xprof.print_split(xprof.device_ops(trace_dir, "train_step"),
                              xprof.hlo_origins(_DUMP, "train_step"))
    print("PROFILE " + " ".join(f"{k}={v:.2f}" for k, v in split.items()))
  print(f"reference point (ANCHORS, another machine): authors ≈2.1K tokens/s per A800 at 64K; "
        f"ratio {real / sec / 2100:.2f}")


def print_top_buffers(dump_dir: str, n: int) -> None:
  """The n largest values in XLA's buffer assignment of the compiled train step (after
  optimisation): size, shape and the JAX operation (op_name metadata) that produces each."""
  import glob
  import re
  import xprof
  origin = xprof.hlo_origins(dump_dir, "train_step")
  assign = sorted(glob.glob(os.path.join(dump_dir, "*train_step*buffer-assignment.txt")))
  if not origin or not assign:
    print(f"no buffer assignment of the train step was dumped under {dump_dir}")
    return
  values = {}
  for m in re.finditer(r"value: <\d+ ([\w.-]+)(?:\{[^}]*\})? @\d+> \(size=(\d+),"
                       r"offset=\d+\): (\S+)", open(assign[-1]).read()):
    name, size, shape = m.group(1), int(m.group(2)), m.group(3)
    values[name] = max(values.get(name, (0, ""))[0], size), shape
  top = sorted(values.items(), key=lambda kv: -kv[1][0])[:n]
  print(f"the {len(top)} largest buffers of the compiled train step (XLA's buffer assignment):")
  for name, (size, shape) in top:
    print(f"  {size / 2**30:8.3f} GiB  {shape:<40} {name:<32} "
          f"{origin.get(name, '(no op_name)')[-120:]}")


def packed_batch(length: int, lo: int, vocab: int, seed: int = 0):
  """One row of `length` tokens packed with samples of lo..8*lo tokens drawn log-uniformly
  (the last cut to fit, none shorter than lo), padding after them; two task types
  alternating, 3/4 of each sample prompt. Returns (train_step's batch, sample lengths)."""
  rng = np.random.default_rng(seed)
  lengths, left = [], length
  while left >= lo:
    n = int(min(left, round(np.exp(rng.uniform(np.log(lo), np.log(8 * lo))))))
    lengths.append(n)
    left -= n
  seg = np.zeros((1, length), np.int32)
  pos = np.zeros((1, length), np.int32)
  prompt = np.zeros((1, length), bool)
  answer = np.zeros((1, length), bool)
  task = np.full((1, len(lengths) + 1), -1, np.int32)
  off = 0
  for i, n in enumerate(lengths):
    seg[0, off:off + n] = i + 1
    pos[0, off:off + n] = np.arange(n)
    prompt[0, off:off + int(0.75 * n)] = True
    answer[0, off + int(0.75 * n):off + n - 1] = True
    task[0, i + 1] = TASKS[i % 2]
    off += n
  ids = rng.integers(0, vocab, (1, length)).astype(np.int32)
  return {"input_ids": ids, "targets": np.roll(ids, -1, axis=1), "loss_mask": answer,
          "segment_ids": seg, "positions": pos, "prompt_mask": prompt,
          "task_ids": task}, lengths


def compare_layouts(argv):
  """Both layouts, each in a fresh process; their tokens/s and peak memory side by side."""
  import subprocess
  argv = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--packed"]
  results = {}
  for layout in ("unpacked", "packed"):
    proc = subprocess.run([sys.executable, __file__, *argv, "--layout", layout],
                          capture_output=True, text=True)
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr[-3000:] if proc.returncode else "")
    for line in proc.stdout.splitlines():
      if line.startswith("RESULT "):
        _, name, tps, peak = line.split()
        results[name] = (float(tps), float(peak))
    if proc.returncode:
      print(f"{layout}: failed (exit {proc.returncode})")
  if len(results) == 2:
    (u_tps, u_peak), (p_tps, p_peak) = results["unpacked"], results["packed"]
    print(f"\n| layout | tokens/s | peak memory |\n|---|---|---|\n"
          f"| unpacked, one sample per row | {u_tps:,.0f} | {u_peak:.1f} GiB |\n"
          f"| packed, the paper's mix | {p_tps:,.0f} | {p_peak:.1f} GiB |\n"
          f"packed / unpacked tokens/s: {p_tps / u_tps:.2f}x (target: packed >= 5,000)")
  return 0 if len(results) == 2 else 1


if __name__ == "__main__":
  sys.exit(main())
