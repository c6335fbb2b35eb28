#!/usr/bin/env bash
# Sets up every worker of a TPU VM: a virtual environment with the repo's
# requirements plus jax[tpu] at the jax version pinned in requirements.txt,
# and optionally the HF weights and data copied from Cloud Storage.
# Idempotent: re-running it only installs what is missing or changed.
#
#   launch/sync_code.sh --name=capo-v4 --zone=us-central2-b     # first: the code
#   launch/setup_tpu.sh --name=capo-v4 --zone=us-central2-b \
#       --model-gcs=gs://BUCKET/models/Qwen2.5-Math-1.5B --data-gcs=gs://BUCKET/capo-data
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

LIBTPU_INDEX="https://storage.googleapis.com/jax-releases/libtpu_releases.html"

usage() {
  cat <<EOF
Usage: $(basename "$0") --name=NAME --zone=ZONE [flags]

Installs uv, a Python venv (${REMOTE_VENV}) and the requirements of the synced
code (${REMOTE_DIR}/requirements.txt) plus jax[tpu] on every worker.
  --requirements=FILE  local requirements file whose 'jax==X' pin is used for
                       jax[tpu]==X (default: requirements.txt of this repo)
  --python=VERSION     Python of the venv, fetched by uv if missing (default 3.11)
  --model-gcs=gs://..  copy a HF checkpoint folder to ~/capo-models/<name> on every
                       worker (repeatable); pass --config.model.hf_path=capo-models/<name>
  --data-gcs=gs://..   copy a data folder to ~/capo-data on every worker; pass
                       --env=CAPO_DATA_DIR=capo-data to run_tpu.sh
  --check              afterwards, print each worker's JAX devices (the TPU must be idle)
${COMMON_FLAGS_HELP}
EOF
}

REQUIREMENTS="${REPO_ROOT}/requirements.txt"
PYTHON_VERSION=3.11
MODELS=()
DATA_GCS=""
CHECK=0
# The flags of this script (see parse_flags).
parse_flag() {
  case "$1" in
    --requirements) REQUIREMENTS="$(need_value "$@")" ;;
    --python) PYTHON_VERSION="$(need_value "$@")" ;;
    --model-gcs) MODELS+=("$(need_value "$@")") ;;
    --data-gcs) DATA_GCS="$(need_value "$@")" ;;
    --check) CHECK=1; SHIFT=1 ;;
    *) SHIFT=0 ;;
  esac
}
parse_flags "$@"

check_common
[[ -f "${REQUIREMENTS}" ]] || die "--requirements=${REQUIREMENTS}: no such file"
JAX_VERSION="$(sed -n 's/^jax==\([^ ;#]*\).*/\1/p' "${REQUIREMENTS}" | head -n 1)"
[[ -n "${JAX_VERSION}" ]] ||
  die "${REQUIREMENTS}: no 'jax==X' line; jax[tpu] must be installed at the pinned jax version"
[[ "${PYTHON_VERSION}" =~ ^3\.[0-9]+$ ]] || die "--python=${PYTHON_VERSION}: expected e.g. 3.11"
for src in "${MODELS[@]+"${MODELS[@]}"}" ${DATA_GCS:+"${DATA_GCS}"}; do
  [[ "${src}" == gs://?* ]] || die "'${src}' is not a Cloud Storage path (gs://BUCKET/...)"
done

# The remote script: plain POSIX sh, run from each worker's home directory.
jax_tpu="$(shell_quote "jax[tpu]==${JAX_VERSION}")"
# shellcheck disable=SC2016  # $HOME and $PATH are the workers'
script='set -e; export PATH="$HOME/.local/bin:$PATH"'
script+="; grep -qx $(shell_quote "jax==${JAX_VERSION}") ${REMOTE_DIR}/requirements.txt"
script+=" || { echo 'setup: ${REMOTE_DIR}/requirements.txt is missing or does not pin"
script+=" jax==${JAX_VERSION}: run sync_code.sh first' >&2; exit 1; }"
# (Newer images mark the system Python as externally managed; older pips ignore the variable.)
script+="; command -v uv >/dev/null 2>&1 || PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install"
script+=" --user --quiet uv"
script+="; [ -x ${REMOTE_VENV}/bin/python ] || uv venv --python ${PYTHON_VERSION} ${REMOTE_VENV}"
script+="; uv pip install --python ${REMOTE_VENV}/bin/python -r ${REMOTE_DIR}/requirements.txt"
script+=" ${jax_tpu} -f ${LIBTPU_INDEX}"
for src in "${MODELS[@]+"${MODELS[@]}"}"; do
  dest="capo-models/$(basename "${src%/}")"
  script+="; mkdir -p $(shell_quote "${dest}")"
  script+=" && gcloud storage rsync --recursive $(shell_quote "${src%/}" "${dest}")"
done
if [[ -n "${DATA_GCS}" ]]; then
  script+="; mkdir -p capo-data && gcloud storage rsync --recursive"
  script+=" $(shell_quote "${DATA_GCS%/}") capo-data"
fi
if ((CHECK)); then
  script+="; ${REMOTE_VENV}/bin/python -c 'import jax; print(jax.process_index(),"
  script+=" jax.local_devices())'"
fi
note "installing jax[tpu]==${JAX_VERSION} (pinned in ${REQUIREMENTS}) on every worker"
on_workers all "${script}"
