"""XAttention heads on the GPU: block scoring and block-sparse attention against full heads,
dense cuDNN and the streaming mode, side by side in one run.

    python benchmarks/xattention.py [--lengths 32768 131072] [--focus 0.5 1 1.5 2]
        [--inputs structured|noise] [--threshold 0.9] [--train-lengths 16384]
        [--chunk-blocks 32 128 256] [--scoring-only]
    python benchmarks/xattention.py --dry-run          # CPU smoke test, tiny shapes, interpret

Shape: B = 1, 32 query / 8 KV heads, head_dim 128, bf16 (the Llama-3.1-8B attention); XA stride
16, block 128; SSA sink 1 + local 16 blocks of 128.

Inputs. i.i.d. normal q and k (--inputs noise) have nearly flat attention, so XAttention keeps
~0.9 of the blocks by construction. The default --inputs structured draws inputs with the
structure of a language model's attention (`structured_inputs`): an attention sink at token 0,
topic segments of 512 tokens whose keys share a direction, queries that look for their own
segment's topic and, per query block and head, one earlier segment's (retrieval), and RoPE
(theta 5e5) over both, which favours nearby keys. --focus scales the queries: larger values
give peakier attention and sparser selections, so the kept density d spans a range (at
T = 16384, threshold 0.9, on a CPU, `--density-only --lengths 16384 --focus 0.25 0.5 1 2 4`:
d = 0.88, 0.83, 0.65, 0.11, 0.04 of the causal pairs; i.i.d. noise 0.905). These are
synthetic inputs, not a model's activations (`benchmarks/xattention_density.py` measures d on
a model's own).

Per length and focus, every head in the same mode:
  cuDNN causal         jax.nn.dot_product_attention(implementation="cudnn", is_causal=True)
  ours full            our inference kernel, every head full (the Mosaic GPU forward on a
                       Hopper GPU, else Triton): the time XA heads are held against
  ours SSA             every head streaming
  XA scoring (Mosaic)  the Mosaic GPU scoring kernel + selection (`xattention.select`,
                       "mosaic_gpu"; a Hopper GPU, where it applies)
  XA scoring (Triton)  the Triton scoring kernel + selection ("pallas_gpu")
  XA scoring (jnp)     the plain-jnp scoring + selection ("reference")
  XA attention Triton  the Triton kernel with the FA-XA patterns, every head XA, kept blocks
  XA attention Mosaic  the Mosaic GPU forward walking the kept-block lists (where it applies)
  XA total             the fastest scoring + the faster XA attention
At each length's first focus (the scoring's time does not depend on the inputs), outside XA
total: the jnp scoring in its loop of tiles ("looped", `XAttention(unroll_chunks=0)`; the
default, up to 16 chunks, scores each chunk's causal prefix in one product), and with
--chunk-blocks in chunks (and tiles) of that many blocks (`XAttention.chunk_blocks`; the
default 64 is the row "XA scoring (jnp)"), and with --scoring-tiles the Mosaic GPU scoring
kernel in other tiles (`mosaic_gpu.Tiles`' score_rows x score_cols x score_depth x
score_slots).
--scoring-only times just the scoring rows beside ours full at each length (no check, no
attention rows).
Then the targets: XA total <= (d + 0.1) x ours full, and XA total faster than cuDNN causal
wherever d <= 0.6. Times are medians of --reps calls after two warm-ups; a ratio is cuDNN's
time over the row's (> 1: faster than dense). At the first length the XA kernels' outputs are
checked against the float32 reference on the same kept blocks, and the scoring kernels' block
masses and selections against the jnp ones.

Training (--train-lengths, the first --focus): gradients of q, k, v (and the gate) with every
head sparse, through the Triton kernels (SSA, and XA on the kept blocks under "fa-xa"); on a
Hopper GPU also through the Mosaic GPU training kernels (SSA, XA, XA at every gate 0.5, after
a check of their gradients against the Triton kernels'), and the Triton kernels at gates 0.5.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import re
import statistics
import sys
import time

if "--dry-run" in sys.argv:
  # The Mosaic GPU kernels' interpret mode runs each warpgroup in its own host thread, blocked
  # at barriers while another one works: XLA's CPU client needs threads to spare (as the
  # tests' conftest.py sets it).
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from elastic_jax.attention import Streaming, mosaic_gpu, on_hopper  # noqa: E402
from elastic_jax.attention.mosaic_gpu import scoring as mosaic_gpu_scoring  # noqa: E402
from elastic_jax.attention.pallas_gpu import hybrid_forward, xa_hybrid_forward  # noqa: E402
from elastic_jax.attention.reference import dense_hybrid_attention, hybrid_attention  # noqa: E402
from elastic_jax.attention.xattention import (  # noqa: E402
    XAttention, block_mass, block_mass_pallas, forced_blocks, kept_fraction, select,
    select_blocks)
from elastic_jax.attention.mosaic_gpu.scoring import block_mass_mosaic  # noqa: E402

SEGMENT = 512          # tokens per topic segment of the structured inputs
ROPE_THETA = 5e5


def timed(fn, *args, reps: int):
  for _ in range(2):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def _rope(x_thd, positions):
  """Rotate-half RoPE of x [T, H, D] at `positions` [T] (theta ROPE_THETA)."""
  d = x_thd.shape[-1]
  inv = ROPE_THETA ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)
  ang = positions[:, None].astype(jnp.float32) * inv[None]
  cos, sin = (jnp.concatenate([f(ang)] * 2, -1)[:, None] for f in (jnp.cos, jnp.sin))
  rotated = jnp.concatenate([-x_thd[..., d // 2:], x_thd[..., :d // 2]], axis=-1)
  return x_thd * cos + rotated * sin


@jax.jit(static_argnames=("t", "n", "kh", "d", "dtype"))
def structured_inputs(key, focus, *, t: int, n: int, kh: int, d: int, dtype):
  """q [1, T, N, D], k and v [1, T, K, D] with a language model's attention structure (module
  docstring): sink, topic segments, retrieval of one earlier segment per query block and head,
  RoPE. Unit-norm directions are scaled to sqrt(D), so that a matching query and key score
  about `focus` x sqrt(D) before the softmax scale."""
  g = n // kh
  ks = jax.random.split(key, 7)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True) * math.sqrt(d)
  nseg = -(-t // SEGMENT)
  pos = jnp.arange(t)
  seg = pos // SEGMENT
  topics = unit(jax.random.normal(ks[0], (nseg, kh, d)))
  sink = unit(jax.random.normal(ks[1], (kh, d)))
  k = 0.5 * jax.random.normal(ks[2], (t, kh, d)) + topics[seg]
  k = k.at[0].add(2.0 * sink)
  # Retrieval: per query block of 128 and query head, one segment at or before its own.
  blocks = -(-t // 128)
  pick = jax.random.uniform(ks[3], (blocks, kh, g))
  target = jnp.floor(pick * (seg[::128][:, None, None] + 1)).astype(jnp.int32)   # [nb, K, G]
  target = jnp.repeat(target, 128, axis=0)[:t]                                      # [T, K, G]
  recalled = jnp.take_along_axis(topics[None, :, :, None, :].repeat(t, 0),
                                 target[:, None, :, :, None], axis=1)[:, 0]         # [T, K, G, D]
  own = topics[seg][:, :, None]
  q = (0.5 * own + 0.5 * recalled + 0.3 * sink[None, :, None]
       + 0.5 * jax.random.normal(ks[4], (t, kh, g, d)))
  q = _rope((focus * q).reshape(t, n, d), pos)
  k = _rope(k, pos)
  v = jax.random.normal(ks[5], (t, kh, d))
  return tuple(x[None].astype(dtype) for x in (q, k, v))


def noise_inputs(key, focus, *, t: int, n: int, kh: int, d: int, dtype):
  """i.i.d. normal q (times `focus`), k and v."""
  keys = jax.random.split(key, 3)
  q = (focus * jax.random.normal(keys[0], (1, t, n, d), jnp.float32)).astype(dtype)
  k, v = (jax.random.normal(kk, (1, t, kh, d), jnp.float32).astype(dtype) for kk in keys[1:])
  return q, k, v


def _select_mosaic(q, k, *, xa, tiles, interpret):
  """`select` with the Mosaic GPU scoring kernel in other tiles."""
  mass = block_mass_mosaic(q, k, xa, tiles=tiles, interpret=interpret)
  return select_blocks(mass, xa.threshold, forced_blocks(q.shape[1], xa, batch=q.shape[0]))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
  p.add_argument("--focus", "--sharpness", type=float, nargs="+", default=[0.5, 1.0, 1.5, 2.0],
                 dest="focus", help="query scale (see the module docstring)")
  p.add_argument("--inputs", choices=("structured", "noise"), default="structured")
  p.add_argument("--threshold", type=float, default=0.9)
  p.add_argument("--train-lengths", type=int, nargs="*", default=[16384],
                 help="forward+backward (training) at these lengths, the first --focus")
  p.add_argument("--chunk-blocks", type=int, nargs="*", default=[],
                 help="also time the jnp scoring with chunks of these many blocks")
  p.add_argument("--scoring-tiles", nargs="*", default=[], metavar="RxCxDxS",
                 help="also time the Mosaic GPU scoring kernel in these tiles")
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--dry-run", action="store_true")
  p.add_argument("--density-only", action="store_true",
                 help="print the kept density per length and focus, nothing timed (any device)")
  p.add_argument("--scoring-only", action="store_true",
                 help="time only the scoring's forms at each length (the first --focus)")
  args = p.parse_args(argv)
  if min(args.lengths + args.train_lengths + args.chunk_blocks) < 1 or args.reps < 1:
    p.error("--lengths, --train-lengths, --chunk-blocks and --reps must be positive")
  n, kh, d = 32, 8, 128
  xa = XAttention(stride=16, block=128, threshold=args.threshold)
  st = Streaming(1, 16, 128)
  dtype = jnp.bfloat16
  interpret = args.dry_run
  if args.dry_run:   # tiny, but in the Mosaic kernel's layout (head_dim 64, blocks of 128)
    n, kh, d = 4, 2, 64
    st = Streaming(1, 1, 128)
    args.lengths = sorted({min(x, 384) for x in args.lengths})
    args.focus = args.focus[:2]
    args.reps = 2
  make_inputs = functools.partial(structured_inputs if args.inputs == "structured"
                                  else noise_inputs, n=n, kh=kh, d=d, dtype=dtype)
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; {n}/{kh} heads, D={d}, "
        f"{jnp.dtype(dtype).name}; XA stride {xa.stride}, block {xa.block}, threshold "
        f"{xa.threshold}; {args.inputs} inputs", flush=True)
  zeros, ones = jnp.zeros((1, kh), jnp.float32), jnp.ones((1, kh), jnp.float32)
  mosaic = mosaic_gpu.applies((1, 1, n, d), (1, 1, kh, d), dtype, st) and (
      on_hopper() or args.dry_run)
  mosaic_xa = mosaic and mosaic_gpu.xa_applies((1, 1, n, d), (1, 1, kh, d), dtype, st, xa.block)
  cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, implementation="xla" if args.dry_run else "cudnn"))
  # The gates are arguments of the jitted calls, as in a model, not constants the compiler
  # could plan the heads' walks on.
  if mosaic:
    forward = jax.jit(lambda q, k, v, gate: mosaic_gpu.hybrid_forward_hard(
        q, k, v, gate, st, interpret=interpret))
  else:
    forward = jax.jit(lambda q, k, v, gate: hybrid_forward(q, k, v, gate, st,
                                                           interpret=interpret))
  full, ssa = (functools.partial(forward, gate=g) for g in (ones, zeros))
  score_triton = jax.jit(lambda q, k: select(q, k, xa, attn_impl="pallas_gpu"))
  score_jnp = jax.jit(lambda q, k: select(q, k, xa, attn_impl="reference"))
  mosaic_scoring = mosaic_gpu_scoring.applies((1, 1, n, d), (1, 1, kh, d), dtype, xa) and (
      on_hopper() or args.dry_run)
  score_mosaic = jax.jit(lambda q, k: select(q, k, xa, attn_impl="mosaic_gpu"))
  scorings = {"XA scoring (Triton)": score_triton, "XA scoring (jnp)": score_jnp} | (
      {"XA scoring (Mosaic)": score_mosaic} if mosaic_scoring else {})
  for spec in args.scoring_tiles:
    if not re.fullmatch(r"[1-9]\d*(x[1-9]\d*){3}", spec):
      p.error(f"--scoring-tiles {spec}: expected ROWSxCOLSxDEPTHxSLOTS, e.g. 64x256x64x3")
  for spec in args.scoring_tiles if mosaic_scoring else ():
    rows, cols, depth, slots = map(int, spec.split("x"))
    tiles = mosaic_gpu.Tiles(score_rows=rows, score_cols=cols, score_depth=depth,
                             score_slots=slots)
    if not mosaic_gpu_scoring.applies((1, 1, n, d), (1, 1, kh, d), dtype, xa, tiles):
      p.error(f"the Mosaic GPU scoring kernel does not take tiles {spec}")
    scorings[f"XA scoring (Mosaic {spec})"] = jax.jit(functools.partial(
        _select_mosaic, xa=xa, tiles=tiles, interpret=interpret))
  # The jnp scoring's other forms: its loop of tiles at any length (`XAttention.unroll_chunks`
  # = 0; by default up to 16 chunks score their causal prefixes without a loop), and with
  # chunks and tiles of --chunk-blocks blocks.
  score_forms = {"looped": dataclasses.replace(xa, unroll_chunks=0)} | {
      f"{c}-block chunks": dataclasses.replace(xa, chunk_blocks=c) for c in args.chunk_blocks}
  score_forms = {name: jax.jit(lambda q, k, x=x: select(q, k, x, attn_impl="reference"))
                 for name, x in score_forms.items()}
  xa_triton = functools.partial(jax.jit(lambda q, k, v, keep, gate: xa_hybrid_forward(
      q, k, v, gate, keep, st, patterns="fa-xa", xa_block=xa.block, interpret=interpret)),
      gate=zeros)
  xa_mosaic = functools.partial(jax.jit(lambda q, k, v, keep, gate: mosaic_gpu.xa_forward_hard(
      q, k, v, gate, keep, st, patterns="fa-xa", xa_block=xa.block, interpret=interpret)),
      gate=zeros)
  checked = False
  verdicts = []
  if args.scoring_only:   # no attention, no check: the scoring forms against ours full
    for t in args.lengths:
      q, k, v = make_inputs(jax.random.key(t), args.focus[0], t=t)
      rows = {"ours full": timed(full, q, k, v, reps=args.reps)} | {
          name: timed(fn, q, k, reps=args.reps) for name, fn in scorings.items()}
      for name, fn in score_forms.items():
        rows[f"XA scoring (jnp, {name})"] = timed(fn, q, k, reps=args.reps)
      print(f"\nT={t}, scoring only")
      width = max(map(len, rows))
      for name, sec in rows.items():
        share = sec / rows["ours full"]
        print(f"  {name:<{width}} {sec * 1e3:9.2f} ms   {share:5.3f} of ours full")
      sys.stdout.flush()
    return
  for t in args.lengths:
    for focus in args.focus:
      q, k, v = make_inputs(jax.random.key(t), focus, t=t)
      keep = score_jnp(q, k)
      density = float(kept_fraction(keep, jnp.asarray([t]), xa.block).mean())
      if args.density_only:
        print(f"T={t}, focus {focus:g}: XA density d = {density:.3f} of the causal pairs",
              flush=True)
        continue
      if not checked:
        checked = True
        mass_j = block_mass(q, k, xa)
        kernels = {"Triton": (block_mass_pallas(q, k, xa, interpret=interpret), score_triton)}
        if mosaic_scoring:
          kernels["Mosaic"] = (block_mass_mosaic(q, k, xa, interpret=interpret), score_mosaic)
        masses = "; ".join(
            f"{name}: max |diff| {float(jnp.abs(mass - mass_j).max()):.2e}, selections agree "
            f"on {float((keep == fn(q, k)).mean()):.4%} of blocks"
            for name, (mass, fn) in kernels.items())
        up = [x.astype(jnp.float32) for x in (q, k, v)]
        if t <= 8192 or args.dry_run:
          want = dense_hybrid_attention(*up, zeros, st, patterns="fa-xa", xa_keep=keep,
                                        xa_block=xa.block)
        else:
          want = hybrid_attention(*up, jnp.zeros((1, t, kh)), st, patterns="fa-xa",
                                  xa_keep=keep, xa_block=xa.block)
        rel = lambda got: float(jnp.linalg.norm(got.astype(jnp.float32) - want)
                                / jnp.linalg.norm(want))
        errs = f"Triton {rel(xa_triton(q, k, v, keep)):.2e}"
        if mosaic_xa:
          errs += f", Mosaic {rel(xa_mosaic(q, k, v, keep)):.2e}"
        print(f"check at T={t}: block masses against the jnp scoring's, {masses}; XA attention "
              f"vs float32 reference rel. error: {errs}", flush=True)
      rows = {"cuDNN causal": timed(cudnn, q, k, v, reps=args.reps),
              "ours full": timed(full, q, k, v, reps=args.reps),
              "ours SSA": timed(ssa, q, k, v, reps=args.reps)} | {
          name: timed(fn, q, k, reps=args.reps) for name, fn in scorings.items()
          if focus == args.focus[0] or "Mosaic " not in name}
      rows["XA attention Triton"] = timed(xa_triton, q, k, v, keep, reps=args.reps)
      if mosaic_xa:
        rows["XA attention Mosaic"] = timed(xa_mosaic, q, k, v, keep, reps=args.reps)
      if focus == args.focus[0]:
        for name, fn in score_forms.items():
          rows[f"XA scoring (jnp, {name})"] = timed(fn, q, k, reps=args.reps)
      scoring = min(rows[name] for name in ("XA scoring (Mosaic)", "XA scoring (Triton)",
                                            "XA scoring (jnp)") if name in rows)
      attention = min(sec for name, sec in rows.items() if name.startswith("XA attention"))
      rows["XA total"] = total = scoring + attention
      base = rows["cuDNN causal"]
      print(f"\nT={t}, focus {focus:g}: XA density d = {density:.3f} of the causal pairs")
      width = max(map(len, rows))
      for name, sec in rows.items():
        print(f"  {name:<{width}} {sec * 1e3:9.2f} ms   {base / sec:6.2f}x cuDNN   "
              f"{sec / rows['ours full']:5.2f} of ours full")
      share = total / rows["ours full"]
      verdicts.append(f"T={t} focus {focus:g} d={density:.2f}: XA total {share:.2f} of ours "
                      f"full (target <= {density + 0.1:.2f}: "
                      f"{'met' if share <= density + 0.1 else 'NOT met'})"
                      + (f"; vs cuDNN causal {base / total:.2f}x ("
                         f"{'faster' if total < base else 'NOT faster'}, target at d <= 0.6)"
                         if density <= 0.6 else ""))
      sys.stdout.flush()
  if args.density_only:
    return
  print("\ntargets:")
  for line in verdicts:
    print("  " + line)

  # Training: gradients of sum(out * cot) w.r.t. q, k, v (and the gate for ours), every head
  # sparse (r = 0): SSA, and XA on the kept blocks (fa-xa); both compute O_FA as well, which
  # the gate's gradient needs.
  from elastic_jax.attention.pallas_gpu import make_hybrid
  hybrid, xa_fn = make_hybrid(), make_hybrid(xa=True)
  # The Mosaic GPU training kernels (the library's default there) on a Hopper GPU where they take
  # the layout; not in a dry run (several Mosaic kernels in one computation stall the
  # interpreter).
  mosaic_train = (not args.dry_run and on_hopper()
                  and mosaic_gpu.xa_trains((1, 1, n, d), (1, 1, kh, d), dtype, st, xa.block))
  if mosaic_train:
    hybrid_m = mosaic_gpu.make_hybrid(training="mosaic")
    xa_m = mosaic_gpu.make_hybrid(training="mosaic", xa=True)
  if args.dry_run:
    args.train_lengths = sorted({min(x, 384) for x in args.train_lengths})

  def grads(fn, n_args):
    return jax.jit(jax.grad(lambda cot, *a: jnp.sum(fn(*a).astype(jnp.float32) * cot),
                            argnums=tuple(range(1, n_args + 1))))

  for t in args.train_lengths:
    q, k, v = make_inputs(jax.random.key(t + 1), args.focus[0], t=t)
    cot = jax.random.normal(jax.random.key(t + 2), q.shape, jnp.float32)
    keep = score_jnp(q, k)
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
    if mosaic_train:
      xa_grads = grads(lambda q, k, v, g: xa_m(q, k, v, g, keep, st, "fa-xa", xa.block, False), 4)
      half = jnp.full((1, kh), 0.5, jnp.float32)
      triton = grads(lambda q, k, v, g: xa_fn(q, k, v, g, keep, st, "fa-xa", xa.block, False), 4)
      rel = lambda a, b: float(jnp.linalg.norm((a - b).astype(jnp.float32))
                               / jnp.linalg.norm(b.astype(jnp.float32)))
      print("  check: Mosaic XA training gradients at gates 0.5 against the Triton kernels': "
            + ", ".join(f"{name} rel {rel(a, b):.2e}" for name, a, b in zip(
                ("dq", "dk", "dv", "dgate"), xa_grads(cot, q, k, v, half),
                triton(cot, q, k, v, half))))
      rows += [("ours SSA Mosaic", timed(grads(lambda q, k, v, g: hybrid_m(q, k, v, g, st, False),
                                               4), cot, q, k, v, zeros, reps=args.reps)),
               ("XA Mosaic", timed(xa_grads, cot, q, k, v, zeros, reps=args.reps)),
               ("XA Mosaic, gates 0.5", timed(xa_grads, cot, q, k, v, half, reps=args.reps)),
               ("XA Triton, gates 0.5", timed(triton, cot, q, k, v, half, reps=args.reps))]
    for name, sec in rows:
      print(f"  {name:<22} {sec * 1e3:9.2f} ms   {rows[0][1] / sec:6.2f}x cuDNN")
    sys.stdout.flush()


if __name__ == "__main__":
  main()
