"""How near the float32 reference the gate's gradient under XAttention ("fa-xa") comes on the
Triton and the Mosaic GPU training kernels, beside dq, dk and dv: one run, both kernels on the
same inputs, kept blocks and cotangent.

    python benchmarks/xa_gate_precision.py [--length 1024] [--focus 0.5]

Shape: B = 1, 4 query / 2 KV heads, head_dim 64, bf16, SSA sink 1 + local 1 block of 128;
structured inputs (`xattention.structured_inputs`), kept blocks from the jnp selection (stride
16, blocks of 128, threshold 0.9), every gate 0.5. The gate's gradient sums dO . (O_FA - O_XA)
over the rows, which cancels where the kept blocks hold most of the mass, so the precision of
the kernels' bf16 outputs shows there first. On a CPU both kernels run in interpret mode (the
Mosaic one eagerly, kernel by kernel; a few minutes at 2K tokens); on a Hopper GPU natively.
Prints each gradient's relative error against the reference, the kernels against each other,
and the gate's gradient per KV head.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from xattention import structured_inputs  # noqa: E402

from elastic_jax import hybrid_attention  # noqa: E402
from elastic_jax.attention import Streaming, mosaic_gpu, pallas_gpu  # noqa: E402
from elastic_jax.attention.xattention import XAttention, kept_fraction, select  # noqa: E402


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--length", type=int, default=1024)
  p.add_argument("--focus", type=float, default=0.5)
  args = p.parse_args(argv)
  if args.length < 256 or args.length % 128:
    p.error(f"--length {args.length}: a multiple of 128 of at least 256 is needed")
  t, n, kh, d = args.length, 4, 2, 64
  st, xa = Streaming(1, 1, 128), XAttention()
  interpret = jax.default_backend() != "gpu"
  q, k, v = structured_inputs(jax.random.key(t + 1), args.focus, t=t, n=n, kh=kh, d=d,
                              dtype=jnp.bfloat16)
  keep = select(q, k, xa, attn_impl="reference")
  gate = jnp.full((1, kh), 0.5, jnp.float32)
  cot = jax.random.normal(jax.random.key(7), q.shape, jnp.float32).astype(jnp.bfloat16)
  density = float(kept_fraction(keep, jnp.asarray([t]), xa.block).mean())
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; T={t}, {n}/{kh} heads, D={d}, "
        f"bf16, focus {args.focus}: XA density {density:.3f}, gates 0.5", flush=True)

  def grads(fn, dtype):
    out, vjp = jax.vjp(fn, *(x.astype(dtype) for x in (q, k, v)), gate)
    return vjp(cot.astype(out.dtype))

  want = grads(lambda *x: hybrid_attention(*x, sink_blocks=1, local_blocks=1, block=128,
                                           patterns="fa-xa", xa_keep=keep, xa_block=xa.block),
               jnp.float32)
  triton_fn = pallas_gpu.make_hybrid(xa=True)
  triton = grads(lambda *x: triton_fn(*x, keep, st, "fa-xa", xa.block, interpret), jnp.bfloat16)
  mosaic_fn = mosaic_gpu.make_hybrid(training="mosaic", xa=True)
  with jax.disable_jit(interpret):   # the GPU interpreter runs one Mosaic kernel at a time
    mosaic = grads(lambda *x: mosaic_fn(*x, keep, st, "fa-xa", xa.block, interpret),
                   jnp.bfloat16)
  rel = lambda a, b: float(jnp.linalg.norm(a.astype(jnp.float32) - b.astype(jnp.float32))
                           / jnp.linalg.norm(b.astype(jnp.float32)))
  for i, name in enumerate(("dq", "dk", "dv", "dgate")):
    print(f"  {name:6s} Triton vs reference {rel(triton[i], want[i]):.2e}, Mosaic vs reference "
          f"{rel(mosaic[i], want[i]):.2e}, Mosaic vs Triton {rel(mosaic[i], triton[i]):.2e}")
  fmt = lambda x: ", ".join(f"{v:+.4f}" for v in x.reshape(-1).tolist())
  print(f"  gate's gradient per KV head: reference {fmt(want[3])}; Triton {fmt(triton[3])}; "
        f"Mosaic {fmt(mosaic[3])}")


if __name__ == "__main__":
  main()
