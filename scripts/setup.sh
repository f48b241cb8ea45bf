#!/usr/bin/env bash
# Sets up everything on a fresh machine; safe to run again (it skips what is already there).
#   scripts/setup.sh          .venv: Python >= 3.12 with elastic_jax, its dependencies and the
#                             extras eval (LongBench scoring, plots), data (parquet data) and
#                             serve (the HTTP endpoint)
#   scripts/setup.sh --test   also pytest, and .venv-torch: Python 3.11 + CPU PyTorch +
#                             transformers, the reference side of the parity tests
# Environment: PYTHON (an interpreter >= 3.12), TORCH_PYTHON (3.10-3.12 for the reference),
#              TORCH_SPEC (default torch==2.13.0), EXTRAS (more extras, e.g. gpu or torch),
#              PIP_FLAGS.
set -euo pipefail
cd "$(dirname "$0")/.."
want_test=0
[[ "${1:-}" == "--test" ]] && want_test=1

pick_python() {  # pick_python MIN_MINOR MAX_MINOR [candidates...]
  local min=$1 max=$2; shift 2
  local c
  for c in "$@"; do
    [[ -n "$c" ]] || continue
    if command -v "$c" >/dev/null 2>&1 || [[ -x "$c" ]]; then
      if "$c" -c "import sys; sys.exit(not ($min <= sys.version_info[1] <= $max and sys.version_info[0] == 3))" 2>/dev/null; then
        echo "$c"; return 0
      fi
    fi
  done
  return 1
}

pyenv_pythons() {  # interpreters that pyenv holds for one minor version, newest first
  command -v pyenv >/dev/null 2>&1 || return 0
  local root; root=$(pyenv root)
  ls -d "$root"/versions/3."$1".*/bin/python 2>/dev/null | sort -rV || true
}

stamp() { cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16; }
pip_flags=(-q --disable-pip-version-check ${PIP_FLAGS:-})

done_as=$(cat .venv/.setup-done 2>/dev/null || true)
if [[ "$done_as" != "$(stamp)-1" && "$done_as" != "$(stamp)-$want_test" ]]; then
  py=$(pick_python 12 14 "${PYTHON:-}" python3.12 python3.13 python3 $(pyenv_pythons 12) $(pyenv_pythons 13)) || {
    echo "setup: elastic_jax needs Python >= 3.12 (set PYTHON=/path/to/python3.12)" >&2; exit 1; }
  echo "setup: building .venv with $($py --version) ..."
  [[ -x .venv/bin/python ]] || "$py" -m venv .venv
  extras="eval,data,serve${EXTRAS:+,$EXTRAS}"
  (( want_test )) && extras="${extras:+$extras,}test"
  .venv/bin/python -m pip install "${pip_flags[@]}" -e ".[$extras]"
  echo "$(stamp)-$want_test" > .venv/.setup-done
fi

tf=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('transformers'))")
if (( want_test )) && [[ "$(cat .venv-torch/.setup-done 2>/dev/null || true)" != "$tf" ]]; then
  tpy=$(pick_python 10 12 "${TORCH_PYTHON:-}" python3.11 $(pyenv_pythons 11) python3.12 python3.10) || {
    echo "setup: the parity tests need a Python 3.10-3.12 for PyTorch (set TORCH_PYTHON)" >&2; exit 1; }
  echo "setup: building .venv-torch with $($tpy --version), ${TORCH_SPEC:-torch==2.13.0}, transformers $tf ..."
  [[ -x .venv-torch/bin/python ]] || "$tpy" -m venv .venv-torch
  .venv-torch/bin/python -m pip install "${pip_flags[@]}" "${TORCH_SPEC:-torch==2.13.0}" \
      "transformers==$tf" safetensors numpy
  echo "$tf" > .venv-torch/.setup-done
fi
echo "setup: ready (.venv$( ((want_test)) && echo ', .venv-torch'))"
