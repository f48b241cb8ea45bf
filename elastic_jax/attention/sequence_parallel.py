"""Sequence parallelism for attention: Ulysses-style all-to-all over heads.

Activations outside attention are split over tokens (the "sequence" mesh axis). Attention needs
every key of a head, so around it one all-to-all trades the token split for a head split: each
of the P devices then holds the whole sequence for N/P query heads and their KV heads, runs any
attention implementation locally (reference or fused kernel), and a second all-to-all returns
the output to the token split. Segment ids and positions [B, T] are small and all-gathered.

GQA: query head h belongs to KV head h // G. Device p gets the contiguous query heads
[p N/P, (p + 1) N/P); when the KV heads do not split the same way (K not a multiple of P, e.g.
MQA or 8 KV heads on 16 devices) each KV head (and its gate) is repeated locally, before the
all-to-all, just enough that every device receives exactly the KV heads its query heads use
(repeat factor G / gcd(G, N/P)). N must be a multiple of P, or an ElasticJaxError is raised.

Heads may in addition be split over a tensor axis (`head_axis`); the sequence split then
applies to each tensor shard's heads.

Shape letters: B batch, T tokens, N query heads, K KV heads, G = N / K, H head dim, P devices
on the sequence axis.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from elastic_jax.errors import ElasticJaxError

Axes = str | Sequence[str] | None


def _names(axes: Axes, mesh) -> tuple[str, ...]:
  """The mesh axes of `axes` (a name, names or None) that the mesh has, in order."""
  axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
  return tuple(a for a in axes if a in mesh.axis_names)


def _size(mesh, names: tuple[str, ...]) -> int:
  return math.prod(mesh.shape[a] for a in names)


def _entry(names: tuple[str, ...]):
  """A PartitionSpec entry for a tuple of mesh axes."""
  return None if not names else (names[0] if len(names) == 1 else names)


def _ulysses(local_fn: Callable, mesh, axis: Axes, batch_axes: Axes, head_axis: Axes,
             check_vma: bool, q, k, v, gate, segment_ids, positions):
  """Runs `local_fn(q, k, v, gate, segment_ids, positions)` with whole sequences per device."""
  if mesh is None or mesh.empty:
    mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    raise ElasticJaxError("sequence parallel attention needs a mesh: pass one or call it "
                          "under jax.set_mesh(mesh)")
  seq = _names(axis, mesh)
  if not seq:
    raise ElasticJaxError(f"sequence axis {axis!r} is not an axis of the mesh "
                          f"{dict(mesh.shape)}")
  bat = tuple(a for a in _names(batch_axes, mesh) if a not in seq)
  heads = tuple(a for a in _names(head_axis, mesh) if a not in seq + bat)
  b, t, n = q.shape[:3]
  kh = k.shape[2]
  p, pb, pt = _size(mesh, seq), _size(mesh, bat), _size(mesh, heads)
  if n % kh:
    raise ElasticJaxError(f"{n} query heads are not a multiple of {kh} key/value heads")
  if t % p:
    raise ElasticJaxError(f"sequence parallel attention: {t} tokens do not split over the "
                          f"{p} devices of mesh axis {_entry(seq)!r}")
  if b % pb:
    raise ElasticJaxError(f"sequence parallel attention: batch {b} does not split over the "
                          f"{pb} devices of mesh axes {bat}")
  if n % pt or kh % pt:  # heads the tensor axis cannot split stay whole on each device
    heads, pt = (), 1
  nl = n // pt
  if nl % p:
    raise ElasticJaxError(f"sequence parallel attention: {nl} query heads per device do not "
                          f"split over the {p} devices of mesh axis {_entry(seq)!r}")
  g = n // kh
  reps = g // math.gcd(g, nl // p)  # KV-head copies so each device gets its query heads' KV

  if gate is not None and gate.ndim == 2:  # [B, K] -> [B, T, K]: it then follows the KV heads
    gate = jnp.broadcast_to(gate[:, None, :], (b, t, kh))
  sb, ss, sh = _entry(bat), _entry(seq), _entry(heads)
  x_spec, row_spec = P(sb, ss, sh, None), P(sb, ss)
  args = {"q": q, "k": k, "v": v, "gate": gate, "segment_ids": segment_ids,
          "positions": positions}
  specs = {"q": x_spec, "k": x_spec, "v": x_spec, "gate": P(sb, ss, sh),
           "segment_ids": row_spec, "positions": row_spec}
  given = {name: x for name, x in args.items() if x is not None}
  ax = _entry(seq)

  def to_heads(x):  # [B, T/P, H, ...] -> [B, T, H/P, ...]
    return jax.lax.all_to_all(x, ax, 2, 1, tiled=True)

  def body(xs):
    xs = dict(xs)
    if reps > 1:
      for name in ("k", "v", "gate"):
        if name in xs:
          xs[name] = jnp.repeat(xs[name], reps, axis=2)
    for name in ("q", "k", "v", "gate"):
      if name in xs:
        xs[name] = to_heads(xs[name])
    for name in ("segment_ids", "positions"):
      if name in xs:
        xs[name] = jax.lax.all_gather(xs[name], ax, axis=1, tiled=True)
    out = local_fn(*(xs.get(name) for name in args))
    return jax.lax.all_to_all(out, ax, 1, 2, tiled=True)  # back to [B, T/P, N, H]

  fn = jax.shard_map(body, mesh=mesh, in_specs=({name: specs[name] for name in given},),
                     out_specs=x_spec, check_vma=check_vma)
  return fn(given)


def sequence_parallel(attn_fn: Callable, mesh=None, *, axis: Axes = "sequence",
                      batch_axes: Axes = ("data", "fsdp"), head_axis: Axes = None,
                      check_vma: bool = False) -> Callable:
  """Causal attention `attn_fn(q, k, v, segment_ids)` run sequence parallel over `axis`.

  Returns a function of the same signature taking q [B, T, N, H], k/v [B, T, K, H] split over
  tokens on `axis`, batch on `batch_axes` and (optionally) heads on `head_axis`; the output has
  q's layout. mesh: a Mesh or AbstractMesh; None takes the one of `jax.set_mesh`.
  check_vma: off by default, since the reference's `lax.cond` over key chunks mixes varying
  and unvarying values; with it off, shard_map still sums the gradients of inputs replicated
  over mesh axes the specs leave out.
  """

  def local(q, k, v, gate, segment_ids, positions):
    return attn_fn(q, k, v, segment_ids)

  @functools.wraps(attn_fn)
  def wrapped(q, k, v, segment_ids=None):
    return _ulysses(local, mesh, axis, batch_axes, head_axis, check_vma, q, k, v, None,
                    segment_ids, None)

  return wrapped


def sequence_parallel_hybrid(hybrid_fn: Callable, mesh=None, *, axis: Axes = "sequence",
                             batch_axes: Axes = ("data", "fsdp"), head_axis: Axes = None,
                             check_vma: bool = False) -> Callable:
  """Hybrid attention `hybrid_fn(q, k, v, gate, streaming, segment_ids, positions, **kw)` run
  sequence parallel over `axis` (see `sequence_parallel`).

  gate: [B, T, K] or [B, K] (broadcast over T), or None (all streaming); it follows the KV
  heads. Keyword arguments (scale, chunks, interpret) are passed on to `hybrid_fn`.
  """

  @functools.wraps(hybrid_fn)
  def wrapped(q, k, v, gate, streaming, segment_ids=None, positions=None, **kwargs):
    def local(q, k, v, gate, segment_ids, positions):
      return hybrid_fn(q, k, v, gate, streaming, segment_ids, positions, **kwargs)

    return _ulysses(local, mesh, axis, batch_axes, head_axis, check_vma, q, k, v, gate,
                    segment_ids, positions)

  return wrapped


def for_context(attn_fn: Callable, *, hybrid: bool) -> Callable:
  """`attn_fn` wrapped for sequence parallelism when the context asks for it, else itself.

  It does when a mesh is set (`jax.set_mesh`) and the logical-axis rules in context
  (`nn.logical_axis_rules`) map the model's "seq" axis to mesh axes of total size > 1; the
  batch and head axes are then taken from the same rules ("batch", "act_heads").
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return attn_fn
  rules = nn.get_logical_axis_rules()
  batch, seq, heads = nn.logical_to_mesh_axes(("batch", "seq", "act_heads"), rules)
  seq = tuple(a for a in _names(seq, mesh) if mesh.shape[a] > 1)
  if not seq:
    return attn_fn
  kv_heads = nn.logical_to_mesh_axes(("act_kv_heads",), rules)[0]
  head_axis = heads if _names(heads, mesh) == _names(kv_heads, mesh) else None
  wrap = sequence_parallel_hybrid if hybrid else sequence_parallel
  return wrap(attn_fn, mesh, axis=seq, batch_axes=batch, head_axis=head_axis)
