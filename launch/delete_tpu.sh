#!/usr/bin/env bash
# Deletes the TPU VM (or the queued resource that holds it). The workdir on
# Cloud Storage stays, so a new VM can resume the run from its checkpoints.
#
#   launch/delete_tpu.sh --name=capo-v4 --zone=us-central2-b
#   launch/delete_tpu.sh --name=capo-v5e --zone=us-west4-a --queued --yes
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<EOF
Usage: $(basename "$0") --name=NAME --zone=ZONE [flags]

Deletes the TPU VM NAME; gcloud asks for confirmation unless --yes.
  --queued             delete the queued resource NAME and its VM (made by
                       create_tpu.sh --queued)
  --yes                do not ask (gcloud --quiet)
${COMMON_FLAGS_HELP}
EOF
}

QUEUED=0
YES=()
# The flags of this script (see parse_flags).
parse_flag() {
  case "$1" in
    --queued) QUEUED=1; SHIFT=1 ;;
    --yes) YES=(--quiet); SHIFT=1 ;;
    *) SHIFT=0 ;;
  esac
}
parse_flags "$@"

check_common
if ((QUEUED)); then
  gcloud_tpus queued-resources delete "${TPU_NAME}" --force "${YES[@]+"${YES[@]}"}"
else
  gcloud_tpus tpu-vm delete "${TPU_NAME}" "${YES[@]+"${YES[@]}"}"
fi
