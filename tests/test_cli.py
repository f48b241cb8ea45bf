"""The command-line entry points, end to end on a tiny model."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import elastic_jax as ej
from elastic_jax.config import config_from_hf_dict
from elastic_jax.model import init_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def _run(*args, cwd=ROOT):
  return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=ENV,
                        cwd=cwd)


def test_demo_runs_and_checks_itself(tmp_path):
  proc = _run("-m", "elastic_jax.demo", "--out", str(tmp_path / "demo"), "--tokens", "20")
  assert proc.returncode == 0, proc.stderr
  assert "HF dir vs converted: identical" in proc.stdout
  assert "HF -> ours -> HF tensors: identical" in proc.stdout


def test_eval_perplexity_matches_logits(tmp_path):
  with open(os.path.join(ROOT, "configs", "tiny_llama3.json")) as f:
    raw = json.load(f)
  cfg = config_from_hf_dict(raw)
  model = ej.ElasticModel(cfg, init_params(cfg, jax.random.key(3), "float32"), raw)
  ej.save_pretrained(model, tmp_path / "m")
  ids = [5, 17, 300, 2, 2, 99, 511, 0]
  (tmp_path / "ids.json").write_text(json.dumps(ids))
  proc = _run("eval.py", "ppl", "--model", str(tmp_path / "m"), "--ids",
              str(tmp_path / "ids.json"), "--dtype", "float32")
  assert proc.returncode == 0, proc.stderr
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  logits = np.asarray(model.logits(ids))[0, :-1].astype(np.float64)
  logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  nll = logz - logits[np.arange(len(ids) - 1), ids[1:]]
  assert result["tokens"] == len(ids)
  assert result["mean_nll"] == pytest.approx(nll.mean(), rel=1e-5)


def test_eval_bad_input_exits_2(tmp_path):
  (tmp_path / "ids.json").write_text("[1, 2,")
  proc = _run("eval.py", "ppl", "--model", str(tmp_path), "--ids", str(tmp_path / "ids.json"))
  assert proc.returncode == 2 and proc.stderr.startswith("error:")


def test_train_bad_arguments_exit_2(tmp_path):
  # The smoke config: the default one (the CPU reproduction) lays its 4 rows out for 1 device.
  tiny = ("--config", "configs/tiny.yaml")
  proc = _run("train.py", *tiny, "train.steps=0", f"run_dir={tmp_path / 'run'}")
  assert proc.returncode == 2 and proc.stderr.startswith("error:")
  assert "train" in proc.stderr and "steps" in proc.stderr
  proc = _run("train.py", *tiny, f"model.path={tmp_path / 'missing.json'}")
  assert proc.returncode == 2 and "missing.json" in proc.stderr
  assert not (tmp_path / "run").exists()
