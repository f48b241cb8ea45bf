"""benchmarks/memory_plan.py on the 8 CPU devices of conftest.py: the per-device bytes it
reports against sizes worked out here from the model's shapes alone, the compiled step's XLA
memory analysis, and bad input exiting with status 2."""

import importlib.util
import json
import os

import jax
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "memory_plan", os.path.join(ROOT, "benchmarks", "memory_plan.py"))
memory_plan = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(memory_plan)

CONFIG = os.path.join(ROOT, "configs", "llama3_8b.yaml")
BF16, F32, I32, BOOL = 2, 4, 4, 1


def run_plan(*argv):
  args = memory_plan.parse_args(["--config", CONFIG, "--dry-run", *argv])
  return memory_plan.plan(args, say=lambda s: None)


def weight_sizes(m):
  """Elements of each backbone weight of a Llama / Qwen3 shape, with how it should split:
  'e' has the hidden (embed) axis, 'v' the vocab, 'q' query heads, 'k' KV heads, 'f' MLP."""
  e, f, v, l = m["hidden"], m["intermediate"], m["vocab"], m["layers"]
  n, k, h = m["heads"], m["kv_heads"], m["head_dim"]
  sizes = [("ve", v * e), ("ev", e * v), ("e", e),
           ("eq", l * e * n * h), ("ek", l * e * k * h), ("ek", l * e * k * h),
           ("qe", l * n * h * e), ("e", l * e), ("e", l * e),
           ("ef", l * e * f), ("ef", l * e * f), ("fe", l * f * e)]
  if m["qk_norm"]:
    sizes += [("", l * h), ("", l * h)]
  return sizes


@pytest.mark.parametrize("mesh,fsdp,tensor", [("fsdp=4,sequence=2", 4, 1),
                                              ("fsdp=2,sequence=2,tensor=2", 2, 2)])
