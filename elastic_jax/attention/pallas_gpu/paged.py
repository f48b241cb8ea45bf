"""Decode attention over a paged pool (the serving engine's cache, generation/paged.py), in
Pallas's Triton backend: one launch for every slot of a layer, full and streaming.

A slot (row b, KV head k) owns a list of pages table[b, k] of the pool [P, page, H]. Each
program serves one slot's G query heads over a range of its pages and reads only the pages
the slot uses: a full slot's pages up to its position (pos // page + 1 of them), a streaming
slot's sink and ring pages. The plain-jnp spec (`decode_reference.paged_reference`) gathers
every slot's whole table instead, so at long context its read grows with the longest request
and the table's width for every head, streaming ones included; the kernel's with what each
slot holds. Slots are split along their pages (flash-decoding) so that small batches fill the
GPU; the splits' partial softmaxes (base 2) combine in jnp. The new keys and values are
written before the call (`paged.attend`), so the kernel only reads.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from elastic_jax.attention.common import LOG2E, online_init, online_update
from elastic_jax.attention.decode_reference import stream_visible
from elastic_jax.attention.pallas_gpu.decode import combine_splits
from elastic_jax.attention.pallas_gpu.hybrid import Tiles
from elastic_jax.attention.reference import Streaming

# The kernel reads num_warps and num_stages (a key tile is one page; no block sizes).
PAGED_TILES = Tiles(num_stages=2, num_warps=4)
# About this many programs per call: splits = ceil(PROGRAMS / slots), at most the table width.
PROGRAMS = 512


def _kernel(table_ref, full_ref, pos_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *,
            kv_heads, width, splits, chunk, stream_pages, num_pages, page, sink_len, ring,
            streaming, scale):
  prog = pl.program_id(0)
  slot, split = prog // splits, prog % splits
  b = slot // kv_heads
  pos = pos_ref[b]
  is_full = full_ref[slot] > 0
  q = q_ref[slot]                                            # [Gp, H]
  used = jnp.where(pos < 0, 0, jnp.where(is_full, pos // page + 1, stream_pages))
  lo = split * chunk
  hi = jnp.maximum(lo, jnp.minimum(lo + chunk, used))
  qk_scale = scale * LOG2E

  def body(j, c):
    pid = jnp.minimum(table_ref[slot * width + j], num_pages - 1)
    s = jnp.dot(q, k_ref[pid].T, preferred_element_type=jnp.float32) * qk_scale
    idx = j * page + jnp.arange(page)
    ok = jnp.where(is_full, idx <= pos, stream_visible(idx, pos, sink_len, ring, streaming))
    return online_update(c, s, ok[None, :], v_ref[pid])

  acc, m, l = lax.fori_loop(lo, hi, body, online_init(*q.shape))
  o_ref[slot, split] = acc
  m_ref[slot, split] = m
  l_ref[slot, split] = l


@functools.partial(jax.jit, static_argnames=("sink_len", "ring", "streaming", "scale",
                                             "splits", "tiles", "interpret"))
def paged_attention(q_bkgh, k_pool, v_pool, table, full, pos_b, *, sink_len: int, ring: int,
                    streaming: Streaming, scale: float, splits: int | None = None,
                    tiles: Tiles = PAGED_TILES, interpret: bool = False):
  """`decode_reference.paged_reference` on the Triton kernel: q [B, K, G, H], the pool
  k/v [P, page, H], table [B, K, S] (page ids; P: none), full [B, K], pos_b [B] (-1: an empty
  row) -> float32 [B, K, G, H]. Needs a head dim and a page size that are powers of two >= 16
  (`paged_applies`)."""
  b, kh, g, h = q_bkgh.shape
  num_pages, page, _ = k_pool.shape
  width = table.shape[-1]
  slots = b * kh
  stream_pages = -(-(sink_len + ring) // page)
  if splits is None:
    splits = max(1, min(width, -(-PROGRAMS // slots)))
  chunk = -(-width // splits)
  splits = -(-width // chunk)
  gp = max(16, pl.next_power_of_2(g))
  q = jnp.pad(q_bkgh.reshape(slots, g, h), ((0, 0), (0, gp - g), (0, 0))).astype(k_pool.dtype)
  operands = (table.reshape(-1).astype(jnp.int32), full.reshape(-1).astype(jnp.int32),
              pos_b.astype(jnp.int32), q, k_pool, v_pool)
  out_shape = [jax.ShapeDtypeStruct((slots, splits, gp, h), jnp.float32),
               jax.ShapeDtypeStruct((slots, splits, gp), jnp.float32),
               jax.ShapeDtypeStruct((slots, splits, gp), jnp.float32)]
  whole = lambda x: pl.BlockSpec(x.shape, lambda p: (0,) * len(x.shape))
  kernel = functools.partial(
      _kernel, kv_heads=kh, width=width, splits=splits, chunk=chunk,
      stream_pages=stream_pages, num_pages=num_pages, page=page, sink_len=sink_len, ring=ring,
      streaming=streaming, scale=scale)
  o, m, l = pl.pallas_call(
      kernel, grid=(slots * splits,),
      in_specs=[whole(x) for x in operands], out_specs=[whole(s) for s in out_shape],
      out_shape=out_shape, compiler_params=tiles.params(h), interpret=interpret,
      name="elastic_paged_decode_attention",
  )(*operands)
  return combine_splits(o, m, l)[:, :g].reshape(b, kh, g, h)


def paged_applies(head_dim: int, page_size: int) -> bool:
  """Whether the kernel takes this head dim and page size."""
  pow2 = lambda n: n >= 16 and n & (n - 1) == 0
  return pow2(head_dim) and pow2(page_size)
