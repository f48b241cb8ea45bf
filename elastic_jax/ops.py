"""Public operators."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from elastic_jax.attention import HYBRID_IMPLS, Streaming
from elastic_jax.errors import ElasticJaxError


def hybrid_attention(q: jax.Array, k: jax.Array, v: jax.Array, gate: jax.Array, *,
                     sink_blocks: int = 1, local_blocks: int = 16, block: int = 128,
                     impl: str = "reference", segment_ids: jax.Array | None = None,
                     positions: jax.Array | None = None, setting: str = "fa-ssa",
                     xa_keep: jax.Array | None = None, xa_block: int = 128,
                     **impl_kwargs) -> jax.Array:
  """Elastic attention: O = r * O_FA + (1 - r) * O_SSA for each KV head.

  Args:
    q: [B, T, Hq, D]; k, v: [B, T, Hkv, D] with Hq a multiple of Hkv (GQA).
    gate: r in [0, 1], [B, Hkv] (or [B, T, Hkv] for packed inputs whose segments route
      differently); 1 = full causal attention, 0 = streaming (sink + local blocks).
    sink_blocks, local_blocks, block: the streaming pattern (SPEC.md section 3); any T.
    impl: "reference" (plain jnp, memory-safe), "pallas_gpu" or "pallas_tpu" (the fused
      kernels; `interpret=True` runs them on CPU), "mosaic_gpu" (pallas_gpu with a Hopper
      inference forward in Mosaic GPU), or "auto" (the kernel for this backend, the
      reference on CPU).
    segment_ids, positions: [B, T] packed segments and positions within them (optional).
    setting: "fa-ssa"; "fa-xa" (r = 0 heads attend only XAttention's kept blocks) or "xa-ssa"
      (r = 1 heads do), with xa_keep [B, Hkv, nb, nb] bool the kept blocks of xa_block tokens
      (`elastic_jax.attention.xattention.select`).
  Differentiable in q, k, v and gate (the kept blocks are constants).
  """
  if impl not in HYBRID_IMPLS:
    raise ElasticJaxError(f"hybrid attention impl '{impl}' is unknown (known: "
                          f"{', '.join(sorted(HYBRID_IMPLS))})")
  b, t = q.shape[:2]
  hkv = k.shape[2]
  if gate.shape == (b, hkv):
    gate = jnp.broadcast_to(gate[:, None, :], (b, t, hkv))
  elif gate.shape != (b, t, hkv):
    raise ElasticJaxError(f"gate has shape {list(gate.shape)}; expected [B, Hkv] = "
                          f"{[b, hkv]} or [B, T, Hkv] = {[b, t, hkv]}")
  if setting != "fa-ssa":
    if xa_keep is None:
      raise ElasticJaxError(f"setting '{setting}' needs the kept XAttention blocks (xa_keep)")
    impl_kwargs.update(setting=setting, xa_keep=xa_keep, xa_block=xa_block)
  return HYBRID_IMPLS[impl](q, k, v, gate, Streaming(sink_blocks, local_blocks, block),
                            segment_ids, positions, **impl_kwargs)
