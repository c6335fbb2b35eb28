#!/usr/bin/env bash
# A venv with jax[tpu] (libtpu) for tools/aot_tpu.py and tests/test_aot_tpu.py.
#
# libtpu compiles for TPU topologies without TPU hardware, so this runs on any
# x86-64 Linux box (CPU only). It lives in its own venv: the default install
# (.venv, requirements.txt) stays CPU-only and small.
#
#   tools/setup_aot_tpu.sh [VENV_DIR]      # default tools/.venv-tpu
#   tools/.venv-tpu/bin/python -m tools.aot_tpu --config=... --accelerator=v5e-16
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-tools/.venv-tpu}"
# The jax[tpu] extra pins the libtpu that matches the jax version of requirements.txt.
jax_version="$(sed -n 's/^jax==\(.*\)$/\1/p' requirements.txt)"
if [[ -z "$jax_version" ]]; then
  echo "setup_aot_tpu.sh: no 'jax==' pin in requirements.txt" >&2
  exit 1
fi
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
# pytest at the version requirements-test.txt pins (the rest of it, torch included, is not needed).
pytest_pin="$(grep '^pytest==' requirements-test.txt)"
"$venv/bin/python" -m pip install -q -r requirements.txt "jax[tpu]==$jax_version" "$pytest_pin"
"$venv/bin/python" -m pip install -q -e . --no-deps
"$venv/bin/python" -c "import jax, libtpu; print('jax', jax.__version__, 'libtpu', libtpu.__file__)"
