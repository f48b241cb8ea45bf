"""The package as a user installs it: a wheel built from the repository, installed in a fresh
virtual environment, runs its console commands and the demo from an unrelated folder (no
repository files on the path: configs and the shipped backbone come from the package). And
the core install alone (no extras, its dependencies from the package index) loads the shipped
backbone and generates, without the evaluation's packages; the wheel carries the license."""

import glob
import os
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPTIONAL = ("matplotlib", "rouge", "jieba", "pyarrow", "torch", "tensorboardX", "fuzzywuzzy")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
  """The wheel built from the repository (once for the module)."""
  root = tmp_path_factory.mktemp("wheel")
  proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
                         "--disable-pip-version-check", "-w", str(root / "dist"), ROOT],
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  found = glob.glob(str(root / "dist" / "elastic_jax-*.whl"))
  assert len(found) == 1
  return found[0]


@pytest.fixture(scope="module")
def venv(tmp_path_factory, wheel):
  """`pip install WHEEL` (no extras) into a fresh environment, its dependencies from the
  package index: the core install a user gets, which the tests below run from."""
  env_dir = tmp_path_factory.mktemp("venv") / "core"
  subprocess.run([sys.executable, "-m", "venv", str(env_dir)], check=True, timeout=300)
  proc = subprocess.run([str(env_dir / "bin" / "python"), "-m", "pip", "install", "-q",
                         "--no-compile", "--disable-pip-version-check", wheel],
                        capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return env_dir


def _run(venv, args, cwd):
  env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1",
             PATH=f"{venv / 'bin'}:{env.get('PATH', '')}")
  return subprocess.run(args, capture_output=True, text=True, cwd=cwd, env=env, timeout=900)


def test_installed_wheel_runs_from_anywhere(venv, tmp_path):
  where = _run(venv, [str(venv / "bin" / "python"), "-c",
                      "import elastic_jax, os; print(os.path.dirname(elastic_jax.__file__))"],
               tmp_path)
  assert where.returncode == 0 and str(venv) in where.stdout, where.stdout + where.stderr
  plans = _run(venv, [str(venv / "bin" / "python"), "-c",
                      "import os, elastic_jax.repro as r; from elastic_jax.repro.frontier import "
                      "read_plan; d = os.path.join(os.path.dirname(r.__file__), 'plans'); "
                      "print(len(read_plan(os.path.join(d, 'frontier.yaml'))['runs']))"],
               tmp_path)
  assert plans.returncode == 0 and int(plans.stdout) > 5, plans.stdout + plans.stderr
  train = _run(venv, [str(venv / "bin" / "elastic-jax-train"), "--config", "tiny.yaml",
                      "train.steps=2", "data.seq_len=64", "log.every_steps=1",
                      "data.synthetic.eval_batches=0", "run_dir=run"], tmp_path)
  assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-2000:]
  assert "step     2/2" in train.stdout and (tmp_path / "run" / "export").is_dir()
  config = _run(venv, [str(venv / "bin" / "elastic-jax-train"), "--config", "mixture_cpu.yaml",
                       "--print-config"], tmp_path)
  assert config.returncode == 0 and str(venv) in config.stdout      # package: paths resolved
  assert "\n  path: " in config.stdout and "# the frozen backbone" in config.stdout
  demo = _run(venv, [str(venv / "bin" / "python"), "-m", "elastic_jax.demo", "--out", "demo",
                     "--tokens", "16"], tmp_path)
  assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
  assert "HF -> ours -> HF tensors: identical" in demo.stdout
  for command in ("elastic-jax-eval", "elastic-jax-convert"):
    helped = _run(venv, [str(venv / "bin" / command), "--help"], tmp_path)
    assert helped.returncode == 0 and "usage" in helped.stdout.lower()


def test_api_page_lists_every_public_name():
  import elastic_jax as ej
  page = open(os.path.join(ROOT, "docs", "api.md"), encoding="utf-8").read()
  missing = [name for name in ej.__all__ if f"ej.{name}" not in page and name not in page]
  assert not missing, missing


def test_wheel_ships_the_license_and_declares_no_optional_package(wheel):
  with zipfile.ZipFile(wheel) as z:
    names = z.namelist()
    licenses = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    assert licenses, names[-10:]
    text = z.read(licenses[0]).decode()
    meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
  assert "Apache License" in text and "Version 2.0" in text and "Copyright 2026" in text
  assert "License-Expression: Apache-2.0" in meta
  core = [line.split(":", 1)[1].strip() for line in meta.splitlines()
          if line.startswith("Requires-Dist:") and "extra ==" not in line]
  assert not [r for r in core if r.split("[")[0].split("<")[0].split(">")[0].split("=")[0]
              .strip().lower() in {p.lower() for p in OPTIONAL}], core
  for extra in ("eval", "data", "torch", "tensorboard", "all"):
    assert f"Provides-Extra: {extra}" in meta


def test_core_install_loads_and_generates(venv, tmp_path):
  """In the core install (no extras): the shipped backbone loads and generates from token
  ids; the extras' packages are absent."""
  env_dir, py = venv, str(venv / "bin" / "python")
  script = (
      "import importlib.util, os, sys\n"
      "import elastic_jax as ej\n"
      "backbone = os.path.join(os.path.dirname(ej.__file__), 'repro', 'backbone')\n"
      "model = ej.from_pretrained(backbone, dtype='float32', show_progress=False)\n"
      "gen = model.generate([[1, 5, 9, 13, 17]], max_new_tokens=3)\n"
      "assert len(gen.tokens) == 1 and len(gen.tokens[0]) == 3, gen.tokens\n"
      f"missing = [m for m in {OPTIONAL!r} if importlib.util.find_spec(m) is None]\n"
      "print('generated', gen.tokens[0], 'missing', ' '.join(missing))\n")
  done = _run(env_dir, [py, "-c", script], tmp_path)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
  assert "generated" in done.stdout
  assert set(done.stdout.split("missing", 1)[1].split()) == set(OPTIONAL), done.stdout
  assert "PyTorch was not found" not in done.stderr, done.stderr
