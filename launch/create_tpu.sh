#!/usr/bin/env bash
# Creates a Cloud TPU VM (single host or pod slice), directly or as a queued resource.
#
#   launch/create_tpu.sh --name=capo-v4 --zone=us-central2-b --accelerator=v4-32
#   launch/create_tpu.sh --name=capo-v5e --zone=us-west4-a --accelerator=v5litepod-16 --spot --queued
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<EOF
Usage: $(basename "$0") --name=NAME --zone=ZONE --accelerator=TYPE [flags]

Creates the TPU VM NAME. Next: sync_code.sh, setup_tpu.sh, run_tpu.sh.
  --accelerator=TYPE   v4-N, v5p-N (N = TensorCores = 2 x chips), v5litepod-N
                       (alias v5e-N) or v6e-N (N = chips) [ACCELERATOR]
  --version=VERSION    runtime version; default by generation: v4 tpu-ubuntu2204-base,
                       v5p v2-alpha-tpuv5, v5e v2-alpha-tpuv5-lite, v6e v2-alpha-tpuv6e
                       [RUNTIME_VERSION]
  --spot               Spot VMs (cheaper, preemptible; re-run run_tpu.sh to resume)
  --queued             request a queued resource (waits for capacity; recommended
                       for v5e / v5p / v6e); delete it with delete_tpu.sh --queued
${COMMON_FLAGS_HELP}
EOF
}

SPOT=0
QUEUED=0
# The flags of this script (see parse_flags).
parse_flag() {
  case "$1" in
    --accelerator) ACCELERATOR="$(need_value "$@")" ;;
    --version) RUNTIME_VERSION="$(need_value "$@")" ;;
    --spot) SPOT=1; SHIFT=1 ;;
    --queued) QUEUED=1; SHIFT=1 ;;
    *) SHIFT=0 ;;
  esac
}
parse_flags "$@"

check_common
parse_accelerator
RUNTIME_VERSION="${RUNTIME_VERSION:-$(default_runtime_version "${TPU_GEN}")}"
note "${ACCELERATOR}: ${TPU_CHIPS} chips on ${TPU_HOSTS} worker(s), runtime ${RUNTIME_VERSION}"

extra=()
if ((SPOT)); then extra+=(--spot); fi
if ((QUEUED)); then
  gcloud_tpus queued-resources create "${TPU_NAME}" "--node-id=${TPU_NAME}" \
    "--accelerator-type=${ACCELERATOR}" "--runtime-version=${RUNTIME_VERSION}" \
    "${extra[@]+"${extra[@]}"}"
  note "watch it with: gcloud compute tpus queued-resources describe ${TPU_NAME} --zone=${ZONE}"
else
  gcloud_tpus tpu-vm create "${TPU_NAME}" "--accelerator-type=${ACCELERATOR}" \
    "--version=${RUNTIME_VERSION}" "${extra[@]+"${extra[@]}"}"
fi
