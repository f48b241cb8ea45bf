"""Shared by the Mosaic GPU kernel tests (test_mosaic_gpu*.py): inputs, packed rows, kept
XAttention blocks, and whether the kernels run natively or in GPU interpret mode."""

import jax
import jax.numpy as jnp
import numpy as np

INTERPRET = jax.default_backend() != "gpu"
TOL = {jnp.bfloat16: 3e-2, jnp.float16: 5e-3}


def schedule_id(x):
  """Test ids naming the Mosaic forward's schedule ("chain", the default; "plain", neither
  chain nor overlap; "overlap", "persistent", "multicast", "qreg", "overlap-persistent":
  `pytest -k overlap` picks the overlapped schedule's cases); None for other parameters
  (pytest's own ids). A bool parameter means overlap or the default."""
  if isinstance(x, bool):
    return "overlap" if x else "chain"
  if hasattr(x, "overlap"):
    names = [n for n, on in (("overlap", x.overlap), ("persistent", x.persistent),
                             ("multicast", x.multicast), ("qreg", x.q_registers),
                             ("chain", x.chain)) if on]
    return "-".join(names) or "plain"
  return None


def qkv(b, t, n, k, d, dtype, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  return tuple(jax.random.normal(kk, (b, t, h, d), jnp.float32).astype(dtype)
               for kk, h in zip(keys, (n, k, k)))


def packed_row(lengths, gates_of_segment, k):
  seg = np.concatenate([[i + 1] * n for i, n in enumerate(lengths)]).astype(np.int32)
  pos = np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)
  gate = np.stack([np.broadcast_to(gates_of_segment[s - 1], (k,)) for s in seg])
  return jnp.asarray(seg[None]), jnp.asarray(pos[None]), jnp.asarray(gate[None], jnp.float32)


def kept_blocks(b, k, t, xa_block, seed):
  """Random kept blocks with the diagonal (XAttention always keeps it), some above it too:
  the kernel must ignore those as the reference does."""
  nb = -(-t // xa_block)
  keep = jax.random.bernoulli(jax.random.key(seed), 0.4, (b, k, nb, nb))
  return keep | jnp.eye(nb, dtype=bool)[None, None]
