"""eval.py end to end on a tiny random model with a tokenizer built here: RULER and LongBench
reports and plots, resumption, bad input."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import elastic_jax as ej
from elastic_jax.generation.generate import SamplingConfig
from elastic_jax.router import RouterConfig, init_router_params
from elastic_jax.router_io import Routers, save_routers
from elastic_jax.train.objective import ObjectiveConfig, init_lambdas
from toktools import save_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = ["the special magic number for apple is 12345 and the grass is green and the sky is "
         "blue", "What is the answer? Paragraph 3 question passage count words memorize"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  """A tiny Qwen3 model with a tokenizer, and routers exported as train.py does."""
  root = tmp_path_factory.mktemp("eval")
  cfg = save_tiny_model(root / "m", TEXTS)
  rcfg = RouterConfig(block=16, local_blocks=4, boundary=8)
  trainable = {"router": init_router_params(cfg, rcfg, jax.random.key(1)),
               "lambdas": init_lambdas(jax.random.key(2))}
  save_routers(str(root / "export" / "elastic_jax"),
               Routers(trainable["router"], rcfg, trainable["lambdas"]), cfg,
               targets=ObjectiveConfig().targets)
  # A trained static router's export (router.static): one gate per (layer, KV head), its
  # logit margins distinct so that they rank the heads.
  srcfg = dataclasses.replace(rcfg, static=True)
  logits = np.zeros((2, 2, 2), np.float32)
  logits[..., 1] = np.arange(4, dtype=np.float32).reshape(2, 2) - 1.5
  save_routers(str(root / "static" / "export" / "elastic_jax"),
               Routers({"static_logits": logits}, srcfg, trainable["lambdas"]), cfg,
               targets=ObjectiveConfig().targets)
  return root


def _eval(*args):
  env = dict(os.environ, PYTHONPATH=ROOT)
  return subprocess.run([sys.executable, os.path.join(ROOT, "eval.py"), *map(str, args)],
                        capture_output=True, text=True, env=env, timeout=900)


def test_ruler_report_plots_and_resume(model_dir):
  out = model_dir / "ruler"
  args = ("ruler", "--model", model_dir / "m", "--routers", model_dir / "export/elastic_jax",
          "--static-routers", model_dir / "static/export/elastic_jax",
          "--lengths", "1024", "--tasks", "niah_single_1,vt", "--samples", "2",
          "--dtype", "float32", "--attn-impl", "reference", "--out", out)
  proc = _eval(*args)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = (out / "predictions.jsonl").read_text().splitlines()
  assert len(lines) == 2 * 2 * 4                       # tasks x samples x settings
  report = json.loads((out / "report.json").read_text())
  assert set(report["attention"]) == {"full", "elastic", "most-chosen", "static-gate"}
  # The static gate keeps full its highest-margin pairs, as many as elastic's average: here
  # the last of the four (layer 1, KV head 1) first.
  recs = [json.loads(x) for x in lines]
  n_full = round(4 * np.mean([np.mean(r["gates"]) for r in recs if r["attention"] == "elastic"]))
  for r in recs:
    if r["attention"] == "static-gate":
      assert np.asarray(r["gates"]).reshape(-1).tolist() == [0] * (4 - n_full) + [1] * n_full
  assert "elastic − static-gate" in (out / "report.md").read_text()
  # Input-dependent routers are no static gate: one sentence, exit 2, nothing written.
  bad = _eval("ruler", "--model", model_dir / "m", "--routers",
              model_dir / "export/elastic_jax", "--static-routers",
              model_dir / "export/elastic_jax", "--out", model_dir / "bad")
  assert bad.returncode == 2 and "not a static router" in bad.stderr
  assert not (model_dir / "bad").exists()
  for body in report["attention"].values():
    assert set(body["tasks"]) == {"niah_single_1@1024", "vt@1024"}
    for row in body["tasks"].values():
      assert 0 <= row["score"] <= 100 and 0 <= row["msr"] <= 1 and row["n"] == 2
  assert report["attention"]["full"]["average"]["msr"] == 0
  assert "covers the longest prompt" not in proc.stdout   # the routers' window is 80 tokens
  elastic_msr = report["attention"]["elastic"]["average"]["msr"]
  assert abs(report["attention"]["most-chosen"]["average"]["msr"] - elastic_msr) <= 0.25 + 1e-6
  md = (out / "report.md").read_text()
  assert "| retrieval (NIAH) | niah_single_1@1024 |" in md
  for png in ("routing_map.png", "msr_per_task.png", "quality_vs_speedup.png"):
    assert (out / png).read_bytes()[:4] == b"\x89PNG"
  # A rerun generates nothing new and rewrites the same report.
  again = _eval(*args)
  assert again.returncode == 0, again.stderr[-3000:]
  assert (out / "predictions.jsonl").read_text().splitlines() == lines
  assert "items to generate" not in again.stdout + again.stderr


def test_ruler_under_the_xattention_settings(model_dir):
  """FA-XA evaluates end to end (XA-SSA's model path: test_train_step.py); the setting is
  recorded, and an output directory made under one setting is not reused under another."""
  base = ("ruler", "--model", model_dir / "m", "--routers", model_dir / "export/elastic_jax",
          "--lengths", "512", "--tasks", "niah_single_1", "--samples", "1", "--dtype",
          "float32", "--attn-impl", "reference", "--attention", "elastic,sparse")
  out = model_dir / "ruler_fa-xa"
  proc = _eval(*base, "--patterns", "fa-xa", "--xa-threshold", "0.5", "--out", out)
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads((out / "report.json").read_text())
  assert report["patterns"] == "fa-xa" and report["xa_threshold"] == 0.5
  # Every head XA: the ESR is the pruned fraction of the blocks the last layer skipped.
  assert 0 < report["attention"]["sparse"]["average"]["esr"] < 1
  other = _eval(*base, "--patterns", "fa-ssa", "--out", model_dir / "ruler_fa-xa")
  assert other.returncode != 0 and "another --out" in other.stderr
  broken = model_dir / "ruler_broken"
  broken.mkdir()
  (broken / "setting.json").write_text("{not json")
  bad = _eval(*base, "--patterns", "fa-xa", "--out", broken)
  assert bad.returncode == 2 and "cannot be read" in bad.stderr
  assert not (broken / "predictions.jsonl").exists()


def test_longbench_from_local_files(model_dir):
  data = model_dir / "lb"
  data.mkdir()
  rec = lambda i, ds, ans, classes=None: json.dumps(
      {"input": f"question {i}?", "context": "the grass is green " * 30, "answers": [ans],
       "length": 120, "dataset": ds, "language": "en", "all_classes": classes, "_id": f"{i}"})
  (data / "hotpotqa.jsonl").write_text("\n".join(rec(i, "hotpotqa", "green") for i in range(2)))
  (data / "trec.jsonl").write_text(
      "\n".join(rec(i, "trec", "Number", ["Number", "Place"]) for i in range(2)))
  out = model_dir / "lb_out"
  proc = _eval("longbench", "--model", model_dir / "m", "--data", data, "--datasets",
               "hotpotqa,trec", "--dtype", "float32", "--attn-impl", "reference",
               "--attention", "full,sparse", "--max-length", "256", "--out", out)
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads((out / "report.json").read_text())
  tasks = report["attention"]["sparse"]["tasks"]
  assert tasks["hotpotqa"]["category"] == "Multi-Doc QA" and tasks["trec"]["n"] == 2
  assert report["attention"]["sparse"]["average"]["msr"] == 1
  # No --routers: the default window (2176 tokens) covers these 256-token prompts, and eval says so.
  assert "covers the longest prompt" in proc.stdout
  # LongBench-E: one row per dataset and length bucket.
  (data / "hotpotqa_e.jsonl").write_text("\n".join(
      json.dumps(dict(json.loads(rec(i, "hotpotqa", "green")), length=n))
      for i, n in enumerate((1000, 5000, 9000))))
  proc = _eval("longbench", "--model", model_dir / "m", "--data", data, "--datasets",
               "hotpotqa", "--e", "--dtype", "float32", "--attn-impl", "reference",
               "--attention", "full", "--max-length", "256", "--out", model_dir / "lbe_out")
  assert proc.returncode == 0, proc.stderr[-3000:]
  tasks = json.loads((model_dir / "lbe_out" / "report.json").read_text())["attention"]["full"]
  assert set(tasks["tasks"]) == {"hotpotqa@0-4k", "hotpotqa@4-8k", "hotpotqa@8k+"}
  assert tasks["categories"].keys() == {"Multi-Doc QA"}


def test_bad_input(model_dir):
  proc = _eval("longbench", "--model", model_dir / "m", "--data", model_dir / "nowhere",
               "--datasets", "hotpotqa", "--out", model_dir / "bad")
  assert proc.returncode == 2 and "nowhere" in proc.stderr
  assert not (model_dir / "bad" / "report.json").exists()
  proc = _eval("ruler", "--model", model_dir / "m", "--tasks", "no_such_task", "--out",
               model_dir / "bad2")
  assert proc.returncode == 2 and "no_such_task" in proc.stderr
  proc = _eval("ruler", "--model", model_dir / "m", "--attention", "elastic", "--lengths", "512",
               "--tasks", "vt", "--samples", "1", "--out", model_dir / "bad3")
  assert proc.returncode == 2 and "routers" in proc.stderr


def test_authors_model_directory_evaluates_with_its_own_routers(model_dir):
  """A directory in the authors' full-model layout (backbone + routers, their config keys)
  evaluates under elastic with no --routers: its own routers decide."""
  base = ej.from_pretrained(model_dir / "m", dtype="float32", show_progress=False)
  rcfg = RouterConfig(local_blocks=2)             # their layout: blocks of 128, boundary 100
  paw = dataclasses.replace(base, router_params=init_router_params(base.config, rcfg,
                                                                    jax.random.key(5)),
                            router_config=rcfg)
  ej.save_pretrained(paw, model_dir / "paw")
  assert json.loads((model_dir / "paw" / "config.json").read_text())["architectures"] == [
      "PawQwen3ForCausalLM"]
  out = model_dir / "paw_ruler"
  proc = _eval("ruler", "--model", model_dir / "paw", "--lengths", "512", "--tasks",
               "niah_single_1", "--samples", "1", "--dtype", "float32", "--attn-impl", "reference",
               "--attention", "full,elastic", "--out", out)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "routers: the model directory's own (fa-ssa" in proc.stdout
  report = json.loads((out / "report.json").read_text())
  assert set(report["attention"]) == {"full", "elastic"}
  gen = paw.generate([[5, 6, 7] * 50], sampling=SamplingConfig(max_new_tokens=3),
                     attn_impl="reference")
  want = np.asarray(paw.logits([5, 6, 7] * 50, attention="elastic", return_routing=True)[1][
      "gates"])
  np.testing.assert_array_equal(gen.gates, want)


def test_longbench_v2_and_provenance_of_reused_predictions(model_dir):
  """LongBench-v2 on a valid file with the default truncation; a rerun into the same --out
  with another dtype, or with other routers, is refused; --overwrite starts over."""
  data = model_dir / "lb2"
  data.mkdir()
  records = [{"_id": f"r{i}", "domain": "d", "sub_domain": "s", "difficulty": "easy",
              "length": "short", "question": f"which color is the grass {i}?",
              "choice_A": "green", "choice_B": "blue", "choice_C": "red", "choice_D": "pink",
              "answer": "A", "context": "the grass is green " * 20} for i in range(2)]
  (data / "data.json").write_text(json.dumps(records))
  out = model_dir / "lb2_out"
  base = ("longbench-v2", "--model", model_dir / "m", "--data", data, "--attn-impl", "reference",
          "--attention", "full", "--out", out)
  proc = _eval(*base, "--dtype", "float32")
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads((out / "report.json").read_text())
  assert report["attention"]["full"]["tasks"]["easy/short"]["n"] == 2
  other = _eval(*base, "--dtype", "bfloat16")
  assert other.returncode == 2
  assert "holds predictions made with dtype 'float32', not 'bfloat16'" in other.stderr
  routers = _eval(*base[:-4], "--routers", model_dir / "export/elastic_jax", "--attention",
                  "full", "--out", out, "--dtype", "float32")
  assert routers.returncode == 2 and "holds predictions made with routers None" in routers.stderr
  again = _eval(*base, "--dtype", "bfloat16", "--overwrite")
  assert again.returncode == 0, again.stderr[-3000:]
  assert json.loads((out / "setting.json").read_text())["dtype"] == "bfloat16"
  assert len((out / "predictions.jsonl").read_text().splitlines()) == 2
