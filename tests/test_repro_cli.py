"""The reproduction end to end on the shipped backbone: train.py on the task mixture (a few
steps), eval.py mixture on a handful of items, the results table; and the local tasks, which
the shipped backbone answers with full attention and with streaming heads alone, and the
far-context ones, which it answers with full attention only."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKBONE = os.path.join(ROOT, "elastic_jax", "repro", "backbone")


def _run(script, *args):
  env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS="--xla_force_host_platform_device_count=1")
  return subprocess.run([sys.executable, *script, *map(str, args)], capture_output=True,
                        text=True, env=env, timeout=900, cwd=ROOT)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  root = tmp_path_factory.mktemp("repro")
  proc = _run(["-m", "elastic_jax.eval.mixture", root / "data", "--per-task", "4",
               "--eval-per-task", "1", "--min-len", "128", "--max-len", "256"])
  assert proc.returncode == 0, proc.stderr[-3000:]
  proc = _run(["train.py", "--config", "mixture_cpu.yaml"], f"run_dir={root / 'run'}",
              "train.steps=3", f"data.train_path={root / 'data' / 'train.jsonl'}",
              f"data.eval_path={root / 'data' / 'eval.jsonl'}",
              "checkpoint.every_steps=0", "log.every_steps=1")
  assert proc.returncode == 0, proc.stderr[-3000:]
  return root


def test_the_mixture_writes_jsonl_that_train_py_reads(run):
  lines = open(run / "data" / "train.jsonl", encoding="utf-8").read().splitlines()
  assert len(lines) == 20
  assert {json.loads(x)["template"] for x in lines} <= {0, 1}
  with open(run / "run" / "eval.json") as f:
    msr = json.load(f)["msr_task"]
  assert set(msr) == {"single_qa", "multihop_qa", "summarization", "code", "icl"}
  meta = json.load(open(run / "run" / "export" / "elastic_jax" / "routers.json"))
  assert meta["router"]["block"] == 16 and meta["backbone"]["num_kv_heads"] == 8


def test_eval_mixture_and_the_results_table(run):
  out = run / "eval"
  proc = _run(["eval.py", "mixture"], "--model", BACKBONE, "--routers",
              run / "run" / "export" / "elastic_jax", "--dtype", "float32", "--attn-impl",
              "reference", "--attention", "full,elastic,sparse", "--lengths", "384",
              "--heldout-lengths", "384", "--samples", "2", "--batch-size", "10", "--out", out)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rep = json.load(open(out / "report.json"))
  full, sparse = rep["attention"]["full"]["tasks"], rep["attention"]["sparse"]["tasks"]
  assert set(full) == {f"{t}@{v}" for t in ("kv", "hop", "summary", "pattern", "fewshot")
                       for v in ("seen", "held-out")}
  # The local tasks' answers lie inside the streaming heads' window: the backbone answers
  # them with full attention and with streaming heads only.
  for setting in (full, sparse):
    local = [setting[f"{t}@{v}"]["score"] for t in ("summary", "pattern")
             for v in ("seen", "held-out")]
    assert sum(local) / 4 >= 75.0, local
  # The sensitive tasks need the far context: the backbone retrieves with full attention and
  # not with streaming heads alone.
  far = {s: [setting[f"{t}@{v}"]["score"] for t in ("kv", "hop") for v in ("seen", "held-out")]
         for s, setting in (("full", full), ("sparse", sparse))}
  assert sum(far["full"]) / 4 >= 75.0 and sum(far["sparse"]) / 4 <= 25.0, far
  assert all(r["msr"] == 1.0 for r in sparse.values())
  assert all(r["msr"] == 0.0 for r in full.values())
  table = run / "table.md"
  proc = _run(["-m", "elastic_jax.repro.report"], "--run", f"elastic={out}", "--out", table,
              "--plots", run / "plots")
  assert proc.returncode == 0, proc.stderr[-3000:]
  text = table.read_text()
  assert "| Full attention |" in text and "| All heads SSA |" in text and "held-out" in text
  assert (run / "plots" / "routing_map.png").stat().st_size > 0


def test_mixture_refuses_another_tokenizer(tmp_path):
  from elastic_jax.eval import mixture
  # A model directory whose tokenizer is a different word list.
  import shutil
  shutil.copytree(BACKBONE, tmp_path / "m")
  vocab = json.load(open(tmp_path / "m" / "tokenizer.json"))
  words = vocab["model"]["vocab"]
  a, b = mixture.VOCAB[10], mixture.VOCAB[11]
  words[a], words[b] = words[b], words[a]
  json.dump(vocab, open(tmp_path / "m" / "tokenizer.json", "w"))
  proc = _run(["eval.py", "mixture"], "--model", tmp_path / "m", "--attention", "full",
              "--samples", "1", "--out", tmp_path / "out")
  assert proc.returncode == 2 and "not the task mixture's" in proc.stderr
  assert not (tmp_path / "out" / "report.json").exists()
  # Training data in words the tokenizer does not know: refused, not trained on <unk>s.
  (tmp_path / "foreign.jsonl").write_text("\n".join(json.dumps(
      {"context": "zebra quantum marmalade " * 20, "question": "why xylophone ?",
       "answer": "because", "task": "code"}) for _ in range(8)) + "\n")
  proc = _run(["train.py"], f"data.train_path={tmp_path / 'foreign.jsonl'}", "data.eval_path=null",
              f"run_dir={tmp_path / 'run'}")
  assert proc.returncode == 2 and "are the tokenizer's unknown token" in proc.stderr
  assert not (tmp_path / "run" / "checkpoints").exists()


def test_shipped_gpu_routers_route_by_task_regime():
  # The routers trained on the GPU with configs/mixture.yaml at the sparsest budget where they
  # beat every trained static set (docs/results.md §7h) load against the shipped backbone and
  # keep more heads on full attention for far-context questions than for local ones, on
  # prompts of the held-out wording they never saw; the trained static gate shipped beside
  # them is one head set for every input, at about their average MSR.
  import numpy as np
  import elastic_jax as ej
  from elastic_jax.eval import mixture
  model = ej.ElasticModel.from_pretrained(BACKBONE, dtype="float32",
                                          routers=os.path.join(BACKBONE, "..", "routers"))
  rng = np.random.default_rng(11)
  static = ej.ElasticModel.from_pretrained(
      BACKBONE, dtype="float32", routers=os.path.join(BACKBONE, "..", "routers_static"))
  msr, gates, static_gates = {}, {}, []
  for task in ("kv", "summary"):
    prompts = []
    for _ in range(4):
      s = mixture.make_sample(task, rng, 512, mixture.HELDOUT_TEMPLATE)
      prompts.append([mixture.BOS, *s.context.tolist(), *s.question.tolist()])
    gen = model.generate(prompts, attention="elastic", max_new_tokens=1)
    msr[task], gates[task] = float(np.mean(gen.msr)), np.asarray(gen.gates)
    static_gates.append(static.generate(prompts, attention="elastic", max_new_tokens=1).gates)
  assert msr["kv"] < msr["summary"], msr
  # Every head full for a local question is full for every retrieval one too: the retrieval
  # inputs add heads to the local set.
  local = gates["summary"].max(axis=1)                         # [L, K] over the 4 prompts
  assert (gates["kv"] >= local[:, None]).all()
  g = np.concatenate(static_gates, axis=1)                       # [L, 8 prompts, K]
  assert (g == g[:, :1]).all()
  static_msr = 1 - float(g[:, 0].mean())
  assert abs(static_msr - (msr["kv"] + msr["summary"]) / 2) <= 1.5 / g[:, 0].size, (
      msr, static_msr)


def _report_dir(path, benchmark, tasks):
  path.mkdir()
  body = {"tasks": {t: {"score": 50.0, "msr": 0.5, "esr": 0.25} for t in tasks}}
  (path / "report.json").write_text(json.dumps({"benchmark": benchmark, "model": "m",
                                                "attention": {"full": body}}))
  return path


@pytest.mark.parametrize("benchmark,tasks,fragment", [
    ("ruler", ["niah_single_1/4096"], "a report of `eval.py ruler`, not of `eval.py mixture`"),
    ("mixture", [], "holds no finished task of the mixture"),
    (None, ["qasper"], "holds no finished task of the mixture"),
])
def test_report_refuses_a_run_it_cannot_read(tmp_path, capsys, benchmark, tasks, fragment):
  from elastic_jax.errors import ElasticJaxError
  from elastic_jax.repro.report import main
  run = _report_dir(tmp_path / "run", benchmark, tasks)
  with pytest.raises(ElasticJaxError, match="report.json: ") as e:
    main(["--run", f"elastic={run}", "--out", str(tmp_path / "table.md")])
  assert fragment in str(e.value) and "\n" not in str(e.value)
  assert not (tmp_path / "table.md").exists() and capsys.readouterr().out == ""


def test_report_refuses_a_label_given_twice(tmp_path, capsys):
  from elastic_jax.errors import ElasticJaxError
  from elastic_jax.repro.report import main
  a = _report_dir(tmp_path / "a", "mixture", ["kv@seen"])
  b = _report_dir(tmp_path / "b", "mixture", ["kv@seen"])
  with pytest.raises(ElasticJaxError, match="the label 'elastic' is given twice"):
    main(["--run", f"elastic={a}", "--run", f"elastic={b}", "--out", str(tmp_path / "t.md")])
  assert not (tmp_path / "t.md").exists() and capsys.readouterr().out == ""
  # Through the command line: exit status 2 and the one sentence, no traceback.
  proc = _run(["-m", "elastic_jax.repro.report"], "--run", f"elastic={a}", "--run",
              f"elastic={b}")
  assert proc.returncode == 2 and "given twice" in proc.stderr
  assert "Traceback" not in proc.stderr and proc.stdout == ""
