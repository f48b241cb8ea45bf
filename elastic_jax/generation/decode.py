"""Decode attention over the per-head cache (`kv_cache.py`): one new token per row, every
slot of a layer in one launch, full and streaming.

The slot layout and the plain-jnp spec are `attention.decode_reference`; the kernels are the
backends' (`attention/pallas_gpu/decode.py` on a GPU, `attention/pallas_tpu/decode.py` on a
TPU), chosen by name in `attention.registry.decode_kernel`.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from elastic_jax.attention.decode_reference import (  # noqa: F401  (decode's vocabulary)
    reference, stream_index, stream_visible, write)
from elastic_jax.attention.registry import KERNELS, decode_kernel

IMPLS = ("reference", "auto", *KERNELS)

__all__ = ["IMPLS", "attention", "reference", "stream_index", "stream_visible", "write"]


def attention(impl: str, *args, **kwargs):
  """Decode attention on `impl` ("reference", "auto" or a backend's name, each kernel with
  ":interpret"); auto: this machine's backend's kernel where it takes the cache, else the
  reference. Arguments as `reference`'s."""
  (q_rows, k_rows, v_rows, full_k, full_v, start, full_row, full_pos, st_k, st_v, layer,
   st_row, st_pos) = args
  kernel, interpret = decode_kernel(impl, q_rows.shape[-1], full_k.shape[1], st_k.shape[2])
  if kernel is None:
    return reference(*args, **kwargs)
  kernel = functools.partial(kernel, **kwargs, interpret=interpret)
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
