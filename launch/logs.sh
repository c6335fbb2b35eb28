#!/usr/bin/env bash
# Follows the trainer log that run_tpu.sh started: worker 0's by default.
#
#   launch/logs.sh --name=capo-v4 --zone=us-central2-b              # tail -F worker 0
#   launch/logs.sh --name=capo-v4 --zone=us-central2-b --worker=all --no-follow
#   launch/logs.sh --name=capo-v4 --zone=us-central2-b --worker=all --status
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<EOF
Usage: $(basename "$0") --name=NAME --zone=ZONE [flags]

Shows ~/${REMOTE_LOGS}/latest.log (the last run started by run_tpu.sh).
  --worker=W           0 (default), another index, a list 0,2, a range 1-3, or all
  --lines=N            lines of history to show first (default 100)
  --no-follow          print and exit instead of following (tail -F)
  --status             instead of the log: is the trainer process alive?
${COMMON_FLAGS_HELP}
EOF
}

WORKER=0
LINES=100
FOLLOW=1
STATUS=0
# The flags of this script (see parse_flags).
parse_flag() {
  case "$1" in
    --worker) WORKER="$(need_value "$@")" ;;
    --lines) LINES="$(need_value "$@")" ;;
    --no-follow) FOLLOW=0; SHIFT=1 ;;
    --status) STATUS=1; SHIFT=1 ;;
    *) SHIFT=0 ;;
  esac
}
parse_flags "$@"

check_common
[[ "${WORKER}" =~ ^(all|[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*)$ ]] ||
  die "--worker=${WORKER}: expected all, an index (0), a list (0,2) or a range (1-3)"
[[ "${LINES}" =~ ^[0-9]+$ ]] || die "--lines=${LINES}: expected a number"

if ((STATUS)); then
  # shellcheck disable=SC2016  # expanded by the workers' shell
  {
    script='pid=$(cat '"${REMOTE_LOGS}"'/capo.pid 2>/dev/null || true); if [ -n "$pid" ]'
    script+=' && grep -qs capo_jax.main /proc/$pid/cmdline; then echo "$(hostname): running'
    script+=' (pid $pid)"; else echo "$(hostname): not running"; fi'
  }
else
  follow=""
  if ((FOLLOW)); then follow=" -F"; fi
  script="tail -n ${LINES}${follow} ${REMOTE_LOGS}/latest.log"
fi
on_workers "${WORKER}" "${script}"
