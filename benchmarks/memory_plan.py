"""Per-device memory of router training on a device mesh, worked out on paper.

    python benchmarks/memory_plan.py [--config configs/llama3_8b.yaml] [--model llama3_8b]
        [--devices 8] [--mesh data=1,fsdp=-1,sequence=2,tensor=1] [--seq-len 65536]
        [--micro-batch 4] [--compile] [--json plan.json] [--dry-run] [section.key=value ...]

The mesh, the batch layout and the shardings are built by the functions train.py builds them
with (elastic_jax/train/setup.py: `mesh_layout`, `backbone_shardings`, `abstract_train_state`,
`batch_sharding`, `BATCH_DTYPES`), but on abstract arrays: nothing is
allocated, so an 8B backbone's plan for 8 GPUs is made on a laptop. The backbone has the
published shapes of --model (shapes.py's SHAPES; the config's model.path is not read);
everything else comes from --config and its dotted overrides.

For every array the bytes each device holds follow from its sharding (the slice of the array
each device gets, times the item size; the largest device where shards are uneven). Printed:
the bytes per device of the frozen backbone, the trainable routers, the optimizer state, the
rest of the train state and one step's batch; how each backbone weight is split over the mesh;
and any weight of 1 MiB or more left whole on every device although the mesh has an axis that
shards parameters (a sharding rule that does not bite).

--devices N plans for N devices: fake CPU devices (XLA's host platform device count) unless
JAX_PLATFORMS names an accelerator or jax was already started, where the first N real devices
are used; without --devices every device jax sees is used. --compile also lowers and compiles
the train step on the abstract inputs and reports XLA's memory analysis of the compiled
program per device. On a CPU that is XLA CPU's buffer assignment, with the reference
attention in place of the GPU kernel: an estimate, not a GPU measurement. --dry-run shrinks
the model as train_router.py --dry-run does (2 layers, hidden 128, 512 tokens) so that
everything, --compile included, runs in seconds on a CPU. Bad input (a malformed --mesh, a
mesh that does not use the devices, a batch that does not split) prints one line and exits
with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import tempfile
import textwrap
import threading
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:  # shapes.py is a sibling module, not part of the package
  sys.path.insert(0, HERE)

MESH_AXES = ("data", "fsdp", "sequence", "tensor")  # elastic_jax.sharding.MESH_AXES
CATEGORIES = {
    "backbone": "backbone params (frozen)",
    "router": "router params (trainable)",
    "optimizer": "optimizer state",
    "other_state": "other state (step, key, multipliers)",
    "batch": "batch (one step's global batch)",
}
LARGE = 2 ** 20        # a weight this big must not sit whole on every device
TICK_S = 30.0          # progress lines while lowering / compiling


def parse_args(argv=None) -> argparse.Namespace:
  """The command line (argparse only: no jax yet, so the device count can still be set)."""
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", default=os.path.join(ROOT, "configs", "llama3_8b.yaml"),
                 help="train.py YAML run config (default: configs/llama3_8b.yaml)")
  p.add_argument("overrides", nargs="*", metavar="section.key=value",
                 help="dotted overrides of the config, as train.py takes them")
  p.add_argument("--model", choices=("llama3_8b", "qwen3_8b"), default="llama3_8b",
                 help="backbone shape (shapes.py)")
  p.add_argument("--devices", type=int, help="plan for N devices (fake CPU devices if no "
                 "accelerator is configured); default: every device jax sees")
  p.add_argument("--mesh", help="axis sizes, e.g. data=1,fsdp=-1,sequence=2,tensor=1; "
                 "replaces the config's mesh section (axes left out take their defaults)")
  p.add_argument("--seq-len", type=int, help="tokens per row (data.seq_len)")
  p.add_argument("--micro-batch", type=int,
                 help="rows per forward/backward pass (data.micro_batch; 0 = all)")
  p.add_argument("--compile", action="store_true",
                 help="also compile the train step and report XLA's memory analysis")
  p.add_argument("--json", metavar="PATH", help="write the plan as JSON here")
  p.add_argument("--dry-run", action="store_true", help="tiny shapes, runs in seconds")
  return p.parse_args(argv)


def setup_devices(n: int | None) -> None:
  """Asks for N fake CPU devices before jax starts, unless an accelerator is configured or
  jax is already imported (then its devices are used as they are)."""
  if n is None or "jax" in sys.modules:
    return
  if os.environ.get("JAX_PLATFORMS", "cpu").strip().lower() not in ("", "cpu"):
    return
  flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "",
                 os.environ.get("XLA_FLAGS", "")).split()
  os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])
  os.environ["JAX_PLATFORMS"] = "cpu"


def parse_mesh(text: str) -> dict[str, int]:
  """'data=1,fsdp=-1,sequence=2' -> axis sizes; raises ElasticJaxError naming the fault."""
  from elastic_jax.errors import ElasticJaxError
  sizes: dict[str, int] = {}
  for item in text.split(","):
    name, sep, value = (s.strip() for s in item.partition("="))
    if not sep or not name:
      raise ElasticJaxError(f"--mesh '{text}': expected axis=size items separated by commas "
                            f"(axes {', '.join(MESH_AXES)}), got '{item}'")
    if name not in MESH_AXES:
      raise ElasticJaxError(f"--mesh '{text}': unknown axis '{name}' (known: "
                            f"{', '.join(MESH_AXES)})")
    if name in sizes:
      raise ElasticJaxError(f"--mesh '{text}': axis '{name}' is given twice")
    if not re.fullmatch(r"-?\d+", value):
      raise ElasticJaxError(f"--mesh '{text}': the size of axis '{name}' should be an integer "
                            f"(or -1 for the remaining devices), got '{value}'")
    sizes[name] = int(value)
  return sizes


# ----------------------------------------------------------------------------------------------
# Bytes per device


def item_bytes(dtype) -> int:
  """Bytes per element; a PRNG key counts its raw key data."""
  import jax
  import numpy as np
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    raw = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), dtype))
    return math.prod(raw.shape) * np.dtype(raw.dtype).itemsize
  return np.dtype(dtype).itemsize


def device_bytes(x) -> dict[Any, int]:
  """Bytes of abstract array `x` (with .sharding) on each device of its sharding."""
  item = item_bytes(x.dtype)
  out = {}
  for dev, index in x.sharding.devices_indices_map(tuple(x.shape)).items():
    n = 1
    for sl, dim in zip(index, x.shape):
      n *= len(range(*sl.indices(dim)))
    out[dev] = n * item
  return out


def tree_device_bytes(tree, devices) -> dict[Any, int]:
  """Bytes of every abstract array of `tree` together, on each of `devices`."""
  import jax
  total = {d: 0 for d in devices}
  for x in jax.tree.leaves(tree):
    for d, b in device_bytes(x).items():
      total[d] += b
  return total


def whole_bytes(tree) -> int:
  """Bytes of the arrays of `tree` unsharded (one copy of each)."""
  import jax
  return sum(math.prod(x.shape) * item_bytes(x.dtype) for x in jax.tree.leaves(tree))


def fmt(b: float) -> str:
  """Bytes for people: '3.74 GiB'."""
  for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
    if abs(b) >= scale:
      return f"{b / scale:.2f} {unit}"
  return f"{int(b)} B"


# ----------------------------------------------------------------------------------------------
# The plan


def load_config(args):
  """The run config as train.py reads it, with the flags applied as dotted overrides."""
  from elastic_jax.train.run_config import MeshConfig, load_run_config
  from elastic_jax.errors import ElasticJaxError
  over = (["router.block=16", "router.local_blocks=4"] if args.dry_run else [])
  over += list(args.overrides)
  if args.seq_len is not None:
    over.append(f"data.seq_len={args.seq_len}")
  if args.micro_batch is not None:
    over.append(f"data.micro_batch={args.micro_batch or 'null'}")
  cfg = load_run_config(args.config, over)
  if args.dry_run and cfg.data.seq_len > 512:
    over.append("data.seq_len=512")
    cfg = load_run_config(args.config, over)
  if args.mesh is not None:
    sizes = parse_mesh(args.mesh)
    try:
      cfg = dataclasses.replace(cfg, mesh=MeshConfig(**sizes))
    except ValueError as e:
      raise ElasticJaxError(f"--mesh '{args.mesh}': {e}") from None
  return cfg, over


def model_config(name: str, dry_run: bool):
  """The ModelConfig of shapes.py's SHAPES[name], shrunk for a dry run."""
  from shapes import SHAPES
  from elastic_jax.config import config_from_hf_dict
  hf = dict(SHAPES[name])
  if dry_run:  # as train_router.py --dry-run
    hf.update(hidden_size=128, intermediate_size=256, num_hidden_layers=2, vocab_size=1024,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32)
  return config_from_hf_dict(hf, f"{name} shape")


