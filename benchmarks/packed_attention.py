"""Packed rows through the fused kernels against separate rows and the reference, one run.

    python benchmarks/packed_attention.py [--dry-run]

Shape: 32 query / 8 KV heads, head_dim 128, bf16 (the Llama-3.1-8B attention); SSA = sink 1
block + local 16 blocks of 128 tokens; MSR 0.75 (in every segment 6 of the 8 KV heads
streaming, which ones drawn per segment). Cases, each timed side by side:

1. Training (gradients of sum(out * cot) w.r.t. q, k, v and the gate, both outputs of every
   head): one 64K row of eight 8K segments on the packed kernels; the same tokens as eight
   separate 8K rows (batch 8) on the unpacked kernels; the packed row on the reference.
   Targets: packed <= 1.2x the separate rows, >= 5x faster than the reference. Then the
   packed row under "fa-xa" (as in case 3) on the packed Triton kernels.
2. Inference forward: one 128K row of four 32K segments against four separate 32K rows
   (batch 4), on the Triton kernels and on the default (`auto`: the Mosaic GPU forwards on
   Hopper, packed and unpacked). Target: packed within 10% of the separate rows.
3. Inference forward under "fa-xa" (the streaming heads become XAttention heads on random
   kept blocks of 128 tokens, density 0.5, plus the blocks the selection forces): the same
   row packed on the Triton kernel and on auto's (on Hopper the Mosaic GPU forward, every
   row on its gate's pattern in one launch), and as separate rows on auto's.

With --mosaic-training (a Hopper GPU), case 1 also runs on the Mosaic GPU training kernels
(`mosaic_gpu.make_hybrid(training="mosaic", packed=True)` and `make_hybrid(training="mosaic")` for
the separate rows), after their gradients are checked against the reference's. Times
exclude compilation (medians after two warm-up calls, `attention_torch.timed`) and name the
device. Checks first, on a packed row of three segments longer than the SSA span (sink +
window; shorter ones would make full and streaming heads agree and the gate's gradient zero):
the packed kernels (Triton, and `auto`'s; plain and under "fa-xa") against the reference.
--dry-run shrinks the shapes so that the script runs on a CPU (interpret mode).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_torch import timed  # noqa: E402

from elastic_jax.attention import Streaming  # noqa: E402
from elastic_jax.attention import mosaic_gpu, pallas_gpu  # noqa: E402
from elastic_jax.attention import reference  # noqa: E402
from elastic_jax.attention import get_hybrid_attention  # noqa: E402
from elastic_jax.attention.xattention import XAttention, forced_blocks  # noqa: E402


def segments_case(n_seg, seg_len, n, k, d, msr, seed):
  """(q, k, v [1, T, .], gate [1, T, K], segment ids, positions) of one packed row, and the
  same as n_seg rows (q, k, v [n_seg, seg_len, .], gate [n_seg, K])."""
  t = n_seg * seg_len
  keys = jax.random.split(jax.random.key(seed), 3)
  q, kk, v = (jax.random.normal(key, (1, t, h, d), jnp.bfloat16)
              for key, h in zip(keys, (n, k, k)))
  rng = np.random.default_rng(seed)
  n_full = k - round(msr * k)
  gates = np.zeros((n_seg, k), np.float32)
  for s in range(n_seg):
    gates[s, rng.choice(k, n_full, replace=False)] = 1.0
  gate_btk = jnp.asarray(np.repeat(gates, seg_len, axis=0)[None])
  seg = jnp.asarray(np.repeat(np.arange(1, n_seg + 1), seg_len)[None].astype(np.int32))
  pos = jnp.asarray(np.tile(np.arange(seg_len), n_seg)[None].astype(np.int32))
  split = lambda x: x.reshape(n_seg, seg_len, *x.shape[2:])
  return (q, kk, v, gate_btk, seg, pos), (split(q), split(kk), split(v), jnp.asarray(gates))


def xa_keep_case(seg, k, xa_block, seed):
  """Kept XAttention blocks [B, K, nb, nb] of one packed row: random at density 0.5, the
  diagonal, and the blocks the selection forces (block 0, each segment's first block)."""
  b, t = seg.shape
  nb = -(-t // xa_block)
  keep = jax.random.bernoulli(jax.random.key(seed), 0.5, (b, k, nb, nb))
  return keep | jnp.eye(nb, dtype=bool) | forced_blocks(t, XAttention(block=xa_block), seg,
                                                          b)[:, None]


def grad_fn(attend):
  """jit(grad) of sum(attend(q, k, v, g, *rest) * cot) w.r.t. q, k, v and g. The rest
  (segment ids, positions, kept blocks) are arguments of the jitted call, as in a caller's
  training step: closed over, they would be constants, and the kernels' planning on them would
  be folded at compile time and left out of the times."""
  def loss(q, k, v, g, cot, *rest):
    return jnp.sum(attend(q, k, v, g, *rest).astype(jnp.float32) * cot)
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--dry-run", action="store_true", help="tiny shapes, interpret mode, CPU")
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--seconds", type=float, default=3.0)
  p.add_argument("--skip-reference", action="store_true")
  p.add_argument("--mosaic-training", action="store_true",
                 help="also train on the Mosaic GPU training kernels (Hopper only)")
  args = p.parse_args(argv)
  hopper = str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9")
  if args.mosaic_training and (args.dry_run or not hopper):
    p.error("--mosaic-training needs a Hopper GPU (several Mosaic kernels in one jitted "
            "computation stall the interpreter of a dry run)")
  interpret = args.dry_run
  n, k, d = (4, 2, 32) if args.dry_run else (32, 8, 128)
  st = Streaming(1, 4, 16) if args.dry_run else Streaming(1, 16, 128)
  train_case = (4, 64) if args.dry_run else (8, 8192)
  fwd_case = (4, 128) if args.dry_run else (4, 32768)
  dev = jax.devices()[0]
  print(f"device: {dev.device_kind}, jax {jax.__version__}; {n}/{k} heads, head_dim {d}, bf16, "
        f"SSA sink {st.sink_blocks} + local {st.local_blocks} blocks of {st.block}", flush=True)
  time_it = lambda fn: timed(fn, args.reps, 3, args.seconds)

  packed = pallas_gpu.make_hybrid(packed=True)
  unpacked = pallas_gpu.make_hybrid()
  ref = functools.partial(reference.hybrid_attention, q_chunk=1024, kv_chunk=1024)

  # Check: the packed kernel against the reference on a packed row whose segments outrun the
  # SSA span (sink + window), so that full and streaming heads differ and the gate's gradient
  # is not zero; an odd length puts segment starts inside tiles.
  check_len = (st.sink_blocks + st.local_blocks + 3) * st.block + 37
  (q, kk, v, g, seg, pos), _ = segments_case(3, check_len, n, k, d, 0.75, 0)
  up = lambda x: x.astype(jnp.float32)
  ours = packed(q, kk, v, g, seg, pos, st, interpret)
  want = ref(up(q), up(kk), up(v), g, st, seg, pos)
  auto = get_hybrid_attention("auto")
  xa_block = st.block
  keep = xa_keep_case(seg, k, xa_block, 3)
  xa = dict(patterns="fa-xa", xa_keep=keep, xa_block=xa_block)
  packed_xa = pallas_gpu.make_hybrid(packed=True, xa=True)
  want_xa = ref(up(q), up(kk), up(v), g, st, seg, pos, **xa)
  for name, out, w in (
      ("packed Triton forward", ours, want),
      ("packed auto forward", auto(q, kk, v, g, st, seg, pos, interpret=interpret), want),
      ("packed Triton forward, fa-xa", packed_xa(q, kk, v, g, seg, pos, keep, st, "fa-xa",
                                                 xa_block, interpret), want_xa),
      ("packed auto forward, fa-xa", auto(q, kk, v, g, st, seg, pos, interpret=interpret,
                                          **xa), want_xa)):
    err = float(jnp.linalg.norm(up(out) - w) / jnp.linalg.norm(w))
    print(f"check: {name} vs float32 reference, relative error {err:.2e}", flush=True)
    if not err <= 1e-2:
      raise SystemExit(f"the {name} disagrees with the reference; stopping")

  trainers = [("", packed, unpacked)]
  if args.mosaic_training:
    m_packed = mosaic_gpu.make_hybrid(training="mosaic", packed=True)
    m_unpacked = mosaic_gpu.make_hybrid(training="mosaic")
    cot0 = jax.random.normal(jax.random.key(8), q.shape, jnp.float32)
    got = grad_fn(lambda q, k, v, g, seg, pos: m_packed(q, k, v, g, seg, pos, st, False))(
        q, kk, v, g, cot0, seg, pos)
    want = grad_fn(lambda q, k, v, g, seg, pos: ref(q, k, v, g, st, seg, pos))(
        up(q), up(kk), up(v), g, cot0, seg, pos)
    errs = [float(jnp.linalg.norm(up(a) - b) / jnp.linalg.norm(b)) for a, b in zip(got, want)]
    print("check: Mosaic packed training gradients (dq, dk, dv, dgate) vs float32 reference, "
          "relative errors " + ", ".join(f"{e:.2e}" for e in errs), flush=True)
    if not all(e <= 1e-2 for e in errs):    # a NaN fails too
      raise SystemExit("the Mosaic training kernels disagree with the reference; stopping")
    trainers.append((", Mosaic training", m_packed, m_unpacked))

  rows = []
  # 1. Training mode, fwd+bwd.
  n_seg, seg_len = train_case
  (q, kk, v, g, seg, pos), (qs, ks, vs, gs) = segments_case(n_seg, seg_len, n, k, d, 0.75, 1)
  cot = jax.random.normal(jax.random.key(9), q.shape, jnp.float32)
  label = f"{n_seg} x {seg_len}"
  for tag, train_packed, train_rows in trainers:
    f_packed = grad_fn(lambda q, k, v, g, seg, pos: train_packed(q, k, v, g, seg, pos, st,
                                                                  interpret))
    f_rows = grad_fn(lambda q, k, v, g: train_rows(q, k, v, g, st, interpret))
    t_packed = time_it(lambda: jax.block_until_ready(f_packed(q, kk, v, g, cot, seg, pos)))[0]
    t_rows = time_it(lambda: jax.block_until_ready(
        f_rows(qs, ks, vs, gs, cot.reshape(qs.shape))))[0]
    rows.append((f"train fwd+bwd, one row of {label} segments (packed kernels{tag})",
                 t_packed))
    rows.append((f"train fwd+bwd, {label} as separate rows (unpacked kernels{tag})", t_rows))
    if tag:
      print(f"training{tag}: packed / separate rows {t_packed / t_rows:.2f}x", flush=True)
  t_packed, t_rows = rows[0][1], rows[1][1]
  t_ref = None
  if not args.skip_reference:
    f_ref = grad_fn(lambda q, k, v, g, seg, pos: ref(q, k, v, g, st, seg, pos))
    t_ref = time_it(lambda: jax.block_until_ready(f_ref(q, kk, v, g, cot, seg, pos)))[0]
    rows.append((f"train fwd+bwd, one row of {label} segments (reference)", t_ref))
  print(f"training: packed / separate rows {t_packed / t_rows:.2f}x (target <= 1.2x)"
        + ("" if t_ref is None else
           f"; reference / packed {t_ref / t_packed:.1f}x (target >= 5x)"), flush=True)
  # The same row under "fa-xa" on the packed Triton kernels.
  keep = xa_keep_case(seg, k, xa_block, 5)
  f_xa = grad_fn(lambda q, k, v, g, seg, pos, keep: packed_xa(
      q, k, v, g, seg, pos, keep, st, "fa-xa", xa_block, interpret))
  rows.append((f"train fwd+bwd fa-xa, one row of {label} segments (packed Triton kernels)",
               time_it(lambda: jax.block_until_ready(f_xa(q, kk, v, g, cot, seg, pos,
                                                          keep)))[0]))

  # 2. Inference forward.
  n_seg, seg_len = fwd_case
  (q, kk, v, g, seg, pos), (qs, ks, vs, gs) = segments_case(n_seg, seg_len, n, k, d, 0.75, 2)
  # Segment ids, positions and kept blocks are arguments here too (see grad_fn).
  f_packed = jax.jit(lambda q, k, v, g, seg, pos: packed(q, k, v, g, seg, pos, st, interpret))
  f_rows = jax.jit(lambda q, k, v, g: unpacked(q, k, v, g, st, interpret))
  f_auto_packed = jax.jit(lambda q, k, v, g, seg, pos: auto(q, k, v, g, st, seg, pos,
                                                            interpret=interpret))
  f_auto = jax.jit(lambda q, k, v, g: auto(
      q, k, v, jnp.broadcast_to(g[:, None, :], (g.shape[0], q.shape[1], g.shape[1])), st,
      interpret=interpret))
  t_packed = time_it(lambda: jax.block_until_ready(f_packed(q, kk, v, g, seg, pos)))[0]
  t_rows = time_it(lambda: jax.block_until_ready(f_rows(qs, ks, vs, gs)))[0]
  t_auto = time_it(lambda: jax.block_until_ready(f_auto(qs, ks, vs, gs)))[0]
  t_auto_packed = time_it(lambda: jax.block_until_ready(f_auto_packed(q, kk, v, g, seg,
                                                                      pos)))[0]
  label = f"{n_seg} x {seg_len}"
  rows += [(f"forward, one row of {label} segments (packed Triton kernel)", t_packed),
           (f"forward, {label} as separate rows (Triton kernel)", t_rows),
           (f"forward, one row of {label} segments (auto, packed)", t_auto_packed),
           (f"forward, {label} as separate rows (auto)", t_auto)]
  print(f"forward: packed / separate rows {t_packed / t_rows:.2f}x on the Triton kernels, "
        f"{t_auto_packed / t_auto:.2f}x on auto's (target <= 1.10x)", flush=True)

  # 3. Inference forward under "fa-xa", on the same row.
  keep = xa_keep_case(seg, k, xa_block, 4)
  keeps = jnp.stack([keep[0, :, i * (seg_len // xa_block):(i + 1) * (seg_len // xa_block),
                          i * (seg_len // xa_block):(i + 1) * (seg_len // xa_block)]
                     for i in range(n_seg)])     # each segment's own blocks, as separate rows
  xa = dict(patterns="fa-xa", xa_block=xa_block)
  f_triton_xa = jax.jit(lambda q, k, v, g, seg, pos, keep: packed_xa(
      q, k, v, g, seg, pos, keep, st, "fa-xa", xa_block, interpret))
  f_auto_packed_xa = jax.jit(lambda q, k, v, g, seg, pos, keep: auto(
      q, k, v, g, st, seg, pos, xa_keep=keep, interpret=interpret, **xa))
  f_auto_xa = jax.jit(lambda q, k, v, g, keeps: auto(
      q, k, v, jnp.broadcast_to(g[:, None, :], (g.shape[0], q.shape[1], g.shape[1])), st,
      xa_keep=keeps, interpret=interpret, **xa))
  t_triton_xa = time_it(lambda: jax.block_until_ready(f_triton_xa(q, kk, v, g, seg, pos,
                                                                  keep)))[0]
  t_auto_packed_xa = time_it(lambda: jax.block_until_ready(f_auto_packed_xa(
      q, kk, v, g, seg, pos, keep)))[0]
  t_auto_xa = time_it(lambda: jax.block_until_ready(f_auto_xa(qs, ks, vs, gs, keeps)))[0]
  rows += [(f"forward fa-xa, one row of {label} segments (packed Triton kernel)", t_triton_xa),
           (f"forward fa-xa, one row of {label} segments (auto, packed)", t_auto_packed_xa),
           (f"forward fa-xa, {label} as separate rows (auto)", t_auto_xa)]
  print(f"forward fa-xa: packed auto / packed Triton {t_auto_packed_xa / t_triton_xa:.2f}x, "
        f"packed / separate rows on auto's {t_auto_packed_xa / t_auto_xa:.2f}x", flush=True)
  print(f"\n| case ({dev.device_kind}) | ms |\n|---|---|")
  for name, sec in rows:
    print(f"| {name} | {sec * 1e3:.2f} |")


if __name__ == "__main__":
  main()
