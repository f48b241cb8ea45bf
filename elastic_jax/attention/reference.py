"""Plain-jnp attention that stays memory-safe at long T: the spec every kernel is tested against.

Queries are processed in chunks of `q_chunk` rows (sequentially, `lax.map`), and for each query
chunk the keys are streamed in chunks of `kv_chunk` columns with an online (flash-style)
softmax, so no more than a [q_chunk, kv_chunk] score tile per head exists at once. Key chunks
that lie wholly in a query chunk's future are skipped with `lax.cond`. Each query chunk, and
within it each key chunk, is rematerialised in the backward pass (`jax.checkpoint`), so
gradients never hold a [T, T] matrix either: the backward keeps O(T * H) per head plus a tile.

Two masks are computed in the same pass over K/V:
  full (FA)       causal, within a segment;
  streaming (SSA) block-granular sink + local window (docs/method.md §3): a query in block i
                  sees key blocks [0, sink_blocks) and [i - local_blocks + 1, i], token-causal.
                  Blocks count from each segment's start (token positions), so every packed
                  segment is treated as its own sequence.
SSA is a subset of FA, which is why one pass can produce both (`hybrid_attention`).

Shape letters: B batch, T tokens, N query heads, K key/value heads, G = N/K, H head dim.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from elastic_jax.attention.patterns import (  # noqa: F401  (the pairs, read here by many)
    PATTERN_PAIRS, Pattern, split_patterns)

# Finite stand-in for -inf so that fully masked tiles give exp(...) = 0, never NaN. Every
# kernel uses this one value.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class Streaming:
  """The streaming (SSA) pattern, in blocks of `block` tokens."""
  sink_blocks: int = 1
  local_blocks: int = 16
  block: int = 128

  def __post_init__(self):
    if self.block < 1 or self.sink_blocks < 0 or self.local_blocks < 1:
      raise ValueError(f"invalid streaming pattern {self}: need block >= 1, sink_blocks >= 0, "
                       "local_blocks >= 1")

  def allows(self, q_pos, k_pos):
    """The block rule of SSA for token positions (broadcasting): the one place it is written;
    every kernel and the decoding cache call it. Causality is checked apart."""
    qb, kb = q_pos // self.block, k_pos // self.block
    return (kb < self.sink_blocks) | (qb - kb < self.local_blocks)


def _chunk_size(requested: int, t: int) -> int:
  return max(1, min(requested, t))


def check_shapes(q, k, v, gate, segment_ids=None, positions=None, xa_keep=None,
                 xa_block: int = 128, *, gate_per_token: bool = True) -> None:
  """One ValueError sentence where the arrays do not fit together, from shapes only (so that it
  holds under jit too; the reference's gathers would clamp, the kernels read past them): q
  [B, T, N, H] and k, v [B, T, K, H] with N a multiple of K; the gate [B, T, K] ([B, K] with
  gate_per_token False; None: no gate); segment ids and positions [B, T]; kept XA blocks
  [B, K, nb, nb] in blocks of xa_block >= 1 tokens. The kernel builders' check adds dtypes
  (`common.check_kernel_call`)."""
  shape = lambda x: list(getattr(x, "shape", ()))
  if any(getattr(x, "ndim", None) != 4 for x in (q, k, v)):
    raise ValueError(f"q, k and v must be [B, T, heads, H], got shapes {shape(q)}, {shape(k)} "
                     f"and {shape(v)}")
  b, t, n, h = q.shape
  kh = k.shape[2]
  if (k.shape != v.shape or k.shape[:2] != (b, t) or k.shape[3] != h or kh == 0 or n % kh
          or 0 in q.shape):
    raise ValueError(f"q {shape(q)} and k, v {shape(k)}, {shape(v)} do not fit: q is [B, T, N, "
                     "H] and k, v [B, T, K, H] with N a multiple of K")
  want = (b, t, kh) if gate_per_token else (b, kh)
  if gate is not None and tuple(getattr(gate, "shape", ())) != want:
    raise ValueError(f"the gate has shape {shape(gate)}; {list(want)} expected")
  for name, x in (("segment ids", segment_ids), ("positions", positions)):
    if x is not None and tuple(getattr(x, "shape", ())) != (b, t):
      raise ValueError(f"the {name} have shape {shape(x)}; {[b, t]} expected")
  if xa_keep is not None:
    if not isinstance(xa_block, int) or xa_block < 1:
      raise ValueError(f"the XA block must be a positive number of tokens, got {xa_block!r}")
    nb = -(-t // xa_block)
    if tuple(getattr(xa_keep, "shape", ())) != (b, kh, nb, nb):
      raise ValueError(f"xa_keep has shape {shape(xa_keep)}; {[b, kh, nb, nb]} expected for {t} "
                       f"tokens in blocks of {xa_block}")


def _attend(q_btnh, k_btkh, v_btkh, segment_ids_bt, positions_bt, streaming: Streaming | None,
            gate_btk, scale, q_chunk, kv_chunk, patterns="fa-ssa", xa_keep=None, xa_block=128):
  """[B, T, N, H] in q's dtype: O_FA (streaming None), the r = 0 pattern alone (gate None), or
  the gate mix of the pair's two patterns.

  The mix is formed per query chunk, so only one output array is ever materialised.
  """
  hi, lo = split_patterns(patterns)
  if Pattern.XA in (hi, lo) and streaming is not None and xa_keep is None:
    raise ValueError(f"patterns '{patterns}' needs the kept XAttention blocks (xa_keep)")
  b, t, n, h = q_btnh.shape
  k = k_btkh.shape[2]
  check_shapes(q_btnh, k_btkh, v_btkh, gate_btk, segment_ids_bt, positions_bt,
               xa_keep if Pattern.XA in (hi, lo) and streaming is not None else None, xa_block)
  g = n // k
  scale = h ** -0.5 if scale is None else scale
  if segment_ids_bt is None:
    segment_ids_bt = jnp.zeros((b, t), jnp.int32)
  if positions_bt is None:
    positions_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
  cq, ck = _chunk_size(q_chunk, t), _chunk_size(kv_chunk, t)
  nq, nk = -(-t // cq), -(-t // ck)

  def pad(x, size, value=0):
    return jnp.pad(x, [(0, 0), (0, size - t)] + [(0, 0)] * (x.ndim - 2),
                   constant_values=value)

  # Padded keys get segment -1 so no real query sees them; padded query rows are dropped.
  seg_k = pad(segment_ids_bt, nk * ck, -1).reshape(b, nk, ck)
  pos_k = pad(positions_bt, nk * ck).reshape(b, nk, ck)
  # Head-major layouts, so that both products are plain batched matmuls (3x faster on CPU).
  q_cbkgqh = pad(q_btnh, nq * cq).reshape(b, nq, cq, k, g, h).transpose(1, 0, 3, 4, 2, 5)
  seg_q_cbq = pad(segment_ids_bt, nq * cq).reshape(b, nq, cq).transpose(1, 0, 2)
  pos_q_cbq = pad(positions_bt, nq * cq).reshape(b, nq, cq).transpose(1, 0, 2)
  gate_btk_given = gate_btk is not None
  if gate_btk is None:
    gate_btk = jnp.zeros((b, t, k), jnp.float32)  # unused: one mask only
  gate_cbqk = pad(gate_btk.astype(jnp.float32), nq * cq).reshape(b, nq, cq, k).transpose(
      1, 0, 2, 3)
  k_bksh = pad(k_btkh, nk * ck).transpose(0, 2, 1, 3)
  v_bksh = pad(v_btkh, nk * ck).transpose(0, 2, 1, 3)
  if streaming is None:
    masks = [Pattern.FULL]
  else:
    masks = ([hi] if gate_btk_given else []) + [lo]

  @jax.checkpoint
  def one_query_chunk(args):
    i, q_bkgqh, segq_bq, posq_bq, gate_bqk = args
    q_idx = i * cq + jnp.arange(cq)

    # Rematerialised too: the backward pass then keeps only the running (m, l, acc) per key
    # chunk, not its [q_chunk, kv_chunk] probabilities.
    @functools.partial(jax.checkpoint, prevent_cse=False)
    def visit(carry, j):
      kj = jax.lax.dynamic_slice_in_dim(k_bksh, j * ck, ck, axis=2)
      vj = jax.lax.dynamic_slice_in_dim(v_bksh, j * ck, ck, axis=2)
      k_idx = j * ck + jnp.arange(ck)
      s = jnp.einsum("bkgqh,bksh->bkgqs", q_bkgqh, kj,
                     preferred_element_type=jnp.float32) * scale
      causal_bqs = (k_idx[None, None, :] <= q_idx[None, :, None]) & (
          segq_bq[:, :, None] == seg_k[:, j][:, None, :])
      new = []
      for name, (m_bkgq, l_bkgq, acc_bkgqh) in zip(masks, carry):
        ok = causal_bqs[:, None, None]
        if name == Pattern.STREAM:
          ok = ok & streaming.allows(posq_bq[:, :, None], pos_k[:, j][:, None, :])[:, None, None]
        elif name == Pattern.XA:   # the kept blocks of each KV head, by row position
          rows = jnp.take(xa_keep, jnp.minimum(q_idx // xa_block, xa_keep.shape[2] - 1), 2)
          tile = jnp.take(rows, jnp.minimum(k_idx // xa_block, xa_keep.shape[3] - 1), 3)
          ok = ok & tile[:, :, None]
        sm = jnp.where(ok, s, MASK_VALUE)
        m_new = jnp.maximum(m_bkgq, sm.max(-1))
        p = jnp.where(ok, jnp.exp(sm - m_new[..., None]), 0.0)
        corr = jnp.exp(m_bkgq - m_new)
        pv = jnp.einsum("bkgqs,bksh->bkgqh", p.astype(v_bksh.dtype), vj,
                        preferred_element_type=jnp.float32)
        new.append((m_new, l_bkgq * corr + p.sum(-1), acc_bkgqh * corr[..., None] + pv))
      return tuple(new)

    def step(carry, j):
      # Key chunk j holds only future keys for every row of query chunk i: skip its work.
      needed = j * ck <= (i + 1) * cq - 1
      return jax.lax.cond(needed, visit, lambda c, _: c, carry, j), None

    init = tuple((jnp.full((b, k, g, cq), MASK_VALUE, jnp.float32),
                  jnp.zeros((b, k, g, cq), jnp.float32),
                  jnp.zeros((b, k, g, cq, h), jnp.float32)) for _ in masks)
    final, _ = jax.lax.scan(step, init, jnp.arange(nk))
    # Rows with no visible key (padding only) have l == 0; keep them finite.
    outs = [(acc / jnp.where(l == 0, 1.0, l)[..., None]).transpose(0, 3, 1, 2, 4)
            for _, l, acc in final]  # each [B, cq, K, G, H] float32
    if len(outs) == 2:
      r = gate_bqk[..., None, None]
      outs = [r * outs[0] + (1.0 - r) * outs[1]]
    return outs[0].astype(q_btnh.dtype)

  out = jax.lax.map(one_query_chunk,
                    (jnp.arange(nq), q_cbkgqh, seg_q_cbq, pos_q_cbq, gate_cbqk))
  return out.transpose(1, 0, 2, 3, 4, 5).reshape(b, nq * cq, n, h)[:, :t]


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
  return _attend(q_btnh, k_btkh, v_btkh, segment_ids_bt, None, None, None, scale, q_chunk,
                 kv_chunk)


def hybrid_attention(q_btnh: jax.Array, k_btkh: jax.Array, v_btkh: jax.Array,
                     gate_btk: jax.Array | None, streaming: Streaming,
                     segment_ids_bt: jax.Array | None = None,
                     positions_bt: jax.Array | None = None, *, scale: float | None = None,
                     q_chunk: int = 512, kv_chunk: int = 512, patterns: str = "fa-ssa",
                     xa_keep: jax.Array | None = None, xa_block: int = 128) -> jax.Array:
  """O = r * O_FA + (1 - r) * O_SSA per KV head (its G query heads share r).

  gate_btk: [B, T, K] in [0, 1], the full-attention weight r of each token's KV head (tokens
    of one packed segment share their segment's gate); None means every head streaming.
  positions_bt: token positions within their segment (default 0..T-1); they define SSA blocks.
  patterns: "fa-ssa" as above; "fa-xa" replaces SSA by XAttention's kept blocks; "xa-ssa"
    replaces FA by them. xa_keep [B, K, nb, nb] bool: the kept blocks of `xa_block` row
    positions per KV head (`xattention.select`), token-causal within them.
  Differentiable in q, k, v and the gate: dO/dr = O_FA - O_SSA (the kept blocks are constant).
  """
  return _attend(q_btnh, k_btkh, v_btkh, segment_ids_bt, positions_bt, streaming, gate_btk,
                 scale, q_chunk, kv_chunk, patterns, xa_keep, xa_block)


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
  s = jnp.where(ok[:, None, None], s, MASK_VALUE)
  p = jax.nn.softmax(s, axis=-1).astype(v_btkh.dtype)
  o = jnp.einsum("bkgqs,bskh->bqkgh", p, v_btkh, preferred_element_type=jnp.float32)
  return o.reshape(b, t, n, h).astype(q_btnh.dtype)


def dense_hybrid_attention(q_btnh, k_btkh, v_btkh, gate_bk, streaming: Streaming, *,
                           scale=None, patterns="fa-ssa", xa_keep=None, xa_block=128):
  """The textbook [T, T] form of `hybrid_attention` for unpacked rows and one gate per (batch,
  KV head), [B, K], in float32: the fast-compiling oracle of the kernel tests."""
  b, t, n, h = q_btnh.shape
  k = k_btkh.shape[2]
  scale = h ** -0.5 if scale is None else scale
  up = lambda x: x.astype(jnp.float32)
  q = up(q_btnh).reshape(b, t, k, n // k, h)
  s = jnp.einsum("bqkgh,bskh->bkgqs", q, up(k_btkh)) * scale
  pos = jnp.arange(t)
  causal = pos[None, :] <= pos[:, None]
  streamed = causal & streaming.allows(pos[:, None], pos[None, :])
  masks = {Pattern.FULL: causal[None, None, None], Pattern.STREAM: streamed[None, None, None]}
  if xa_keep is not None:
    blk = pos // xa_block
    masks[Pattern.XA] = (causal[None, None] & xa_keep[:, :, blk][:, :, :, blk])[:, :, None]

  def attend(ok):
    p = jax.nn.softmax(jnp.where(ok, s, MASK_VALUE), axis=-1)
    return jnp.einsum("bkgqs,bskh->bqkgh", p, up(v_btkh))

  hi, lo = split_patterns(patterns)
  r = up(gate_bk)[:, None, :, None, None]
  o = r * attend(masks[hi]) + (1.0 - r) * attend(masks[lo])
  return o.reshape(b, t, n, h)
