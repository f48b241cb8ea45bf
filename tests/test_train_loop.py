"""train.py end to end: outputs, resuming after SIGKILL / SIGTERM, meshes, two processes, bad input.

Every run is a subprocess of `train.py --config configs/tiny.yaml` shortened by overrides (10
steps of 8 rows x 64 tokens). The subprocesses share one persistent compilation cache, so only
the first run of each device layout pays for compiling.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from elastic_jax import router_io
from elastic_jax.tasks import TASK_TYPES
from elastic_jax.train.run_config import load_run_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
STEPS = 10
COMMON = [f"train.steps={STEPS}", "data.seq_len=64", "data.global_batch=8", "log.every_steps=1",
          "checkpoint.every_steps=2", "data.synthetic.eval_batches=1"]
NO_EVAL = ["data.synthetic.eval_batches=0"]  # for runs compared by their losses only
TIMEOUT = 300


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("jax_cache"))


def _env(cache_dir, devices):
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
             JAX_COMPILATION_CACHE_DIR=cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0", PYTHONUNBUFFERED="1")
  return env


def _argv(run_dir, *overrides, flags=()):
  return [sys.executable, "train.py", "--config", TINY, *flags, *COMMON, f"run_dir={run_dir}",
          *overrides]


def _start(cache_dir, run_dir, *overrides, devices=1, flags=()):
  return subprocess.Popen(_argv(run_dir, *overrides, flags=flags), cwd=ROOT, text=True,
                          env=_env(cache_dir, devices), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE)


def _finish(proc, timeout=TIMEOUT):
  try:
    out, err = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    out, err = proc.communicate()
    pytest.fail(f"train.py did not finish in {timeout}s:\n{out}\n{err}")
  return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _train(cache_dir, run_dir, *overrides, devices=1):
  return _finish(_start(cache_dir, run_dir, *overrides, devices=devices))


def _ok(proc):
  assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
  return proc


def _metrics(run_dir):
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _losses(run_dir):
  return {r["step"]: r["loss"] for r in _metrics(run_dir)}


def _committed(run_dir):
  ckpt = os.path.join(run_dir, "checkpoints")
  if not os.path.isdir(ckpt):
    return []
  return sorted(int(d) for d in os.listdir(ckpt)
                if d.isdigit() and os.path.exists(os.path.join(ckpt, d, "commit_success.txt")))


def _wait_for_checkpoint(proc, run_dir, timeout=TIMEOUT):
  """Polls until a checkpoint before the last step is committed; returns its step."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    steps = [s for s in _committed(run_dir) if s < STEPS]
    if steps:
      return steps[0]
    if proc.poll() is not None:
      out, err = proc.communicate()
      pytest.fail(f"train.py ended (exit {proc.returncode}) before a mid-run checkpoint:\n"
                  f"{out}\n{err}")
    time.sleep(0.01)
  proc.kill()
  pytest.fail("no mid-run checkpoint appeared")


def _ours(run_dir):
  routers = router_io.load_routers(os.path.join(run_dir, "export", "elastic_jax"))
  tensors = {f"router.{k}": v for k, v in routers.params.items()}
  tensors.update({f"lambdas.{k}": v for k, v in (routers.lambdas or {}).items()})
  return tensors, routers.meta


def _assert_same_export(run_dir, ref_dir):
  ours, _ = _ours(run_dir)
  ref, _ = _ours(ref_dir)
  assert ours.keys() == ref.keys()
  for k in ref:
    np.testing.assert_array_equal(ours[k], ref[k], err_msg=k)


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module")
def started(cache_dir, tmp_path_factory):
  """The runs that compile from scratch, started together so that they share the cores:
  {name: (run dir, [processes])}. Each test waits for its own."""
  base = tmp_path_factory.mktemp("runs")
  port = _free_port()
  dist = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
  runs = {
      "ref": (str(base / "ref"), [_start(cache_dir, str(base / "ref"))]),
      "mesh8": (str(base / "mesh8"), [_start(cache_dir, str(base / "mesh8"), "mesh.data=2",
                                             "mesh.fsdp=2", "mesh.sequence=2", *NO_EVAL,
                                             devices=8)]),
      "two": (str(base / "two"), [_start(cache_dir, str(base / "two"), *NO_EVAL, devices=2,
                                         flags=[*dist, "--process-id", str(i)])
                                  for i in range(2)]),
  }
  yield runs
  for _, procs in runs.values():
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.communicate()


@pytest.fixture(scope="module")
def reference(started):
  """One uninterrupted single-device run: (run dir, finished process)."""
  run_dir, (proc,) = started["ref"]
  return run_dir, _ok(_finish(proc))