def config_name(path: str) -> str:
  """`path` relative to the repository when it lies inside it (no machine paths in output)."""
  full = os.path.abspath(path)
  return os.path.relpath(full, ROOT) if full.startswith(ROOT + os.sep) else path


def describe_split(axes, spec, shape, rules, mesh) -> str:
  """'embed over fsdp; vocab over tensor', 'replicated', plus rules that did not apply."""
  parts, kept = [], []
  for name, s, dim in zip(axes, tuple(spec) + (None,) * (len(axes) - len(spec)), shape):
    if s is not None:
      parts.append(f"{name} over {'x'.join((s,) if isinstance(s, str) else s)}")
    elif rules.get(name):
      want = rules[name]
      want = (want,) if isinstance(want, str) else want
      n = math.prod(mesh.shape[a] for a in want)
      kept.append(f"{name} whole ({dim} not divisible by {'x'.join(want)}={n})")
  return "; ".join(sorted(parts) + sorted(kept)) if parts or kept else "replicated"


def plan(args, say: Callable[[str], None] = print) -> dict[str, Any]:
  """Builds the memory plan that `args` (parse_args) asks for; prints it through `say`."""
  import jax
  from elastic_jax.errors import ElasticJaxError
  from elastic_jax.train.setup import (BATCH_DTYPES, abstract_train_state, backbone_shardings,
                                      batch_sharding, mesh_layout)

  cfg, overrides = load_config(args)
  devices = jax.devices()
  if args.devices is not None:
    if args.devices < 1 or args.devices > len(devices):
      raise ElasticJaxError(f"--devices {args.devices}: jax has {len(devices)} "
                            f"{jax.default_backend()} device(s) here")
    devices = devices[:args.devices]
  mcfg = model_config(args.model, args.dry_run)

  # The mesh, the backbone's placement and the train state, by loop.py's own functions.
  mesh_shape, mesh, rules, micro = mesh_layout(cfg, devices)
  d = cfg.data
  # "auto" is the checkpoint's own dtype; the published checkpoints of these shapes are bf16.
  dtype = "bfloat16" if cfg.model.dtype == "auto" else cfg.model.dtype
  shapes, axes, p_shard = backbone_shardings(mcfg, dtype, mesh)
  backbone = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                          shapes, p_shard)
  state = abstract_train_state(cfg, mcfg, mesh)

  # One step's batch, as loop.to_global() hands it to train_step.
  b_shard = batch_sharding(mesh, micro is not None)
  lead = (micro, d.global_batch // micro) if micro else (d.global_batch,)
  batch = {k: jax.ShapeDtypeStruct(
      (*lead, d.max_segments if k == "task_ids" else d.seq_len), dt, sharding=b_shard[k])
      for k, dt in BATCH_DTYPES.items()}

  # One forward/backward pass of it (the step scans the passes), for reference.
  one = batch_sharding(mesh, False)
  per_pass = {k: jax.ShapeDtypeStruct((d.rows_per_pass, *v.shape[-1:]), v.dtype,
                                      sharding=one[k]) for k, v in batch.items()}

  parts = {"backbone": backbone, "router": state.trainable["router"],
           "optimizer": state.opt_state,
           "other_state": {"step": state.step, "key": state.key,
                           "lambdas": state.trainable["lambdas"]},
           "batch": batch}
  per_dev = {k: tree_device_bytes(v, devices) for k, v in parts.items()}
  whole = {k: whole_bytes(v) for k, v in parts.items()}
  roles: dict[tuple, list[int]] = {}
  for dev in devices:
    roles.setdefault(tuple(per_dev[k][dev] for k in CATEGORIES), []).append(dev.id)
  per_device = {k: max(per_dev[k].values()) for k in CATEGORIES}
  per_device["total"] = max(sum(v) for v in roles)
  whole["total"] = sum(whole.values())

  # How each weight is split, grouped by split; big weights left whole.
  live_rules = dict(rules)
  flat_axes = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
  weights, groups = [], {}
  for (path, x), ax in zip(jax.tree_util.tree_leaves_with_path(backbone), flat_axes):
    name = jax.tree_util.keystr(path, simple=True, separator="/")
    split = describe_split(ax, x.sharding.spec, x.shape, live_rules, mesh)
    on_dev = max(device_bytes(x).values())
    size = math.prod(x.shape) * item_bytes(x.dtype)
    weights.append({"name": name, "shape": list(x.shape), "dtype": str(x.dtype),
                    "logical_axes": list(ax), "spec": str(x.sharding.spec), "split": split,
                    "bytes": size, "per_device_bytes": on_dev})
    groups.setdefault(split, []).append(name)
  param_axes = sorted({a for names in flat_axes for n in names if live_rules.get(n)
                       for a in ((live_rules[n],) if isinstance(live_rules[n], str)
                                 else live_rules[n])})
  big_whole = [w["name"] for w in weights
               if w["bytes"] >= LARGE and w["per_device_bytes"] == w["bytes"]]

  out: dict[str, Any] = {
      "model": {"name": args.model, "dry_run": args.dry_run, "family": mcfg.family,
                "layers": mcfg.num_layers, "hidden": mcfg.hidden_size,
                "intermediate": mcfg.intermediate_size, "vocab": mcfg.vocab_size,
                "heads": mcfg.num_heads, "kv_heads": mcfg.num_kv_heads,
                "head_dim": mcfg.head_dim, "qk_norm": mcfg.qk_norm,
                "dtype": dtype,
                "parameters": sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))},
      "config": config_name(args.config),
      "overrides": overrides,
      "platform": jax.default_backend(), "device_kind": devices[0].device_kind,
      "devices": len(devices), "mesh": dict(mesh_shape),
      "batch": {"global_batch": d.global_batch, "seq_len": d.seq_len,
                "micro_batch": d.micro_batch, "passes": micro or 1,
                "max_segments": d.max_segments,
                "pass_per_device_bytes": max(tree_device_bytes(per_pass, devices).values()),
                "shapes": {k: list(v.shape) for k, v in batch.items()},
                "specs": {k: str(v.sharding.spec) for k, v in batch.items()}},
      "attn_impl": cfg.model.attn_impl, "packed": cfg.train.packed, "remat": cfg.model.remat,
      "per_device_bytes": per_device, "whole_bytes": whole,
      "roles": [{"devices": ids, "bytes": dict(zip(CATEGORIES, key))}
                for key, ids in roles.items()],
      "param_sharding_axes": param_axes,
      "sharding_groups": [{"split": k, "params": v} for k, v in groups.items()],
      "params": weights,
      "replicated_large": big_whole if param_axes else [],
      "compiled": None,
  }
  rows = d.rows_per_pass // max(mesh_shape.get("data", 1) * mesh_shape.get("fsdp", 1), 1)
  act = activation_model(out["model"], max(rows, 1), d.seq_len, dict(mesh_shape),
                         item_bytes(dtype), cfg.model.remat, cfg.model.mlp_chunk)
  act["peak"] = per_device["total"] + act["activations"]
  out["activations_on_paper"] = act
  report(out, say)
  if d.seq_len > mcfg.max_position_embeddings:
    say(f"note: data.seq_len {d.seq_len} exceeds the model's max_position_embeddings "
        f"({mcfg.max_position_embeddings}); RoPE positions extrapolate")

  if args.compile:
    step_kw = dict(cfg=mcfg, rcfg=cfg.router, ocfg=cfg.objective, tcfg=cfg.train,
                   attn_impl=cfg.model.attn_impl, remat=cfg.model.remat, rules=rules,
                   mlp_chunk=cfg.model.mlp_chunk)
    out["compiled"] = compile_step(state, backbone, batch, step_kw, mesh, say)
    report_compiled(out, say)
  return out


