"""Decode attention over the per-head cache (kv_cache.py): one new token per row.

Each (row, KV head) of a layer is a *slot*, and a program of the kernels serves one slot with
the G query heads of its KV head (GQA: the slot's keys are read once for the group):
  full slot       keys 0 .. p of its entry in the pool [P, M, H] (p the row's position; the
                  layer's entries are start .. start + F - 1);
  streaming slot  its sink and ring, one row of [L, S, W, H]: index j < sink_len holds position
                  j, index sink_len + r holds the latest position q <= p with q % ring == r; a
                  key is visible when its position is in the row's sink or local window
                  (`stream_visible`, `Streaming.allows`).
Every call also writes the new token's key and value into its slots (at p, or at the
sink/ring index of p) and returns the updated arrays. A slot names its row of the step's
queries, keys and values [B·K, ...] (row b·K + h); row -1 marks an empty slot (padding of the
slot tables), which gets zeros and writes nothing.

Implementations, one launch for every slot of the layer, full and streaming:
  reference  plain jnp: write, then attend (the spec of the kernels);
  triton     Pallas on a GPU (Triton backend): the writes happen in the kernel (the arrays
             are aliased in place). Slots are split along their keys (flash-decoding) so that
             a batch of one fills the GPU: a full slot's programs read only keys below p, so
             a step reads what is live, not the capacity; a streaming slot's width is cut in
             pieces of 256 keys. The program whose range holds the new token's index takes
             its key and value from the inputs and stores them; no program reads that index
             from the cache, so the store races with no read. The splits' partial softmaxes
             combine in jnp;
  tpu        Pallas on a TPU, after the reference's writes: grid (slot, key block); blocks
             past the position repeat the last visible block's index, which the pipeline
             does not fetch again.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from elastic_jax.attention.pallas_gpu import LOG2E, online_update
from elastic_jax.attention.reference import MASK_VALUE, Streaming

IMPLS = ("reference", "triton", "tpu")


def stream_visible(j, pos, sink_len: int, ring: int, streaming: Streaming):
  """Whether index j of a streaming slot's row (sink then ring) holds a key that a query at
  position pos (>= -1) sees; broadcasting."""
  r = j - sink_len
  held = pos - jnp.mod(pos - r, ring)                    # the ring index's latest position
  in_sink = (j < sink_len) & (j <= pos)
  in_ring = (j >= sink_len) & (r < ring) & (held >= sink_len) & streaming.allows(pos, held)
  return in_sink | in_ring


def stream_index(pos, sink_len: int, ring: int):
  """Where a streaming slot keeps position pos: the sink below sink_len, else the ring."""
  return jnp.where(pos < sink_len, pos, sink_len + jnp.mod(pos, ring))


def write(q_rows, k_rows, v_rows, full_k, full_v, start, full_row, full_pos, st_k, st_v,
          layer, st_row, st_pos, *, sink_len: int, ring: int):
  """The new keys and values written into the layer's slots (scatters): (full_k, full_v,
  st_k, st_v)."""
  del q_rows
  fslot = jnp.where(full_row >= 0, start + jnp.arange(full_row.shape[0]), full_k.shape[0])
  full_k = full_k.at[fslot, full_pos].set(k_rows[full_row], mode="drop")
  full_v = full_v.at[fslot, full_pos].set(v_rows[full_row], mode="drop")
  at = jnp.where(st_row >= 0, stream_index(st_pos, sink_len, ring), st_k.shape[2])
  slots = jnp.arange(st_row.shape[0])
  st_k = st_k.at[layer, slots, at].set(k_rows[st_row], mode="drop")
  st_v = st_v.at[layer, slots, at].set(v_rows[st_row], mode="drop")
  return full_k, full_v, st_k, st_v


def _softmax(q_sgh, k_smh, v_smh, ok_sm, scale):
  s = jnp.einsum("sgh,smh->sgm", q_sgh, k_smh, preferred_element_type=jnp.float32) * scale
  s = jnp.where(ok_sm[:, None], s, -jnp.inf)
  m = jnp.max(s, -1, keepdims=True)
  p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
  l = p.sum(-1, keepdims=True)
  out = jnp.einsum("sgm,smh->sgh", p.astype(v_smh.dtype), v_smh,
                   preferred_element_type=jnp.float32)
  return out / jnp.where(l == 0, 1.0, l)


def reference(q_rows, k_rows, v_rows, full_k, full_v, start, full_row, full_pos, st_k, st_v,
              layer, st_row, st_pos, *, sink_len: int, ring: int, streaming: Streaming,
              scale: float):
  """((out of the full slots [F, G, H], of the streaming slots [S, G, H]) in float32, the
  written full_k, full_v, st_k, st_v)."""
  full_k, full_v, st_k, st_v = write(
      q_rows, k_rows, v_rows, full_k, full_v, start, full_row, full_pos, st_k, st_v, layer,
      st_row, st_pos, sink_len=sink_len, ring=ring)
  width = full_row.shape[0]
  win_k = lax.dynamic_slice_in_dim(full_k, start, width, 0)
  win_v = lax.dynamic_slice_in_dim(full_v, start, width, 0)
  ok = (jnp.arange(full_k.shape[1])[None] <= full_pos[:, None]) & (full_row[:, None] >= 0)
  out_full = _softmax(q_rows[full_row], win_k, win_v, ok, scale)
  j = jnp.arange(st_k.shape[2])[None]
  ok = stream_visible(j, st_pos[:, None], sink_len, ring, streaming) & (st_row[:, None] >= 0)
  out_st = _softmax(q_rows[st_row], st_k[layer], st_v[layer], ok, scale)
  return (out_full, out_st), (full_k, full_v, st_k, st_v)


def _online_one(carry, q, k, v, qk_scale):
  """One key [H] (the new token's) into the online softmax of the queries q [G, H]."""
  acc, m, l = carry
  s = jnp.sum(q.astype(jnp.float32) * k.astype(jnp.float32)[None, :], axis=1) * qk_scale
  m_new = jnp.maximum(m, s)
  p, corr = jnp.exp2(s - m_new), jnp.exp2(m - m_new)
  return (acc * corr[:, None] + p[:, None] * v.astype(jnp.float32)[None, :], m_new,
          l * corr + p)


def _triton_kernel(meta_ref, row_ref, pos_ref, q_ref, k_ref, v_ref, fk_in, fv_in, sk_in,
                   sv_in, o_ref, m_ref, l_ref, so_ref, sm_ref, sl_ref, fk_ref, fv_ref, sk_ref,
                   sv_ref, *, num_full, splits, chunk, block, st_splits, st_chunk, st_block,
                   width, sink_len, ring, streaming, scale):
  del fk_in, fv_in, sk_in, sv_in          # aliased to fk_ref, fv_ref, sk_ref, sv_ref
  prog = pl.program_id(0)
  is_full = prog < num_full * splits
  rest = prog - num_full * splits
  i = jnp.where(is_full, prog // splits, num_full + rest // st_splits)
  row = row_ref[i]
  live = row >= 0
  row = jnp.maximum(row, 0)
  q = q_ref[row]
  gp, d = q.shape
  qk_scale = scale * LOG2E
  init = (jnp.zeros((gp, d), jnp.float32), jnp.full((gp,), MASK_VALUE, jnp.float32),
          jnp.zeros((gp,), jnp.float32))
  pos = jnp.where(live, pos_ref[i], -1)

  def walk(c, lo, hi, blk, load, visible):
    """Key blocks from index lo (a block multiple) up to hi, entries where visible(idx); hi
    never passes the array's end (a load there would read other memory, which a masked
    entry still multiplies by zero: NaN where that memory holds one)."""
    def body(j, c):
      s = jnp.dot(q, load(j, 0).T, preferred_element_type=jnp.float32) * qk_scale
      idx = j * blk + jnp.arange(blk)
      return online_update(c, s, visible(idx)[None, :], load(j, 1))
    return lax.fori_loop(lo // blk, jnp.maximum(lo, hi + blk - 1) // blk, body, c)

  def new_key(c, owns, out_refs, out_at, cache_refs, cache_at):
    """The program that owns the new token's index adds its key to the softmax and stores
    it; every program stores its partial softmax."""
    k_new, v_new = k_ref[row], v_ref[row]
    acc, m, l = lax.cond(owns, lambda: _online_one(c, q, k_new, v_new, qk_scale), lambda: c)
    for ref, x in zip(out_refs, (acc, m, l)):
      ref[out_at] = x

    @pl.when(owns)
    def _():
      for ref, x in zip(cache_refs, (k_new, v_new)):
        ref[cache_at] = x[None].astype(ref.dtype)

  @pl.when(is_full)
  def _():
    split = prog % splits
    slot = meta_ref[0] + i
    lo = split * chunk
    hi = jnp.minimum(lo + chunk, jnp.maximum(pos, 0))          # keys below the position
    load = lambda j, kv: (fk_ref, fv_ref)[kv][slot, pl.ds(j * block, block), :]
    c = walk(init, lo, hi, block, load, lambda idx: idx < hi)
    new_key(c, live & (lo <= pos) & (pos < lo + chunk), (o_ref, m_ref, l_ref), (i, split),
            (fk_ref, fv_ref), (slot, pl.ds(pos, 1), slice(None)))

  @pl.when(jnp.logical_not(is_full))
  def _():
    st, split = i - num_full, rest % st_splits
    layer = meta_ref[1]
    at = stream_index(pos, sink_len, ring)
    load = lambda j, kv: (sk_ref, sv_ref)[kv][layer, st, pl.ds(j * st_block, st_block), :]
    lo = split * st_chunk
    c = walk(init, lo, jnp.minimum(lo + st_chunk, width), st_block, load,
             lambda idx: stream_visible(idx, pos, sink_len, ring, streaming) & (idx != at))
    new_key(c, live & (lo <= at) & (at < lo + st_chunk), (so_ref, sm_ref, sl_ref),
            (st, split), (sk_ref, sv_ref), (layer, st, pl.ds(at, 1), slice(None)))


def _combine(o, m, l):
  """Partial softmaxes (base 2) [R, splits, ...] of key ranges into one [R, G, H]."""
  m_all = m.max(axis=1, keepdims=True)
  w = jnp.exp2(m - m_all) * (l > 0)
  l_all = (w * l).sum(1)
  return (w[..., None] * o).sum(1) / jnp.where(l_all == 0, 1.0, l_all)[..., None]


def _largest_block(n: int, cap: int) -> int:
  b = cap
  while b > 16 and n % b:
    b //= 2
  return b


@functools.partial(jax.jit, static_argnames=("sink_len", "ring", "streaming", "scale",
                                             "splits", "block", "num_warps", "num_stages",
                                             "interpret"))
def triton(q_rows, k_rows, v_rows, full_k, full_v, start, full_row, full_pos, st_k, st_v,
           layer, st_row, st_pos, *, sink_len: int, ring: int, streaming: Streaming,
           scale: float, splits: int | None = None, block: int = 64, num_warps: int = 4,
           num_stages: int = 2, interpret: bool = False):
  """`reference` on the Pallas Triton kernel. Needs a head dim that is a power of two >= 16
  (`triton_applies`), a capacity M and a streaming width W that are multiples of 16."""
  from jax.experimental.pallas import triton as plgpu

  f, s_n = full_row.shape[0], st_row.shape[0]
  g, d = q_rows.shape[1:]
  cap, width = full_k.shape[1], st_k.shape[2]
  block = _largest_block(cap, block)
  st_block = _largest_block(width, 64)
  st_chunk = st_block * max(1, 256 // st_block)        # streaming slots: 256 keys a program
  st_splits = -(-width // st_chunk)
  if splits is None:   # about 512 programs of full slots, each at least one block long
    splits = max(1, min(cap // block, -(-512 // max(f, 1))))
  chunk = -(-cap // (splits * block)) * block
  splits = -(-cap // chunk)
  gp = max(16, pl.next_power_of_2(g))
  q = jnp.pad(q_rows, ((0, 0), (0, gp - g), (0, 0))).astype(full_k.dtype)
  n = pl.next_power_of_2(f + s_n)
  row = jnp.pad(jnp.concatenate([full_row, st_row]).astype(jnp.int32), (0, n - f - s_n),
                constant_values=-1)
  pos = jnp.pad(jnp.concatenate([full_pos, st_pos]).astype(jnp.int32), (0, n - f - s_n))
  meta = jnp.stack([jnp.asarray(start, jnp.int32), jnp.asarray(layer, jnp.int32)])
  whole = lambda x: pl.BlockSpec(x.shape, lambda p: (0,) * x.ndim)
  fo, so_n = max(f, 1), max(s_n, 1)
  partials = [jax.ShapeDtypeStruct((fo, splits, gp, d), jnp.float32),
              jax.ShapeDtypeStruct((fo, splits, gp), jnp.float32),
              jax.ShapeDtypeStruct((fo, splits, gp), jnp.float32),
              jax.ShapeDtypeStruct((so_n, st_splits, gp, d), jnp.float32),
              jax.ShapeDtypeStruct((so_n, st_splits, gp), jnp.float32),
              jax.ShapeDtypeStruct((so_n, st_splits, gp), jnp.float32)]
  caches = (full_k, full_v, st_k, st_v)
  out_shape = partials + [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in caches]
  kernel = functools.partial(
      _triton_kernel, num_full=f, splits=splits, chunk=chunk, block=block,
      st_splits=st_splits, st_chunk=st_chunk, st_block=st_block, width=width,
      sink_len=sink_len,
      ring=ring, streaming=streaming, scale=scale)
  operands = (meta, row, pos, q, k_rows, v_rows) + caches
  o, m, l, so, sm, sl, *caches = pl.pallas_call(
      kernel, grid=(f * splits + s_n * st_splits,),
      in_specs=[whole(x) for x in operands],
      out_specs=[whole(s) for s in out_shape],
      out_shape=out_shape,
      input_output_aliases={6 + i: 6 + i for i in range(4)},
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret, name="elastic_decode_attention",
  )(*operands)
  return (_combine(o, m, l)[:f, :g], _combine(so, sm, sl)[:s_n, :g]), tuple(caches)


def triton_applies(head_dim: int, capacity: int, width: int) -> bool:
  return (head_dim >= 16 and head_dim & (head_dim - 1) == 0 and capacity % 16 == 0
          and width % 16 == 0)


def _tpu_kernel(meta_ref, pos_ref, q_ref, fk_ref, fv_ref, sk_ref, sv_ref, o_ref, acc_ref,
                m_ref, l_ref, *, num_full, block, sink_len, ring, streaming, scale):
  i, j = pl.program_id(0), pl.program_id(1)
  pos = pos_ref[i]
  q = q_ref[...]

  @pl.when(j == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)
    m_ref[...] = jnp.full_like(m_ref, MASK_VALUE)
    l_ref[...] = jnp.zeros_like(l_ref)

  def update(k, v, ok):
    s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * (scale * LOG2E)
    acc, m, l = online_update((acc_ref[...], m_ref[...][:, 0], l_ref[...][:, 0]), s, ok, v)
    acc_ref[...], m_ref[...], l_ref[...] = acc, m[:, None], l[:, None]

  @pl.when((i < num_full) & (j * block <= pos))
  def _():
    ok = (j * block + jnp.arange(block))[None, :] <= pos
    update(fk_ref[...], fv_ref[...], ok)

  @pl.when((i >= num_full) & (j == 0))
  def _():
    idx = jnp.arange(sk_ref.shape[0])[None, :]
    update(sk_ref[...], sv_ref[...], stream_visible(idx, pos, sink_len, ring, streaming))

  @pl.when(j == pl.num_programs(1) - 1)
  def _():
    l = l_ref[...]
    o_ref[...] = acc_ref[...] / jnp.where(l == 0.0, 1.0, l)


@functools.partial(jax.jit, static_argnames=("sink_len", "ring", "streaming", "scale",
                                             "block", "interpret"))
def tpu(q_rows, k_rows, v_rows, full_k, full_v, start, full_row, full_pos, st_k, st_v, layer,
        st_row, st_pos, *, sink_len: int, ring: int, streaming: Streaming, scale: float,
        block: int = 128, interpret: bool = False):
  """`reference` on the Pallas TPU kernel (the writes are the reference's scatters)."""
  from jax.experimental.pallas import tpu as pltpu

  caches = write(q_rows, k_rows, v_rows, full_k, full_v, start, full_row, full_pos, st_k,
                 st_v, layer, st_row, st_pos, sink_len=sink_len, ring=ring)
  full_k, full_v, st_k, st_v = caches
  f, s_n = full_row.shape[0], st_row.shape[0]
  g, d = q_rows.shape[1:]
  cap, width = full_k.shape[1], st_k.shape[2]
  block = _largest_block(cap, block) if cap % 8 == 0 else cap
  gp = max(8, g)
  q = jnp.pad(q_rows[jnp.concatenate([full_row, st_row])], ((0, 0), (0, gp - g), (0, 0)))
  pos = jnp.where(jnp.concatenate([full_row, st_row]) >= 0,
                  jnp.concatenate([full_pos, st_pos]), -1).astype(jnp.int32)
  meta = jnp.stack([jnp.asarray(start, jnp.int32), jnp.asarray(layer, jnp.int32)])
  last_f, last_s = max(f - 1, 0), max(s_n - 1, 0)

  def full_map(i, j, meta_ref, pos_ref):   # blocks past the position: the last visible one
    r = jnp.minimum(i, last_f)
    top = jnp.maximum(pos_ref[r], 0) // block
    return meta_ref[0] + r, jnp.where(i < f, jnp.minimum(j, top), 0), 0

  def st_map(i, j, meta_ref, pos_ref):
    return meta_ref[1], jnp.clip(i - f, 0, last_s), 0, 0

  kernel = functools.partial(_tpu_kernel, num_full=f, block=block, sink_len=sink_len,
                             ring=ring, streaming=streaming, scale=scale)
  out = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=(f + s_n, cap // block),
          in_specs=[pl.BlockSpec((None, gp, d), lambda i, j, *_: (i, 0, 0)),
                    pl.BlockSpec((None, block, d), full_map),
                    pl.BlockSpec((None, block, d), full_map),
                    pl.BlockSpec((None, None, width, d), st_map),
                    pl.BlockSpec((None, None, width, d), st_map)],
          out_specs=pl.BlockSpec((None, gp, d), lambda i, j, *_: (i, 0, 0)),
          scratch_shapes=[pltpu.VMEM((gp, d), jnp.float32), pltpu.VMEM((gp, 1), jnp.float32),
                          pltpu.VMEM((gp, 1), jnp.float32)]),
      out_shape=jax.ShapeDtypeStruct((f + s_n, gp, d), jnp.float32),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      interpret=pltpu.InterpretParams() if interpret else False,
      name="elastic_decode_attention_tpu",
  )(meta, pos, q.astype(full_k.dtype), full_k, full_v, st_k, st_v)
  return (out[:f, :g], out[f:, :g]), caches


def attention(impl: str, *args, **kwargs):
  """Decode attention on `impl` ("reference", "triton", "tpu", "auto", each kernel with
  ":interpret"; the prefill kernels' names "pallas_gpu", "mosaic_gpu", "pallas_tpu" take their
  backend's decode kernel); auto: the backend's kernel where it applies, else the reference. Arguments
  as `reference`'s."""
  from elastic_jax.attention import DECODE_KERNELS, parse_impl
  name, interpret = parse_impl(impl, kernels=IMPLS[1:] + tuple(DECODE_KERNELS))
  name = DECODE_KERNELS.get(name, name)   # the prefill kernels' names take their decode kernel
  (q_rows, k_rows, v_rows, full_k, full_v, start, full_row, full_pos, st_k, st_v, layer,
   st_row, st_pos) = args
  if name == "auto":
    backend = jax.default_backend()
    if backend == "gpu" and triton_applies(q_rows.shape[-1], full_k.shape[1], st_k.shape[2]):
      name = "triton"
    elif backend == "tpu":
      name = "tpu"
    else:
      name = "reference"
  if name == "reference":
    return reference(*args, **kwargs)
  if name not in IMPLS:
    raise ValueError(f"decode attention '{impl}' is not one of {', '.join(IMPLS)} or auto")
  kernel = functools.partial({"triton": triton, "tpu": tpu}[name], **kwargs,
                             interpret=interpret)
  f, s_n = full_row.shape[0], st_row.shape[0]
  if f == 0 or full_k.shape[0] == 0:     # no full slot in any layer: an empty stand-in
    (out_full, out_st), (_, _, st_k, st_v) = kernel(
        q_rows, k_rows, v_rows, jnp.zeros((1, 16, q_rows.shape[-1]), full_k.dtype),
        jnp.zeros((1, 16, q_rows.shape[-1]), full_k.dtype), jnp.int32(0),
        jnp.full((1,), -1, jnp.int32), jnp.zeros((1,), jnp.int32), st_k, st_v, layer,
        st_row, st_pos)
    return (out_full[:0], out_st), (full_k, full_v, st_k, st_v)
  if s_n == 0:                           # no streaming slot
    (out_full, out_st), (full_k, full_v, _, _) = kernel(
        q_rows, k_rows, v_rows, full_k, full_v, start, full_row, full_pos,
        jnp.zeros((1, 1, 16, q_rows.shape[-1]), st_k.dtype),
        jnp.zeros((1, 1, 16, q_rows.shape[-1]), st_k.dtype), jnp.int32(0),
        jnp.full((1,), -1, jnp.int32), jnp.zeros((1,), jnp.int32))
    return (out_full, out_st[:0]), (full_k, full_v, st_k, st_v)
  return kernel(*args)