# ----------------------------------------------------------------------------------------------
# 1. End to end


def test_cli_run_writes_everything(reference):
  run_dir, proc = reference
  lines = [l for l in proc.stdout.splitlines() if l.startswith("step ")]
  pattern = re.compile(r"step\s+(\d+)/10\s+loss \d+\.\d+ .*msr \d\.\d+ \[.*\].*\s"
                       r"([\d,]+|\?) tok/s\s+eta (\?|\d\d:\d\d:\d\d)$")
  assert [int(pattern.match(l).group(1)) for l in lines] == list(range(1, STEPS + 1)), proc.stdout
  assert "held-out MSR per task" in proc.stdout

  cfg = load_run_config(TINY, [*COMMON, f"run_dir={run_dir}"])
  assert load_run_config(os.path.join(run_dir, "config.yaml")) == cfg

  records = _metrics(run_dir)
  assert [r["step"] for r in records] == list(range(1, STEPS + 1))
  for r in records:
    assert np.isfinite(r["loss"]) and 0 <= r["msr"] <= 1 and set(r["msr_task"]) <= set(TASK_TYPES)
  assert all(r["tokens_per_s"] > 0 for r in records[1:])

  with open(os.path.join(run_dir, "eval.json")) as f:
    ev = json.load(f)
  assert ev["step"] == STEPS and ev["msr_task"] and set(ev["msr_task"]) <= set(TASK_TYPES)
  assert ev["targets"] == dict(zip(TASK_TYPES, cfg.objective.targets))

  ours, meta = _ours(run_dir)
  num_layers = meta["backbone"]["num_layers"]
  assert num_layers == 4 and meta["objective_targets"] == list(cfg.objective.targets)
  # The smoke config's 8-token blocks have no place in the authors' layout: said, not written
  # (the layout itself: tests/test_authors.py).
  assert not os.path.exists(os.path.join(run_dir, "export", "authors"))
  assert "note: export.authors skipped: " in proc.stdout
  assert "its SSA block is 128 tokens, this router's is 8" in proc.stdout


def test_cli_trains_under_an_xattention_pattern_pair(cache_dir, tmp_path):
  """train.py with router.patterns: the routers train and export with the pair recorded
  (both XA pairs' gradients: test_train_step.py)."""
  setting = "fa-xa"
  run_dir = str(tmp_path / setting)
  _ok(_train(cache_dir, run_dir, f"router.patterns={setting}", "router.xa_block=16",
             "router.xa_stride=4", "train.steps=3", *NO_EVAL))
  records = _metrics(run_dir)
  assert len(records) == 3 and all(np.isfinite(r["loss"]) for r in records)
  with open(os.path.join(run_dir, "export", "elastic_jax", "routers.json")) as f:
    assert json.load(f)["router"]["patterns"] == setting


# ----------------------------------------------------------------------------------------------
# 2-3. Resuming


def test_resume_after_sigkill_is_bit_exact(reference, cache_dir, tmp_path):
  ref_dir, _ = reference
  run_dir = str(tmp_path / "run")
  # Asynchronous saves here (the reference saves synchronously): the step does not change.
  proc = _start(cache_dir, run_dir, "checkpoint.async_save=true")
  _wait_for_checkpoint(proc, run_dir)
  proc.send_signal(signal.SIGKILL)
  proc.communicate(timeout=60)
  assert proc.returncode == -signal.SIGKILL
  resume_from = max(_committed(run_dir))
  assert 2 <= resume_from < STEPS, "the run finished before it was killed"
  assert not os.path.exists(os.path.join(run_dir, "export"))
  first = _metrics(run_dir)

  again = _ok(_train(cache_dir, run_dir, "checkpoint.async_save=true"))
  assert f"resumed from step {resume_from}" in again.stdout
  # The killed run's lock died with it: taken over, and said.
  assert f"note: {run_dir} was locked by process {proc.pid} (started " in again.stdout
  _assert_same_export(run_dir, ref_dir)
  records = _metrics(run_dir)
  assert records[:len(first)] == first  # appended, not rewritten
  tail = records[len(first):]
  ref = _losses(ref_dir)
  assert [r["step"] for r in tail] == list(range(resume_from + 1, STEPS + 1))
  assert [r["loss"] for r in tail] == [ref[s] for s in range(resume_from + 1, STEPS + 1)]
  assert all(r["loss"] == ref[r["step"]] for r in first)
  # Asked for fewer steps than the checkpoint holds: nothing trains, and it says so.
  fewer = _ok(_train(cache_dir, run_dir, "train.steps=6", *NO_EVAL))
  assert f"note: the checkpoint is at step {STEPS}, at or past train.steps=6" in fewer.stdout
  _assert_same_export(run_dir, ref_dir)