# The loss's chunk of tokens (objective.chunked_answer_cross_entropy's default).
LOSS_CHUNK = 1024


def activation_model(m: dict, rows: int, tokens: int, mesh: dict, dtype_bytes: int = 2,
                     remat: bool = True, mlp_chunk: int = 0) -> dict[str, int]:
  """Bytes per device of the train step's activations, worked out on paper from the model's
  shapes (m: plan()'s "model"), `rows` rows of `tokens` tokens in one pass. The terms:

  - layer_inputs: with remat, the layer scan keeps each layer's input for the backward pass
    ([L, rows, T, E] in the compute dtype), the one activation kept for every layer;
  - layer_backward: the backward pass of one layer, which first recomputes its forward: per
    token, its input, the two norms' outputs, the attention output and its projection (5 E),
    q and the attention output per head (2 N H), k and v (2 K H), the MLP's gate, up and
    product with their three gradients (6 F), and the kernel's log-sum-exp (N, float32);
    with model.mlp_chunk (each chunk of the MLP rematerialised on its own) the 6 F term counts
    one chunk's tokens, not the row's;
  - loss: one chunk of LOSS_CHUNK tokens' float32 logits, their softmax and its gradient
    (3 c V x 4 bytes); the loss keeps nothing per chunk for its backward pass.

  Tokens split over the mesh's sequence axis, rows over data x fsdp, heads and the MLP over
  tensor. Without remat every layer keeps its whole forward (L x layer_backward, roughly).
  The peak is the arguments plus layer_inputs plus the larger of the other two.
  """
  seq, tp = mesh.get("sequence", 1), mesh.get("tensor", 1)
  t = rows * -(-tokens // seq)
  e, f, l = m["hidden"], m["intermediate"] // tp, m["layers"]
  n, k, h = m["heads"] // tp, max(m["kv_heads"] // tp, 1), m["head_dim"]
  per_token = dtype_bytes * (5 * e + 2 * n * h + 2 * k * h) + 4 * n
  mlp_tokens = rows * min(mlp_chunk, tokens // seq) if mlp_chunk else t
  layer = t * per_token + mlp_tokens * dtype_bytes * 6 * f
  out = {"layer_inputs": l * t * e * dtype_bytes if remat else l * layer,
         "layer_backward": layer,
         "loss": 3 * rows * min(LOSS_CHUNK, tokens) * m["vocab"] * 4}
  out["activations"] = out["layer_inputs"] + max(out["layer_backward"], out["loss"])
  return out


def report(p: dict, say) -> None:
  """The plan as text: header, the per-device table, the weights' splits, the verdict."""
  m, b = p["model"], p["batch"]
  mesh = " ".join(f"{a}={n}" for a, n in p["mesh"].items())
  say(f"memory plan: {m['name']} shape{' (dry run)' if m['dry_run'] else ''}: {m['layers']} "
      f"layers, hidden {m['hidden']}, MLP {m['intermediate']}, {m['heads']}/{m['kv_heads']} "
      f"heads x {m['head_dim']}, vocab {m['vocab']}; {m['parameters'] / 1e9:.3f} B "
      f"parameters in {m['dtype']}")
  kind = "" if p["device_kind"] == p["platform"] else f" ({p['device_kind']})"
  say(f"config {p['config']}; mesh {mesh} over {p['devices']} {p['platform']} device(s){kind}")
  passes = (f"{b['passes']} passes of {b['micro_batch']} rows" if b["passes"] > 1
            else "one pass")
  say(f"batch: {b['global_batch']} rows x {b['seq_len']} tokens per step, {passes}; rows over "
      f"data x fsdp, tokens over sequence (input_ids {b['shapes']['input_ids']} "
      f"{b['specs']['input_ids']}); train state replicated, as in loop.py")
  roles = p["roles"]
  heads = ([f"all {p['devices']} devices"] if len(roles) == 1
           else [f"devices {r['devices'][0]}.." if len(r["devices"]) > 1
                 else f"device {r['devices'][0]}" for r in roles])
  say("")
  say(f"  {'per device':<40}" + "".join(f"{h:>16}" for h in heads) + f"{'unsharded':>14}")
  for k, label in CATEGORIES.items():
    say(f"  {label:<40}" + "".join(f"{fmt(r['bytes'][k]):>16}" for r in roles)
        + f"{fmt(p['whole_bytes'][k]):>14}")
  say(f"  {'total':<40}" + "".join(f"{fmt(sum(r['bytes'].values())):>16}" for r in roles)
      + f"{fmt(p['whole_bytes']['total']):>14}")
  if b["passes"] > 1:
    say(f"  (of the batch, one pass of {b['micro_batch']} rows: "
        f"{fmt(b['pass_per_device_bytes'])} per device)")
  say("")
  say("backbone weights over the mesh (logical axis over mesh axes):")
  for g in p["sharding_groups"]:
    say(textwrap.fill(f"{g['split']}: {', '.join(g['params'])}", 100, initial_indent="  ",
                      subsequent_indent="      ", break_on_hyphens=False))
  if not p["param_sharding_axes"]:
    say("every weight is whole on every device: the mesh has no axis that shards parameters "
        "(fsdp = tensor = 1)")
  elif p["replicated_large"]:
    say(textwrap.fill(
        f"REPLICATED: {len(p['replicated_large'])} weight(s) of >= 1 MiB whole on every device "
        f"although the mesh shards parameters over {' and '.join(p['param_sharding_axes'])}: "
        f"{', '.join(p['replicated_large'])}", 100, subsequent_indent="  ",
        break_on_hyphens=False))
  else:
    say(f"every backbone weight of >= 1 MiB is sharded (over "
        f"{' and '.join(p['param_sharding_axes'])})")
  a = p.get("activations_on_paper")
  if a:
    say("")
    say("activations per device, on paper (activation_model: one pass's rows):")
    labels = {"layer_inputs": "each layer's input, kept by the layer scan",
              "layer_backward": "one layer's recomputed forward + backward",
              "loss": f"one loss chunk ({LOSS_CHUNK} tokens' logits)",
              "peak": "peak: arguments + inputs + the larger of the two"}
    for k, label in labels.items():
      say(f"  {label:<48}{fmt(a[k]):>14}")


class Ticker:
  """Prints the elapsed time every TICK_S seconds while a long call runs."""

  def __init__(self, what: str, say, t0: float):
    self.what, self.say, self.t0 = what, say, t0
    self.stop = threading.Event()
    self.thread = threading.Thread(target=self._run, daemon=True)

  def _run(self):
    while not self.stop.wait(TICK_S):
      self.say(f"  ... {self.what}: {time.perf_counter() - self.t0:.0f}s")

  def __enter__(self):
    self.thread.start()
    return self

  def __exit__(self, *exc):
    self.stop.set()
    self.thread.join()


def compile_step(state, backbone, batch, step_kw, mesh, say) -> dict[str, Any]:
  """Lowers and compiles train_step on the abstract inputs, as loop.py calls it."""
  import jax
  from elastic_jax.train.step import train_step
  say("")
  say("compiling the train step on the abstract inputs ...")
  t0 = time.perf_counter()
  with jax.set_mesh(mesh):
    with Ticker("lowering", say, t0):
      lowered = train_step.lower(state, backbone, batch, **step_kw)
    t_lower = time.perf_counter() - t0
    say(f"  lowered in {t_lower:.1f}s")
    with Ticker("compiling", say, t0):
      compiled = lowered.compile()
  t_compile = time.perf_counter() - t0 - t_lower
  say(f"  compiled in {t_compile:.1f}s")
  ma = compiled.memory_analysis()
  out: dict[str, Any] = {"platform": jax.default_backend(), "lower_s": round(t_lower, 2),
                         "compile_s": round(t_compile, 2)}
  if ma is None:
    out["memory_analysis"] = None
    return out
  fields = {"argument": "argument_size_in_bytes", "output": "output_size_in_bytes",
            "temp": "temp_size_in_bytes", "generated_code": "generated_code_size_in_bytes",
            "alias": "alias_size_in_bytes"}
  mem = {k: int(getattr(ma, f, 0) or 0) for k, f in fields.items()}
  mem["peak_estimate"] = mem["argument"] + mem["output"] - mem["alias"] + mem["temp"]
  out["memory_analysis"] = mem
  return out


def report_compiled(p: dict, say) -> None:
  """XLA's memory analysis of the compiled step, per device."""
  c = p["compiled"]
  mem = c["memory_analysis"]
  if mem is None:
    say("XLA gives no memory analysis on this backend")
    return
  if c["platform"] == "cpu":
    say("compiled, per device: XLA CPU's buffer assignment (the CPU backend: reference "
        "attention in place of the GPU kernel; an estimate, not a GPU measurement)")
  else:
    say(f"compiled, per device: XLA's buffer assignment on {c['platform']}")
  labels = {"argument": "arguments (state, backbone, batch)", "output": "outputs",
            "alias": "outputs aliased to donated inputs", "temp": "temporaries",
            "generated_code": "generated code",
            "peak_estimate": "arguments + outputs - aliased + temporaries"}
  for k, label in labels.items():
    say(f"  {label:<48}{fmt(mem[k]):>14}")
  say(f"  (planned arguments per device: {fmt(p['per_device_bytes']['total'])})")


def write_json(path: str, obj: dict) -> None:
  """Writes `obj` to `path` atomically (a temp file in the same folder, then a rename)."""
  path = os.path.abspath(path)
  parent = os.path.dirname(path)
  os.makedirs(parent, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
  try:
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      json.dump(obj, f, indent=1)
      f.write("\n")
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def main(argv=None) -> int:
  """Plans, prints and writes --json; raises ElasticJaxError on bad input."""
  args = parse_args(argv)
  setup_devices(args.devices)  # before jax starts
  t0 = time.perf_counter()
  result = plan(args, lambda s: print(s, flush=True))
  result["wall_s"] = round(time.perf_counter() - t0, 2)
  if args.json:
    write_json(args.json, result)
    print(f"plan written to {args.json}")
  return 0


def cli(argv=None) -> int:
  """main() with the library's CLI handling: bad input -> one line on stderr, status 2."""
  from elastic_jax.cli import run_cli
  return run_cli(lambda: main(argv))


if __name__ == "__main__":
  # jax must see the device count before elastic_jax (which imports it) is loaded.
  setup_devices(parse_args().devices)
  sys.exit(cli())
