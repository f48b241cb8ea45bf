"""Where a compiled program's device time goes: the operations of a `jax.profiler` trace matched
to the JAX operations that made them, and summed per named scope and per phase.

Every device operation of an XLA program carries the name of the HLO instruction it runs
(`hlo_op`); the optimised HLO that XLA dumps (`--xla_dump_to`) gives each instruction its
`op_name`, the JAX name stack of the operation it came from. The model labels its parts with
`jax.named_scope` ("router", "attention_core", "mlp"; the train step "loss" and "optimizer"),
and autodiff and remat mark the phase in the same stack:

  forward     no "transpose(" in the stack: the first pass
  recompute   "rematted_computation": the forward ops that remat runs again in the backward pass
  backward    "transpose(" without "rematted_computation": the gradients

Everything outside the five scopes is "rest" (the projections, norms, RoPE, the layer loop's
copies); an operation whose instruction is not in the dump is "unmatched". On a GPU the
device plane's "XLA Ops" line (one event per operation) is read where the trace has it, else
every device event with an `hlo_op`; on a CPU (tests, --dry-run) the host threads' operation
events, which carry the same names.
"""

from __future__ import annotations

import collections
import glob
import os
import re

SCOPES = ("attention_core", "router", "mlp", "loss", "optimizer")
PHASES = ("forward", "recompute", "backward")


def origins(hlo_text: str) -> dict[str, str]:
  """Instruction name -> op_name in an HLO module's text (every computation's)."""
  return {m.group(1): m.group(2) for m in re.finditer(
      r"^\s*(?:ROOT )?%?([\w.-]+) = [^\n]*?op_name=\"([^\"]*)\"", hlo_text, re.M)}


def hlo_origins(dump_dir: str, module: str) -> dict[str, str]:
  """`origins` of the optimised HLO of the dumped module whose file name holds `module` (the
  last one dumped where several match)."""
  done = sorted(glob.glob(os.path.join(dump_dir, f"*{module}*after_optimizations.txt")))
  if not done:
    return {}
  with open(done[-1], encoding="utf-8") as f:
    return origins(f.read())


# Control flow runs other operations, which have events of their own (a CPU traces both).
_CONTAINERS = re.compile(r"(while|cond|conditional|call)(\.\d+)?")


def _stat(event, name):
  for key, value in event.stats:
    if key == name:
      return value
  return None


def trace_planes(trace_dir: str) -> list:
  """The planes of the trace `jax.profiler.trace(trace_dir)` wrote ([] where none)."""
  from jax.profiler import ProfileData
  files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
  return list(ProfileData.from_file(files[0]).planes) if files else []


def device_ops(trace_dir: str, module: str) -> list[tuple[str, float]]:
  """(HLO instruction, nanoseconds) of every operation of `module` in the trace."""
  planes = trace_planes(trace_dir)
  device = [p for p in planes if "/device:" in p.name and "CPU" not in p.name]
  out = []
  for plane in device or [p for p in planes if p.name.startswith("/host:CPU")]:
    lines = list(plane.lines)
    ops_line = [ln for ln in lines if ln.name == "XLA Ops"]
    for line in ops_line or lines:
      if line.name in ("XLA Modules", "Steps", "XLA TraceMe"):
        continue
      for ev in line.events:
        op = ev.name if ops_line else _stat(ev, "hlo_op")
        mod = _stat(ev, "hlo_module")
        if (op is None or _CONTAINERS.fullmatch(str(op))
            or (mod is not None and module not in str(mod))):
          continue
        out.append((str(op), float(ev.duration_ns)))
  return out


def label(op_name: str | None) -> tuple[str, str]:
  """(scope, phase) of an operation from its op_name (module docstring)."""
  if op_name is None:
    return "unmatched", "-"
  # A scope at the top of a differentiated function reads "jvp(router)" or
  # "transpose(jvp(router))"; inside a loop or a checkpoint, "router".
  parts = {re.sub(r"^(?:\w+\()*([\w.]+)\)*$", r"\1", p) for p in op_name.split("/")}
  scope = next((s for s in SCOPES if s in parts), "rest")
  if "rematted_computation" in parts:
    phase = "recompute"
  elif "transpose(" in op_name:
    phase = "backward"
  else:
    phase = "forward"
  return scope, phase


def split(ops, origins: dict[str, str]):
  """(ns per (scope, phase), ns per instruction, total ns) of `device_ops`' output."""
  by_label, by_op = collections.Counter(), collections.Counter()
  for op, ns in ops:
    by_label[label(origins.get(op))] += ns
    by_op[op] += ns
  return by_label, by_op, sum(by_label.values())


def print_split(ops, origins: dict[str, str], steps: int = 1, top: int = 12) -> dict:
  """The table of `split` per step (ms and share), then the `top` costliest instructions with
  the tail of their op_name; returns {"scope/phase": ms per step}."""
  by_label, by_op, total = split(ops, origins)
  if not total:
    print("  (no operation of the program in the trace)")
    return {}
  print(f"  device time {total / 1e6 / steps:.1f} ms a step, by scope and phase:")
  rows = {}
  for (scope, phase), ns in sorted(by_label.items(), key=lambda kv: -kv[1]):
    rows[f"{scope}/{phase}"] = ns / 1e6 / steps
    print(f"    {scope:<15} {phase:<10} {ns / 1e6 / steps:10.2f} ms  {ns / total:6.1%}")
  print(f"  the {top} costliest operations:")
  for op, ns in by_op.most_common(top):
    print(f"    {ns / 1e6 / steps:10.2f} ms  {op:<36} {(origins.get(op) or '?')[-100:]}")
  return rows
