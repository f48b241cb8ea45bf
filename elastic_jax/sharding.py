"""Logical axis names -> device mesh axes.

The model names every parameter and activation axis logically ("embed", "q_heads", "batch",
...); this table says which mesh axis, if any, each one is split over. Mesh axes:
  data      pure data parallelism (batch split, parameters replicated)
  fsdp      batch split and parameters sharded over the embedding axis (ZeRO-3 style)
  sequence  sequence parallelism for long inputs (activations split over tokens)
  tensor    Megatron-style heads / MLP split
Axes missing from the mesh are simply not used, so one table serves every mesh shape.
"""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "sequence", "tensor")

# (logical name, mesh axis or axes). Parameters first, then activations.
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("layers", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("batch", ("data", "fsdp")),
    ("seq", "sequence"),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
)


def make_mesh(shape: dict[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A mesh with the named axis sizes (missing axes get size 1); sizes must use every device."""
  devices = list(devices if devices is not None else jax.devices())
  sizes = [int(shape.get(a, 1)) for a in MESH_AXES]
  unknown = set(shape) - set(MESH_AXES)
  if unknown:
    raise ValueError(f"unknown mesh axis {sorted(unknown)[0]!r} (known: {', '.join(MESH_AXES)})")
  if int(np.prod(sizes)) != len(devices):
    raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} needs {int(np.prod(sizes))} devices, "
                     f"{len(devices)} are available")
  return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES)


def rules_for(mesh: Mesh, rules=DEFAULT_RULES):
  """Drops mesh axes of size 1 (or absent) from the rules, so specs stay minimal."""
  live = {a for a in mesh.axis_names if mesh.shape[a] > 1}
  out = []
  for name, axes in rules:
    axes = (axes,) if isinstance(axes, str) else (axes or ())
    kept = tuple(a for a in axes if a in live)
    out.append((name, kept if len(kept) > 1 else (kept[0] if kept else None)))
  return tuple(out)


def param_shardings(logical_axes, mesh: Mesh, shapes=None, rules=DEFAULT_RULES):
  """NamedShardings for a tree of logical-axis tuples (from `model.abstract_params`).

  An axis whose size the mesh axes do not divide is replicated instead (e.g. 8 KV heads on a
  16-way tensor axis), so any model loads on any mesh.
  """
  rules = rules_for(mesh, rules)

  def one(axes, shape=None):
    spec = nn.logical_to_mesh_axes(axes, rules)
    if shape is not None:
      fixed = []
      for dim, s in zip(shape.shape, spec):
        n = int(np.prod([mesh.shape[a] for a in ((s,) if isinstance(s, str) else (s or ()))]))
        fixed.append(s if dim % n == 0 else None)
      spec = PartitionSpec(*fixed)
    return NamedSharding(mesh, spec)

  is_axes = lambda x: isinstance(x, tuple) and all(isinstance(a, (str, type(None))) for a in x)
  if shapes is None:
    return jax.tree.map(one, logical_axes, is_leaf=is_axes)
  return jax.tree.map(one, logical_axes, shapes, is_leaf=is_axes)
