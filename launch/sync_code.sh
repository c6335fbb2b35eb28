#!/usr/bin/env bash
# Puts the same code on every worker, at ~/capo-jax: either this checkout
# (tracked and untracked-but-not-ignored files, copied with scp) or a git
# commit cloned on the workers.
#
#   launch/sync_code.sh --name=capo-v4 --zone=us-central2-b
#   launch/sync_code.sh --name=capo-v4 --zone=us-central2-b \
#       --repo=https://github.com/OWNER/capo-jax.git --commit=v0.1.0
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<EOF
Usage: $(basename "$0") --name=NAME --zone=ZONE [--repo=URL --commit=REF] [flags]

Replaces ~/${REMOTE_DIR} on every worker with this checkout (default), or
clones / fetches --repo and checks out --commit there.
  --repo=URL           git URL the workers can reach (with --commit)
  --commit=REF         commit, tag or branch to check out
${COMMON_FLAGS_HELP}
EOF
}

REPO_URL=""
COMMIT=""
# The flags of this script (see parse_flags).
parse_flag() {
  case "$1" in
    --repo) REPO_URL="$(need_value "$@")" ;;
    --commit) COMMIT="$(need_value "$@")" ;;
    *) SHIFT=0 ;;
  esac
}
parse_flags "$@"

check_common
if [[ -n "${REPO_URL}" || -n "${COMMIT}" ]]; then
  [[ -n "${REPO_URL}" && -n "${COMMIT}" ]] || die "--repo and --commit go together"
  [[ "${COMMIT}" =~ ^[A-Za-z0-9._/-]+$ ]] || die "--commit=${COMMIT}: not a commit, tag or branch"
  url="$(shell_quote "${REPO_URL}")"
  script="set -e; if [ -d ${REMOTE_DIR}/.git ]; then git -C ${REMOTE_DIR} remote set-url origin"
  script+=" ${url}; git -C ${REMOTE_DIR} fetch --quiet --tags origin; else rm -rf ${REMOTE_DIR}"
  script+="; git clone --quiet ${url} ${REMOTE_DIR}; fi"
  # A branch name means the fetched origin/BRANCH, not a stale local branch.
  script+="; git -C ${REMOTE_DIR} checkout --quiet --detach origin/${COMMIT} 2>/dev/null"
  script+=" || git -C ${REMOTE_DIR} checkout --quiet --detach ${COMMIT}"
  script+="; git -C ${REMOTE_DIR} log -1 --format='%h %s'"
  on_workers all "${script}"
  exit 0
fi

git -C "${REPO_ROOT}" rev-parse --git-dir >/dev/null 2>&1 ||
  die "${REPO_ROOT} is not a git checkout; use --repo and --commit"
tarball="${TMPDIR:-/tmp}/${TPU_NAME}-capo-jax.tar.gz"
# Missing files (deleted but still tracked) are skipped, not fatal.
pack="git -C $(shell_quote "${REPO_ROOT}") ls-files -z --cached --others --exclude-standard"
pack+=" | tar -C $(shell_quote "${REPO_ROOT}") --null --ignore-failed-read -T - -czf"
pack+=" $(shell_quote "${tarball}")"
if ((DRY_RUN)); then
  echo "${pack}"
else
  bash -c "set -o pipefail; ${pack}"
fi
gcloud_tpus tpu-vm scp "${tarball}" "${TPU_NAME}:capo-jax.tar.gz" --worker=all
# Unpack beside the old copy and swap, so a failed copy leaves the old code.
script="set -e; rm -rf ${REMOTE_DIR}.new; mkdir -p ${REMOTE_DIR}.new"
script+="; tar -xzf capo-jax.tar.gz -C ${REMOTE_DIR}.new; rm -rf ${REMOTE_DIR}"
script+="; mv ${REMOTE_DIR}.new ${REMOTE_DIR}; rm -f capo-jax.tar.gz"
on_workers all "${script}"
