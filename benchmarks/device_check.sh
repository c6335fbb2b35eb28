#!/usr/bin/env bash
# The one GPU check (benchmarks/device_check.py): the rollout engine's share of its
# bandwidth roofline and the packed train step's MFU, as JSON, in under 8 minutes.
#
#   benchmarks/device_check.sh [PYTHON]
#
# PYTHON: a Python whose environment already has jax[cuda] and this project's
# requirements (a venv built elsewhere and carried along: nothing is installed here, the
# GPU machine may have no internet). Default: $CAPO_PYTHON, else .venv-gpu/bin/python or
# .venv/bin/python in the repository, else python3. Writes $OUT/device_check.json
# ($OUT default: /tmp/device_check) and its log beside it.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/device_check}"
mkdir -p "$OUT"
PY="${1:-${CAPO_PYTHON:-}}"
if [ -z "$PY" ]; then
  for candidate in .venv-gpu/bin/python .venv/bin/python python3; do
    if command -v "$candidate" >/dev/null 2>&1; then PY="$candidate"; break; fi
  done
fi
if ! command -v "$PY" >/dev/null 2>&1; then
  echo "device_check.sh: no Python at '$PY'; pass the path of a venv's python with jax[cuda]" >&2
  exit 2
fi
# Everything the check imports, and a GPU behind JAX, before the timed run starts.
if ! "$PY" - <<'PYEOF'; then
import sys
try:
  import flax, optax, jax  # noqa: F401
  from capo_jax.sampling import sampler  # noqa: F401
  from capo_jax.rl import train_step  # noqa: F401
except ImportError as e:
  sys.exit(f"missing module: {e}")
d = jax.devices()[0]
if d.platform != "gpu":
  sys.exit(f"the first JAX device is {d.platform} ({d.device_kind}), not a GPU")
print(f"device_check.sh: {jax.device_count()} x {d.device_kind}, jax {jax.__version__}")
PYEOF
  echo "device_check.sh: $PY cannot run the check (above). It needs jax[cuda12] and" \
    "requirements.txt installed beforehand; pip cannot download on the GPU machine." >&2
  exit 2
fi
# A hard bound on the run: the parts share 420 s, the kill comes at 440 s (450 s with -k),
# so with the check above the script stays under 8 minutes.
timeout -k 10 440 "$PY" -m benchmarks.device_check --out "$OUT/device_check.json" \
  --budget-s 420 "${@:2}" 2>&1 | tee "$OUT/device_check.log"
