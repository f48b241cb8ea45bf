"""Plain-jnp causal attention that stays memory-safe at long T.

The spec every kernel of this package is tested against. Queries are processed in chunks of
`q_chunk` rows (sequentially, `lax.map`), and for each query chunk the keys are streamed in
chunks of `kv_chunk` columns with an online (flash-style) softmax, so no more than a
[q_chunk, kv_chunk] score tile per head exists at once. Key chunks that lie wholly in a query
chunk's future are skipped with `lax.cond`. Each query chunk is rematerialised in the backward
pass (`jax.checkpoint`), so gradients also never hold a [T, T] matrix.

Shape letters: B batch, T tokens, N query heads, K key/value heads, G = N/K, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Finite stand-in for -inf so that fully masked tiles give exp(...) = 0, never NaN.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _chunk_size(requested: int, t: int) -> int:
  return max(1, min(requested, t))


def causal_attention(q_btnh: jax.Array, k_btkh: jax.Array, v_btkh: jax.Array,
                     segment_ids_bt: jax.Array | None = None, *, scale: float | None = None,
                     q_chunk: int = 512, kv_chunk: int = 512) -> jax.Array:
  """Causal softmax attention with GQA and optional packed segments.

  Args:
    q_btnh: queries [B, T, N, H].
    k_btkh, v_btkh: keys and values [B, T, K, H], N a multiple of K.
    segment_ids_bt: int [B, T]; a query attends only to keys of the same segment id.
      None means one segment.
    scale: score scale, default 1/sqrt(H).
    q_chunk, kv_chunk: tile sizes; they bound memory, not the result.

  Returns:
    [B, T, N, H] in the dtype of `q_btnh`. Scores and the softmax are computed in float32;
    probabilities are cast to the value dtype for the second matmul, as HF's eager path does.
  """
  b, t, n, h = q_btnh.shape
  k = k_btkh.shape[2]
  if n % k:
    raise ValueError(f"{n} query heads are not a multiple of {k} key/value heads")
  g = n // k
  scale = h ** -0.5 if scale is None else scale
  if segment_ids_bt is None:
    segment_ids_bt = jnp.zeros((b, t), jnp.int32)
  cq, ck = _chunk_size(q_chunk, t), _chunk_size(kv_chunk, t)
  nq, nk = -(-t // cq), -(-t // ck)

  def pad(x, size):
    return jnp.pad(x, [(0, 0), (0, size - t)] + [(0, 0)] * (x.ndim - 2))

  # Padded keys get segment -1 so no real query sees them; padded query rows are dropped.
  seg_k = jnp.pad(segment_ids_bt, [(0, 0), (0, nk * ck - t)], constant_values=-1)
  seg_q = pad(segment_ids_bt, nq * cq)
  q_cbqkgh = pad(q_btnh, nq * cq).reshape(b, nq, cq, k, g, h).transpose(1, 0, 2, 3, 4, 5)
  seg_q_cbq = seg_q.reshape(b, nq, cq).transpose(1, 0, 2)
  k_bskh = pad(k_btkh, nk * ck)
  v_bskh = pad(v_btkh, nk * ck)
  seg_k = seg_k.reshape(b, nk, ck)

  @jax.checkpoint
  def one_query_chunk(args):
    i, q_bqkgh, segq_bq = args
    q_pos = i * cq + jnp.arange(cq)

    def visit(carry, j):
      m_bkgq, l_bkgq, acc_bkgqh = carry
      kj = jax.lax.dynamic_slice_in_dim(k_bskh, j * ck, ck, axis=1)
      vj = jax.lax.dynamic_slice_in_dim(v_bskh, j * ck, ck, axis=1)
      segk_bs = seg_k[:, j]
      k_pos = j * ck + jnp.arange(ck)
      s = jnp.einsum("bqkgh,bskh->bkgqs", q_bqkgh, kj,
                     preferred_element_type=jnp.float32) * scale
      ok_bqs = (k_pos[None, None, :] <= q_pos[None, :, None]) & (
          segq_bq[:, :, None] == segk_bs[:, None, :])
      ok = ok_bqs[:, None, None]
      s = jnp.where(ok, s, _MASK_VALUE)
      m_new = jnp.maximum(m_bkgq, s.max(-1))
      p = jnp.where(ok, jnp.exp(s - m_new[..., None]), 0.0)
      corr = jnp.exp(m_bkgq - m_new)
      l_new = l_bkgq * corr + p.sum(-1)
      pv = jnp.einsum("bkgqs,bskh->bkgqh", p.astype(v_bskh.dtype), vj,
                      preferred_element_type=jnp.float32)
      return (m_new, l_new, acc_bkgqh * corr[..., None] + pv)

    def step(carry, j):
      # Key chunk j holds only future keys for every row of query chunk i: skip its work.
      needed = j * ck <= (i + 1) * cq - 1
      return jax.lax.cond(needed, visit, lambda c, _: c, carry, j), None

    init = (jnp.full((b, k, g, cq), _MASK_VALUE, jnp.float32),
            jnp.zeros((b, k, g, cq), jnp.float32),
            jnp.zeros((b, k, g, cq, h), jnp.float32))
    (_, l, acc), _ = jax.lax.scan(step, init, jnp.arange(nk))
    # Rows with no visible key (padding only) have l == 0; keep them finite.
    out = acc / jnp.where(l == 0, 1.0, l)[..., None]
    return out.transpose(0, 3, 1, 2, 4).astype(q_btnh.dtype)  # [B, cq, K, G, H]

  out = jax.lax.map(one_query_chunk, (jnp.arange(nq), q_cbqkgh, seg_q_cbq))
  out = out.transpose(1, 0, 2, 3, 4, 5).reshape(b, nq * cq, n, h)
  return out[:, :t]


def dense_causal_attention(q_btnh, k_btkh, v_btkh, segment_ids_bt=None, *, scale=None):
  """The textbook [T, T] version: for tests and short inputs only."""
  b, t, n, h = q_btnh.shape
  k = k_btkh.shape[2]
  scale = h ** -0.5 if scale is None else scale
  q = q_btnh.reshape(b, t, k, n // k, h)
  s = jnp.einsum("bqkgh,bskh->bkgqs", q, k_btkh, preferred_element_type=jnp.float32) * scale
  ok = jnp.tril(jnp.ones((t, t), bool))[None]
  if segment_ids_bt is not None:
    ok = ok & (segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :])
  s = jnp.where(ok[:, None, None], s, _MASK_VALUE)
  p = jax.nn.softmax(s, axis=-1).astype(v_btkh.dtype)
  o = jnp.einsum("bkgqs,bskh->bqkgh", p, v_btkh, preferred_element_type=jnp.float32)
  return o.reshape(b, t, n, h).astype(q_btnh.dtype)