def test_sigterm_saves_and_stops_then_resumes(reference, cache_dir, tmp_path):
  ref_dir, _ = reference
  run_dir = str(tmp_path / "run")
  proc = _start(cache_dir, run_dir)
  _wait_for_checkpoint(proc, run_dir)
  proc.send_signal(signal.SIGTERM)
  done = _finish(proc, timeout=60)
  assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
  m = re.search(r"signal received: saved step (\d+) to \S+; stopping", done.stdout)
  assert m, done.stdout
  stopped = int(m.group(1))
  assert stopped < STEPS and max(_committed(run_dir)) == stopped
  assert max(r["step"] for r in _metrics(run_dir)) == stopped
  assert not os.path.exists(os.path.join(run_dir, "export"))
  assert not os.path.exists(os.path.join(run_dir, "eval.json"))

  again = _ok(_train(cache_dir, run_dir))
  assert f"resumed from step {stopped}" in again.stdout
  assert [r["step"] for r in _metrics(run_dir)] == list(range(1, STEPS + 1))
  assert _losses(run_dir) == _losses(ref_dir)
  _assert_same_export(run_dir, ref_dir)


# ----------------------------------------------------------------------------------------------
# 4-5. Meshes and processes


def _assert_close_losses(run_dir, ref_dir):
  got, ref = _losses(run_dir), _losses(ref_dir)
  assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
  np.testing.assert_allclose([got[s] for s in sorted(got)], [ref[s] for s in sorted(ref)],
                             rtol=1e-5)


def test_eight_device_mesh_matches_one_device(reference, started):
  """data 2 x fsdp 2 x sequence 2: sharded backbone, split rows and sequence-parallel attention."""
  ref_dir, _ = reference
  run_dir, (proc,) = started["mesh8"]
  proc = _ok(_finish(proc))
  assert "over 8 devices" in proc.stdout and "'data': 2, 'fsdp': 2, 'sequence': 2" in proc.stdout
  _assert_close_losses(run_dir, ref_dir)


def test_two_processes_match_one(reference, started):
  """jax.distributed on localhost: two processes of two CPU devices each (gloo collectives)."""
  ref_dir, _ = reference
  run_dir, procs = started["two"]
  results = [_ok(_finish(p)) for p in procs]
  assert "over 4 devices, 2 process(es)" in results[0].stdout
  assert "step " not in results[1].stdout  # progress comes from process 0 only
  _assert_close_losses(run_dir, ref_dir)
  assert os.path.exists(os.path.join(run_dir, "export", "elastic_jax", "routers.safetensors"))


# ----------------------------------------------------------------------------------------------
# 6. Bad input


def _assert_clean_failure(proc, run_dir, *needles):
  assert proc.returncode == 2, f"{proc.stdout}\n{proc.stderr}"
  errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
  assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
  for needle in needles:
    assert needle in errors[0], errors[0]
  assert not os.path.exists(os.path.join(run_dir, "checkpoints"))
  assert not os.path.exists(os.path.join(run_dir, "config.yaml"))


def test_unknown_config_key_exits_2(cache_dir, tmp_path):
  run_dir = str(tmp_path / "run")
  proc = _train(cache_dir, run_dir, "train.learning_rate=0.1")
  _assert_clean_failure(proc, run_dir, "train.learning_rate")
  assert not os.path.exists(run_dir)


def _tokenizer_dir(path):
  from tokenizers import Tokenizer, models, pre_tokenizers
  words = ["<pad>", "<unk>", "</s>", "what", "is", "the", "capital", "of", "france", "paris",
           "?", "."]
  tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  os.makedirs(path)
  tok.save(os.path.join(path, "tokenizer.json"))
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>",
               "pad_token": "<pad>", "unk_token": "<unk>"}, f)
  return path


def test_corrupt_data_line_exits_2(cache_dir, tmp_path):
  run_dir = str(tmp_path / "run")
  data = tmp_path / "train.jsonl"
  good = json.dumps({"context": "paris", "question": "what is the capital of france ?",
                     "answer": "paris .", "task": "single_qa"})
  data.write_text(f"{good}\n{good}\n{{\"context\": \"paris\", \"question\n{good}\n")
  tok = _tokenizer_dir(str(tmp_path / "tok"))
  proc = _train(cache_dir, run_dir, f"data.train_path={data}", f"data.tokenizer={tok}")
  _assert_clean_failure(proc, run_dir, f"{data}:3")