@pytest.mark.parametrize("model", ["llama3_8b", "qwen3_8b"])
def test_per_device_bytes_follow_the_shapes(model, mesh, fsdp, tensor):
  p = run_plan("--model", model, "--mesh", mesh)
  m = p["model"]
  assert (m["hidden"], m["layers"], m["vocab"]) == (128, 2, 1024)  # the dry-run shrink
  assert p["devices"] == 8 and p["mesh"] == {"data": 1, "fsdp": fsdp, "sequence": 2,
                                             "tensor": tensor}
  sizes = weight_sizes(m)
  assert sum(n for _, n in sizes) == m["parameters"]
  # Every axis named in the rules splits (the tiny dims divide 2 and 4): embed over fsdp,
  # vocab / heads / MLP over tensor.
  split = lambda axes: (fsdp if "e" in axes else 1) * (tensor if set(axes) & set("vqkf") else 1)
  expect = sum(BF16 * n // split(axes) for axes, n in sizes)
  assert p["per_device_bytes"]["backbone"] == expect
  assert p["whole_bytes"]["backbone"] == BF16 * m["parameters"]
  assert p["replicated_large"] == []
  # The batch: 48 rows of 512 tokens (4 int32 + 2 bool per token) and 8 task slots per row;
  # rows over fsdp, tokens over sequence.
  b = p["batch"]
  assert (b["global_batch"], b["seq_len"], b["micro_batch"]) == (48, 512, 4)
  tokens = 48 * 512 * (4 * I32 + 2 * BOOL) // (fsdp * 2)
  assert p["per_device_bytes"]["batch"] == tokens + 48 * 8 * I32 // fsdp
  # The train state is replicated: each device holds all of it. Router: per layer and per
  # matrix pair h x 4h, 4h x h (task and route), h x 2 and their biases, float32.
  h, w, l = m["head_dim"], 4 * m["head_dim"], m["layers"]
  router = F32 * l * (4 * h * w + 2 * h + 2 * (w + h) + 2)
  assert p["per_device_bytes"]["router"] == router == p["whole_bytes"]["router"]
  assert p["per_device_bytes"]["optimizer"] > 2 * router  # Adam moments at least
  assert len(p["roles"]) == 1 and p["roles"][0]["devices"] == [d.id for d in jax.devices()]
  assert p["per_device_bytes"]["total"] == sum(
      p["per_device_bytes"][k] for k in memory_plan.CATEGORIES)
  # Activations on paper: one pass of 4 rows over fsdp (1 row per device at fsdp 4), tokens
  # over sequence, heads and the MLP over tensor; each layer's input kept in bf16.
  a = p["activations_on_paper"]
  rows, t = 4 // fsdp, 512 // 2
  e, f, n, k = m["hidden"], m["intermediate"] // tensor, m["heads"] // tensor, m["kv_heads"]
  k = max(k // tensor, 1)
  assert a["layer_inputs"] == l * rows * t * e * BF16
  assert a["layer_backward"] == rows * t * (BF16 * (5 * e + 2 * (n + k) * h + 6 * f) + F32 * n)
  assert a["loss"] == 3 * rows * 512 * m["vocab"] * F32
  # model.mlp_chunk: the MLP's six [tokens, F] terms count one chunk of each row's tokens.
  chunked = memory_plan.activation_model(m, rows, 512, p["mesh"], BF16, True, 64)
  assert a["layer_backward"] - chunked["layer_backward"] == rows * (t - 64) * BF16 * 6 * f
  assert a["peak"] == p["per_device_bytes"]["total"] + a["layer_inputs"] + max(
      a["layer_backward"], a["loss"])


def test_a_rule_that_cannot_split_is_flagged(monkeypatch):
  """On tensor=4 the 2 KV heads of the tiny shape cannot split, and with fsdp=1 the K and V
  kernels are whole on every device; made big enough, they must be named."""
  monkeypatch.setattr(memory_plan, "LARGE", 1024)
  p = run_plan("--mesh", "tensor=4,fsdp=1,sequence=2", "--micro-batch", "0")
  assert sorted(p["replicated_large"]) == ["layers/attn/k_kernel", "layers/attn/v_kernel"]
  groups = {g["split"]: g["params"] for g in p["sharding_groups"]}
  assert sorted(groups["kv_heads whole (2 not divisible by tensor=4)"]) == [
      "layers/attn/k_kernel", "layers/attn/v_kernel"]
  assert p["batch"]["passes"] == 1 and p["batch"]["shapes"]["input_ids"] == [48, 512]
  # Pure data parallelism shards no weight, by design: nothing is flagged.
  p = run_plan("--mesh", "data=4,sequence=2")
  assert p["param_sharding_axes"] == [] and p["replicated_large"] == []
  assert p["per_device_bytes"]["backbone"] == p["whole_bytes"]["backbone"]


def test_compile_reports_xla_memory(tmp_path, capsys):
  out = tmp_path / "plan.json"
  rc = memory_plan.cli(["--config", CONFIG, "--dry-run", "--mesh", "fsdp=4,sequence=2",
                        "--compile", "--json", str(out)])
  assert rc == 0
  text = capsys.readouterr().out
  assert "XLA CPU's buffer assignment" in text and "not a GPU measurement" in text
  p = json.loads(out.read_text())
  mem = p["compiled"]["memory_analysis"]
  assert mem["temp"] > 0
  # XLA's per-device arguments are exactly the planned per-device state, backbone and batch.
  assert mem["argument"] == p["per_device_bytes"]["total"]
  # The train state is donated: its outputs reuse the input buffers.
  state = sum(p["per_device_bytes"][k] for k in ("router", "optimizer", "other_state"))
  assert 0 < mem["alias"] <= state
  assert [f.name for f in tmp_path.iterdir()] == ["plan.json"]  # no temp file left behind


@pytest.mark.parametrize("argv,needle", [
    (["--mesh", "fsdp=four"], "'fsdp' should be an integer"),
    (["--mesh", "fsdp4"], "expected axis=size"),
    (["--mesh", "pipeline=2"], "unknown axis 'pipeline'"),
    (["--mesh", "fsdp=3"], "uses 3 devices but 8 are available"),
    (["--mesh", "fsdp=4,sequence=2", "--micro-batch", "6"],
     "data.micro_batch (6) must be a multiple of mesh data x fsdp (4)"),
    (["--mesh", "fsdp=2,sequence=4", "--devices", "16"], "--devices 16"),
])
def test_bad_input_exits_2(argv, needle, capsys, tmp_path):
  out = tmp_path / "plan.json"
  rc = memory_plan.cli(["--config", CONFIG, "--dry-run", "--json", str(out), *argv])
  err = capsys.readouterr().err
  assert rc == 2
  assert err.startswith("error: ") and needle in err and len(err.strip().splitlines()) == 1
  assert not out.exists()
