"""benchmarks/attention.py's report of the kernel issue's targets, on rows made up here: the
ratios, the met flags, and each speed target's value at the matrix-product ceiling worked out
by hand from the rows' times and work."""

import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "bench_attention", os.path.join(ROOT, "benchmarks", "attention.py"))
bench = sys.modules["bench_attention"] = importlib.util.module_from_spec(_spec)   # dataclasses
sys.path.append(os.path.join(ROOT, "benchmarks"))   # its `attention_torch` import, while loading
try:
  _spec.loader.exec_module(bench)
finally:
  sys.path.pop()


def test_targets_and_their_values_at_the_ceiling():
  kh, ceiling = 8, 500.0                          # TFLOP/s
  full_work = 100e12                              # FLOPs of every head full at this length
  rows = [bench.Row("cuDNN causal", "cudnn_causal", None, full_work, sec=0.25),
          bench.Row("cuDNN window", "cudnn_window", None, 3e12, sec=0.012),
          bench.Row("ours", "ours", 0, full_work, sec=0.24),
          bench.Row("ours", "ours", 6, 28e12, sec=0.07),
          bench.Row("ours", "ours", 8, 3e12, sec=0.010),
          bench.Row("Flex hybrid", "flex", 6, 28e12, sec=0.1)]
  fwd = {131072: bench.annotate(rows, kh, ceiling)}
  got = {t["target"]: t for t in bench.targets(fwd, {}, kh, ceiling)}
  full = got["T=131072 MSR 0: ours / cuDNN causal throughput"]
  assert full["value"] == pytest.approx(0.25 / 0.24) and full["met"] is False
  assert full["bound"] == pytest.approx(0.25 / 0.2)        # 100 TFLOP at 500 TFLOP/s: 0.2 s
  share = got["T=131072 MSR 0: ours' TFLOP/s / the matrix-product ceiling"]
  assert share["value"] == pytest.approx(100 / 0.24 / 500) and share["met"] is True
  assert share["bound"] is None
  # MSR 0.75: two full heads at the ceiling (0.25 * 0.2 s) and six streaming ones at the
  # faster window time (ours' 0.010 s against cuDNN's 0.012), 0.0575 s in all.
  best = 0.25 * 0.2 + 0.75 * 0.010
  flex = got["T=131072 MSR 0.75: ours vs Flex hybrid, speed-up"]
  assert flex["value"] == pytest.approx(0.1 / 0.07) and flex["met"] is False
  assert flex["bound"] == pytest.approx(0.1 / best)
  dense = got["T=131072 MSR 0.75: ours vs cuDNN causal, speed-up"]
  assert dense["value"] == pytest.approx(0.25 / 0.07) and dense["bound"] == pytest.approx(
      0.25 / best)
  window = got["T=131072 MSR 1: ours vs cuDNN window, speed-up"]
  assert window["value"] == pytest.approx(1.2) and window["met"] is True
  # Without a ceiling (or without our MSR 0 row) there is no bound to give.
  assert all(t["bound"] is None for t in bench.targets(fwd, {}, kh, None))
  no_full = {131072: bench.annotate([r for r in rows if r.streams != 0], kh, ceiling)}
  assert all(t["bound"] is None for t in bench.targets(no_full, {}, kh, ceiling))


def test_the_ceiling_is_the_fastest_of_the_runs_measurements():
  """The product measured before and after the rows: the yardstick is the faster (a card's
  clock only lowers what a product reaches), with both kept and their spread."""
  before = {"size": 8192, "tflops": 550.0, "ms": 2.0, "forms": {"bf16 out": {}}}
  after = {"size": 8192, "tflops": 587.0, "ms": 1.87, "forms": {"bf16 out": {}}}
  got = bench.combined_ceiling({"before the rows": before, "after the rows": after})
  assert got["tflops"] == 587.0 and got["ms"] == 1.87
  assert got["spread"] == pytest.approx(587 / 550)
  assert got["runs"] == {"before the rows": before, "after the rows": after}
  assert bench.combined_ceiling({"before the rows": after, "after the rows": before})[
      "tflops"] == 587.0


def test_profile_split_labels_each_scope_and_phase():
  """benchmarks/xprof.py on a CPU trace of a rematerialised gradient with the model's named
  scopes: every scope's operations are found in each phase they run in (forward, remat's
  recomputation, backward), nothing the program ran is counted twice, and the split sums to
  the operations' total."""
  import jax
  import jax.numpy as jnp
  import tempfile
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  try:
    import xprof
  finally:
    sys.path.pop(0)

  def layer(x, w):
    with jax.named_scope("attention_core"):
      x = x * w[:1, :x.shape[1]]
      x = jax.nn.softmax(x @ x.T, axis=-1) @ x
    with jax.named_scope("mlp"):
      x = jnp.tanh(x @ w) @ w.T
    return x

  def f(x, w):
    y = jax.checkpoint(layer)(x, w)
    with jax.named_scope("router"):
      y = y * jax.nn.sigmoid(y.mean())
    with jax.named_scope("loss"):
      return (y ** 2).sum()

  step = jax.jit(jax.value_and_grad(f, argnums=1))
  x, w = jnp.ones((128, 64)) * 0.01, jnp.ones((64, 256)) * 0.02
  compiled = step.lower(x, w).compile()
  origins = xprof.origins(compiled.as_text())
  assert origins and all(v.startswith("jit(") or "/" not in v for v in origins.values())
  jax.block_until_ready(compiled(x, w))
  trace = tempfile.mkdtemp()
  with jax.profiler.trace(trace):
    jax.block_until_ready(compiled(x, w))
  ops = xprof.device_ops(trace, "jit_f")
  assert ops and not any(xprof._CONTAINERS.fullmatch(op) for op, _ in ops)
  by_label, by_op, total = xprof.split(ops, origins)
  assert total == sum(ns for _, ns in ops) == sum(by_label.values()) == sum(by_op.values())
  seen = {key for key, ns in by_label.items() if ns > 0}
  for scope in ("attention_core", "mlp"):
    assert {(scope, "forward"), (scope, "recompute"), (scope, "backward")} <= seen, seen
  assert ("router", "backward") in seen
  assert xprof.label("jit(s)/transpose(jvp(T))/while/body/checkpoint/rematted_computation/"
                     "layers/router/dot_general") == ("router", "recompute")
  assert xprof.label("jit(s)/transpose(jvp(T))/layers/attention_core/pallas_call") == (
      "attention_core", "backward")
  assert xprof.label("jit(s)/jvp(T)/layers/attn/add") == ("rest", "forward")
  assert xprof.label("jit(s)/transpose(jvp(router))/add_any") == ("router", "backward")
  assert xprof.label("jit(s)/jvp(loss)/reduce_sum") == ("loss", "forward")
  assert xprof.label(None) == ("unmatched", "-")
