"""One attention kernel alone (Mosaic GPU; with --triton a Triton training kernel), warmed up
then launched a few times: for a profiler to look at, and its time and TFLOP/s.

    python benchmarks/kernel_profile.py --kernel dq [--length 32768] [--msr 0.75 | --mixed]
        [--xa --density 0.5] [--overlap | --no-chain] [--multicast] [--q-registers]
        [--persistent 132]
    ncu --clock-control none --set full --kernel-name entry_mosaic_gpu_kernel \\
        --launch-skip 1 --launch-count 1 python benchmarks/kernel_profile.py --kernel forward \\
        --reps 2          # every Mosaic GPU kernel here is "entry_mosaic_gpu_kernel"; the name
                          # keeps XLA's own kernels out of the count (dq and dkv: the training
                          # forward's two launches come first)
    MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=dump python benchmarks/kernel_profile.py \\
        --kernel forward                                 # registers, spills, shared memory
    ncu --clock-control none --section SpeedOfLight --kernel-name regex:sdpa --launch-skip 2 \
        --launch-count 1 python benchmarks/kernel_profile.py --kernel cudnn --reps 1  # the peer
    python benchmarks/kernel_profile.py --kernel dkv --slots 2 3 4 --registers 232 240
                                     # the backward's tiles: each variant, timed interleaved
    python benchmarks/kernel_profile.py --kernel dkv --triton   # the Triton kernel instead
    python benchmarks/kernel_profile.py --kernel forward --msr 0 --length 8192 --reps 1 \
        --trace trace_dir     # each warpgroup's regions, in-kernel clocks (Tiles.trace)
    python benchmarks/kernel_profile.py --dry-run        # CPU, interpret mode, tiny shapes

Kernels (elastic_jax/attention/mosaic_gpu/, mosaic_gpu_backward.py):
  forward        the inference forward, gates of 0 or 1 (`hybrid_forward_hard`)
  xa             the same with XAttention heads walking random kept blocks of --density
                 ("fa-xa": the streaming heads become XA heads; `xa_forward_hard`)
  train_forward  the training forward: every head full, then every head streaming, with
                 log-sum-exps (`forward_train`; two launches)
  dq, dkv        the backward kernels on `forward_train`'s residuals
  cudnn          the peer beside them: cuDNN's causal forward on the same shape, every head
                 full (`jax.nn.dot_product_attention(implementation="cudnn")`; a GPU only)
  jax_mosaic     the other peer: JAX's own Mosaic GPU flash attention, causal, on the same
                 shape in float16, the one dtype it takes
                 (`jax.experimental.pallas.ops.gpu.attention_mgpu`, 64-row query blocks,
                 128-key tiles, 2 slots; a Hopper GPU only)
--overlap runs the forward kernels (forward, xa, train_forward) with FlashAttention-3's
intra-warpgroup overlap (`mosaic_gpu.Tiles(overlap=True, chain=False)`); --multicast with each
K/V tile multicast to a cluster of two programs (`Tiles.multicast`); --q-registers with
QK^T reading Q from registers (`Tiles.q_registers`); --persistent P with P persistent
programs (`Tiles.persistent`, e.g. the SM count). Without these the forward kernels run
the builders' default schedule, whose warpgroups issue QK^T and PV in one turn and await both
together (`mosaic_gpu.DEFAULT_TILES`, `Tiles.chain`); --no-chain runs the schedule with
neither chain nor overlap (`Tiles(chain=False)`), which --overlap, --multicast, --q-registers,
--persistent and --trace modify.
--slots and --registers set the backward kernels' ring slots and the compute warpgroups'
registers a thread (`mosaic_gpu.Tiles`' backward_slots and registers; the memory warpgroup
keeps the rest);
given several values, every combination is built and timed in rounds that launch each once.
--triton runs the training kernels' Triton versions instead (elastic_jax/attention/
pallas_gpu.py: `hybrid_parts`'s training forward, one launch computing both outputs of every
head, and the dQ or dK/dV kernel of `_backward_call` alone, at their default tiles); the
FLOPs are counted as for the Mosaic kernels, so the two rates compare.
--xa runs the training kernels under "fa-xa" (`xa_forward_train`, the backward kernels with
the kept-block lists): the streaming heads become XA heads on random kept blocks of --density.
Shape: B = 1, 32 query / 8 KV heads, head_dim 128, bf16; SSA sink 1 + local 16 blocks of 128.
--msr m sends the last round(m * 8) KV heads to SSA (r = 0) and the others to FA (r = 1);
--mixed sets every gate to 0.5 (training kernels only). TFLOP/s counts the matrix products the
walk needs: per visited (query, key) pair 4 D FLOPs forward, 6 D for dQ (S, dP, dQ), 8 D for
dK/dV (S, dP, dV, dK); full and mixed heads visit the causal pairs, streaming ones SSA's.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from elastic_jax.attention import Streaming, mosaic_gpu, pallas_gpu  # noqa: E402
from elastic_jax.attention.mosaic_gpu import backward as mosaic_gpu_backward  # noqa: E402
from elastic_jax.attention.common import modes_from_gate, pad_to, row_deltas  # noqa: E402
from elastic_jax.router import streaming_kept_fraction  # noqa: E402

KERNELS = ("forward", "xa", "train_forward", "dq", "dkv", "cudnn", "jax_mosaic")
FLOPS_PER_PAIR = {"forward": 4, "xa": 4, "train_forward": 4, "dq": 6, "dkv": 8, "cudnn": 4,
                  "jax_mosaic": 4}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--kernel", choices=KERNELS, default="forward")
  p.add_argument("--length", type=int, default=32768)
  p.add_argument("--msr", type=float, default=0.75)
  p.add_argument("--mixed", action="store_true", help="every gate 0.5 (training kernels)")
  p.add_argument("--density", type=float, default=0.5,
                 help="kept XA blocks (--kernel xa, --xa)")
  p.add_argument("--xa", action="store_true",
                 help="training kernels under fa-xa: streaming heads become XA heads")
  p.add_argument("--overlap", action="store_true",
                 help="forward kernels: the overlapped schedule (Tiles.overlap)")
  p.add_argument("--no-chain", action="store_true",
                 help="forward kernels: the schedule without the default's chained products "
                      "(Tiles.chain)")
  p.add_argument("--multicast", action="store_true",
                 help="forward kernels: K/V tiles multicast to clusters of two programs "
                      "(Tiles.multicast)")
  p.add_argument("--q-registers", action="store_true",
                 help="forward kernels: QK^T reads Q from registers (Tiles.q_registers)")
  p.add_argument("--persistent", type=int, default=0,
                 help="forward kernels: this many persistent programs (Tiles.persistent)")
  p.add_argument("--slots", type=int, nargs="+", default=[2],
                 help="dq, dkv: slots of the kernel's ring (several: each timed, interleaved)")
  p.add_argument("--registers", type=int, nargs="+", default=[232],
                 help="dq, dkv: registers a thread of each compute warpgroup (232 or 240)")
  p.add_argument("--triton", action="store_true",
                 help="train_forward, dq, dkv: the Triton kernels (pallas_gpu) instead")
  p.add_argument("--trace", metavar="DIR",
                 help="forward: record each warpgroup's regions of the schedule "
                      "(Tiles.trace) into DIR and summarise them; natively, walks up "
                      "to about 24K tokens, neither --overlap nor --persistent")
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--dry-run", action="store_true")
  args = p.parse_args(argv)
  if args.length < 1 or args.reps < 1 or not 0 <= args.msr <= 1 or not 0 < args.density <= 1:
    p.error("--length and --reps must be positive, --msr in [0, 1], --density in (0, 1]")
  if args.mixed and args.kernel in ("forward", "xa"):
    p.error("--mixed: the inference kernels take gates of 0 or 1 only")
  if args.xa and args.kernel in ("forward", "xa"):
    p.error("--xa is for the training kernels (--kernel xa times the inference forward)")
  schedule = (args.overlap or args.persistent or args.multicast or args.q_registers
              or args.no_chain)
  if schedule and args.kernel in ("dq", "dkv"):
    p.error("--overlap, --no-chain, --multicast, --q-registers and --persistent are schedules of "
            "the forward kernels (forward, xa, train_forward)")
  variants = [mosaic_gpu.Tiles(backward_slots=sl, registers=r)
              for sl in args.slots for r in args.registers]
  backward = args.kernel in ("dq", "dkv")
  if (args.slots != [2] or args.registers != [232]) and not (backward and not args.triton):
    p.error("--slots and --registers are tiles of the Mosaic GPU backward kernels (dq, dkv)")
  if args.triton and (args.kernel not in ("train_forward", "dq", "dkv") or args.xa
                      or schedule):
    p.error("--triton times the Triton training kernels (train_forward, dq, dkv) with neither "
            "--xa nor a Mosaic GPU schedule (--overlap, --no-chain, --multicast, --q-registers, "
            "--persistent)")
  bad = [t for t in variants if not mosaic_gpu_backward.applies(4, Streaming(1, 16, 128), t)]
  if bad:
    p.error(f"--slots {bad[0].backward_slots} --registers {bad[0].registers}: the backward kernels "
            "take 2 to 4 slots and 176 to 240 registers in steps of 8")
  if args.persistent < 0:
    p.error("--persistent must be a count of programs (0: one per work item)")
  peer = args.kernel in ("cudnn", "jax_mosaic")
  if peer and (args.dry_run or args.mixed or args.xa or schedule):
    p.error(f"--kernel {args.kernel} is a peer's causal forward on a GPU: no --dry-run, and "
            "none of --mixed, --xa, --overlap, --no-chain, --persistent, --multicast, "
            "--q-registers")
  if args.multicast and (args.persistent or args.dry_run):
    p.error("--multicast runs natively only (no --dry-run) and with one program per work item "
            "(no --persistent)")
  if args.q_registers and args.dry_run:
    p.error("--q-registers runs natively only (no --dry-run): the interpreter's matrix "
            "products read Q from shared memory")
  if args.trace and (args.kernel != "forward" or args.overlap or args.persistent
                     or args.dry_run):
    p.error("--trace records the forward kernel's schedule without overlap (--kernel "
            "forward, neither --overlap nor --persistent), natively (no --dry-run)")
  tiles = mosaic_gpu.Tiles(overlap=args.overlap, persistent=args.persistent,
                           multicast=args.multicast, q_registers=args.q_registers,
                           chain=not (backward or peer or schedule or args.trace
                                      or args.triton),
                           trace=str(Path(args.trace).resolve()) if args.trace else "")
  if args.trace:
    Path(args.trace).mkdir(parents=True, exist_ok=True)
  n, kh, d, st, t = 32, 8, 128, Streaming(1, 16, 128), args.length
  interpret = args.dry_run
  if args.dry_run:
    jax.config.update("jax_platforms", "cpu")
    n, kh, d, st, t, args.reps = 4, 2, 64, Streaming(1, 1, 128), min(t, 256), 1
  streams = round(args.msr * kh)
  gate = jnp.asarray([[0.5] * kh if args.mixed else [1.0] * (kh - streams) + [0.0] * streams],
                     jnp.float32)
  keys = jax.random.split(jax.random.key(0), 5)
  q = jax.random.normal(keys[0], (1, t, n, d), jnp.float32).astype(jnp.bfloat16)
  k, v = (jax.random.normal(kk, (1, t, kh, d), jnp.float32).astype(jnp.bfloat16)
          for kk in keys[1:3])
  # Several Mosaic kernels in one jitted computation stall the GPU interpreter: eager there.
  jit = (lambda f: f) if interpret else jax.jit

  nb = -(-t // 128)
  keep = jax.random.bernoulli(keys[3], args.density, (1, kh, nb, nb)) | jnp.eye(nb, dtype=bool)
  if args.kernel == "cudnn":
    run, operands = jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn")), (q, k, v)
  elif args.kernel == "jax_mosaic":   # attention.py's peer, on the same inputs
    from attention import jax_mosaic_causal, jax_mosaic_inputs
    run, operands = jit(jax_mosaic_causal), jax_mosaic_inputs(q, k, v)
  elif args.kernel == "forward":
    run, operands = jit(lambda q, k, v: mosaic_gpu.hybrid_forward_hard(
        q, k, v, gate, st, tiles=tiles, interpret=interpret)), (q, k, v)
  elif args.kernel == "xa":
    run, operands = jit(lambda q, k, v: mosaic_gpu.xa_forward_hard(
        q, k, v, gate, keep, st, patterns="fa-xa", xa_block=128, tiles=tiles,
        interpret=interpret)), (q, k, v)
  elif args.triton:
    forward_train = jit(lambda q, k, v: pallas_gpu.hybrid_parts()[1](q, k, v, gate, st,
                                                                     interpret))
    if args.kernel == "train_forward":
      run, operands = forward_train, (q, k, v)
    else:
      _, res = forward_train(q, k, v)
      d_out = jax.random.normal(keys[4], q.shape, jnp.float32).astype(jnp.bfloat16)
      dq_t, dkv_t = pallas_gpu.DQ_TILES.fit(t), pallas_gpu.DKV_TILES.fit(t)
      runs = [jit(lambda res, d_out: pallas_gpu._backward_call(
          res, d_out, st, interpret, dq_t, dkv_t, kernels=(args.kernel,)))]
      operands = (res, d_out)
      variants = [None]
  else:
    if args.xa:
      forward_train = jit(lambda q, k, v: mosaic_gpu.xa_forward_train(
          q, k, v, gate, keep, st, patterns="fa-xa", xa_block=128, tiles=tiles,
          interpret=interpret))
    else:
      forward_train = jit(lambda q, k, v: mosaic_gpu.forward_train(
          q, k, v, gate, st, tiles=tiles, interpret=interpret))
    if args.kernel == "train_forward":
      run, operands = forward_train, (q, k, v)
    else:
      _, (qp, kp, vp, _, o_fa, o_gap, lse_fa, lse_sa, *lists) = forward_train(q, k, v)
      d_out = jax.random.normal(keys[4], q.shape, jnp.float32).astype(jnp.bfloat16)
      d_fa, d_sa, _ = row_deltas(d_out, o_fa, o_gap, gate)
      tp = qp.shape[1]
      rows = lambda x: pad_to(x, 1, tp).transpose(0, 2, 1)
      terms = jnp.stack([lse_fa, lse_sa, rows(d_fa), rows(d_sa)], axis=2)
      flat = gate.reshape(-1)
      call = {"dq": mosaic_gpu_backward.dq_call, "dkv": mosaic_gpu_backward.dkv_call}[args.kernel]
      xa = None
      if args.xa:   # the dQ kernel reads a query block's row of the lists, dK/dV a column
        index, count, kept = lists
        terms_xa = mosaic_gpu_backward.XATerms(("full", "xa"), 128, kept.shape[-1])
        xa = (terms_xa, (index, count, kept) if args.kernel == "dq" else
              (*mosaic_gpu_backward.xa_column_lists(kept), kept))
      runs = [jit(functools.partial(call, streaming=st, tiles=bt, interpret=interpret, xa=xa))
              for bt in variants]
      operands = (qp, kp, vp, pad_to(d_out, 1, tp), terms, modes_from_gate(flat), flat)

  if not backward:
    runs = [run]
  first = None
  for run, bt in zip(runs, variants):
    for _ in range(2):
      out = jax.block_until_ready(run(*operands))
    if first is None:
      first = out
    else:   # the same products in the same order: the same gradients, bit for bit
      same = all(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(out),
                                                               jax.tree.leaves(first)))
      print(f"{bt.backward_slots} slots, {bt.registers} registers: "
            + ("bit-equal to the first variant" if same else "DIFFERS from the first variant"))
  times = [[] for _ in runs]
  for _ in range(args.reps):   # rounds that launch each variant once: the same clocks for all
    for run, spent in zip(runs, times):
      t0 = time.perf_counter()
      jax.block_until_ready(run(*operands))
      spent.append(time.perf_counter() - t0)
  causal = t * (t + 1) / 2
  kept = float(streaming_kept_fraction(jnp.asarray(t), st)) * causal
  xa_pairs = args.density * causal        # about: random blocks, and the diagonal's
  sparse_pairs = xa_pairs if args.kernel == "xa" or args.xa else kept
  visited = (kh - streams) * causal + streams * sparse_pairs
  if args.mixed or peer:
    visited = kh * causal
  if args.kernel == "train_forward":   # every head full, then every head sparse
    visited = kh * (causal + sparse_pairs)
  flops = FLOPS_PER_PAIR[args.kernel] * d * (n // kh) * visited
  for bt, spent in zip(variants if backward else [None], times):
    sec = statistics.median(spent)
    print(f"{jax.devices()[0].device_kind}: {args.kernel} T={t} "
          + ("gates 0.5" if args.mixed else "causal" if peer else f"MSR {streams / kh:g}")
          + (f", fa-xa at density {args.density:g}" if args.xa else "")
          + (", overlapped" if args.overlap else "")
          + (", chained" if tiles.chain else "")
          + (", multicast" if args.multicast else "")
          + (", Q in registers" if args.q_registers else "")
          + (f", {args.persistent} persistent programs" if args.persistent else "")
          + (", Triton" if args.triton else "")
          + (f", {bt.backward_slots} slots, {bt.registers} registers" if bt is not None else "")
          + f": {sec * 1e3:.3f} ms (median of {args.reps}), {flops / sec / 1e12:.1f} TFLOP/s"
          + (" (dry run: interpret mode, times mean nothing)" if args.dry_run else ""))
  if args.trace:
    summarise_trace(Path(args.trace))


def summarise_trace(folder: Path):
  """Prints, from the newest trace in folder (Perfetto JSON of the Mosaic GPU profiler), each
  region of `mosaic_gpu.TRACE_REGIONS`: how often the compute warpgroups entered it, its
  median length, and its share of those warpgroups' traced time."""
  files = sorted(folder.glob("*-trace.json"))
  if not files:
    print(f"trace: no trace was written to {folder}")
    return
  events = json.loads(files[-1].read_text())["traceEvents"]
  spans, open_at, bounds = {}, {}, {}
  for e in events:   # begin/end pairs per (SM, warpgroup trace), nested as a stack
    key = (e["pid"], e["tid"])
    lo, hi = bounds.get(key, (e["ts"], e["ts"]))
    bounds[key] = (min(lo, e["ts"]), max(hi, e["ts"]))
    if e["ph"] == "B":
      open_at.setdefault(key, []).append((e["name"], e["ts"]))
    elif open_at.get(key):
      name, start = open_at[key].pop()
      spans.setdefault(name, []).append(e["ts"] - start)
  traced = [bounds[k] for k in bounds if k in open_at]   # the warpgroups with regions
  total = sum(hi - lo for lo, hi in traced)
  print(f"trace {files[-1].name}: {len(traced)} warpgroups, {total / 1e3:.1f} ms of their time")
  print(f"  {'region':<10} {'count':>9} {'median us':>10} {'share':>7}")
  for name in mosaic_gpu.TRACE_REGIONS:
    d = spans.get(name, [])
    share = sum(d) / total if total else 0.0
    med = statistics.median(d) if d else 0.0
    print(f"  {name:<10} {len(d):>9} {med:>10.3f} {share:>7.1%}")


if __name__ == "__main__":
  main()
