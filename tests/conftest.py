"""Shared fixtures. The PyTorch reference runs in its own interpreter (see torch_reference.py).

ELASTIC_JAX_TORCH_PYTHON names that interpreter (default: .venv-torch/bin/python). Without it
the parity tests are skipped, unless ELASTIC_JAX_REQUIRE_TORCH=1 (as CI sets), which makes a
missing reference environment an error instead.
"""

import faulthandler
import json
import os
import shutil
import subprocess
import tempfile

# Eight CPU devices so that sharding tests can build real meshes (must precede importing jax).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One compilation cache for the whole run: both test processes and every CLI they start
# (train.py, eval.py) reuse a program any of them compiled instead of compiling it again. The
# process that starts the run makes it (xdist's workers inherit its environment) and removes
# it at the end; a cache named by the caller is left as it is.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="elastic-jax-tests-")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import jax  # noqa: E402
import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HARNESS = os.path.join(ROOT, "tests", "torch_reference.py")

jax.config.update("jax_numpy_rank_promotion", "raise")
# A test that hangs (a kernel's barrier that never completes stalls the interpreter) ends its
# process with every thread's traceback after this many seconds, instead of the whole run.
TEST_TIMEOUT = float(os.environ.get("ELASTIC_JAX_TEST_TIMEOUT", "900"))


@pytest.fixture(autouse=True)
def _hang_guard():
  faulthandler.dump_traceback_later(TEST_TIMEOUT, exit=True)
  yield
  faulthandler.cancel_dump_traceback_later()


def _torch_python():
  path = os.environ.get("ELASTIC_JAX_TORCH_PYTHON", os.path.join(ROOT, ".venv-torch", "bin",
                                                                 "python"))
  return path if os.path.exists(path) else None


@pytest.fixture(scope="session")
def torch_reference(tmp_path_factory):
  """run(jobs) executes jobs with the PyTorch reference and returns its summary."""
  python = _torch_python()
  if python is None:
    if os.environ.get("ELASTIC_JAX_REQUIRE_TORCH") == "1":
      pytest.fail("the PyTorch reference environment is missing (run scripts/setup.sh --test)")
    pytest.skip("no PyTorch reference environment (set ELASTIC_JAX_TORCH_PYTHON)")
  counter = iter(range(10**6))

  def run(jobs):
    path = tmp_path_factory.mktemp("jobs") / f"jobs{next(counter)}.json"
    path.write_text(json.dumps(jobs))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([python, HARNESS, str(path)], capture_output=True, text=True,
                          env=env, timeout=900)
    if proc.returncode:
      raise AssertionError(f"torch reference failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])

  return run


def pytest_unconfigure(config):
  if _OWN_CACHE and not hasattr(config, "workerinput"):
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
