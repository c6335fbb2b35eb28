#!/usr/bin/env bash
# Starts `python -m capo_jax.main` on every worker at once, in the background
# (nohup: a dropped ssh connection does not stop it), logging on each worker to
# ~/capo-logs/<workdir name>.log. jax.distributed.initialize() finds the other
# workers by itself on Cloud TPU, so no coordinator address is passed.
#
# Resuming: after a preemption (or any stop), run the same command again. The
# trainer restores the last Orbax checkpoint in --workdir (Cloud Storage) and
# continues from that step; logs are appended.
#
#   launch/run_tpu.sh --name=capo-v4 --zone=us-central2-b \
#       --config=configs/capo_qwen2p5_math_7b.py --workdir=gs://BUCKET/capo-7b \
#       -- --config.model.preset= --config.model.hf_path=capo-models/Qwen2.5-Math-7B \
#       --config.mesh.tensor=2
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<EOF
Usage: $(basename "$0") --name=NAME --zone=ZONE --config=FILE --workdir=gs://... [flags] [-- ARGS]

Runs the trainer on all workers of NAME; ARGS after '--' go to capo_jax.main
(e.g. --config.model.hf_path=capo-models/Qwen2.5-Math-1.5B). Relative paths are
relative to each worker's home directory.
  --config=FILE[:ARG]  config file of this repo, e.g. configs/capo_qwen2p5_math_1p5b.py
  --workdir=gs://...   Cloud Storage folder for checkpoints, metrics and exports;
                       the same workdir resumes from its last checkpoint
  --env=KEY=VALUE      environment variable for the trainer (repeatable),
                       e.g. --env=CAPO_DATA_DIR=capo-data
  --restart            stop this job's earlier run on the workers first (SIGTERM to
                       the pid it recorded: the trainer saves a checkpoint and
                       exits), instead of refusing to start
${COMMON_FLAGS_HELP}
EOF
}

CONFIG=""
WORKDIR=""
ENVS=()
RESTART=0
TRAINER_ARGS=()
UNKNOWN_ARG_HINT="; trainer flags go after '--'"
# The flags of this script (see parse_flags).
parse_flag() {
  case "$1" in
    --config) CONFIG="$(need_value "$@")" ;;
    --workdir) WORKDIR="$(need_value "$@")" ;;
    --env) ENVS+=("$(need_value "$@")") ;;
    --restart) RESTART=1; SHIFT=1 ;;
    --) TRAINER_ARGS=("${@:2}"); SHIFT=$# ;;
    *) SHIFT=0 ;;
  esac
}
parse_flags "$@"

check_common
[[ -n "${CONFIG}" ]] || die "missing --config, e.g. --config=configs/capo_qwen2p5_math_1p5b.py"
config_file="${CONFIG%%:*}"
[[ "${config_file}" != /* && -f "${REPO_ROOT}/${config_file}" ]] ||
  die "--config=${CONFIG}: ${config_file} is not a file of this repo (${REPO_ROOT})"
[[ -n "${WORKDIR}" ]] || die "missing --workdir=gs://BUCKET/PATH"
[[ "${WORKDIR}" =~ ^gs://[a-z0-9][-a-z0-9_.]{1,220}[a-z0-9](/.*)?$ ]] ||
  die "--workdir=${WORKDIR}: must be a Cloud Storage path gs://BUCKET/PATH (bucket names:" \
    "lowercase letters, digits, '-', '_', '.'), which every worker can write and a" \
    "restarted (preempted) VM still has"
for kv in "${ENVS[@]+"${ENVS[@]}"}"; do
  [[ "${kv}" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || die "--env=${kv}: expected KEY=VALUE"
done
run_name="$(basename "${WORKDIR%/}")"
[[ "${run_name}" =~ ^[A-Za-z0-9._-]+$ ]] || die "--workdir=${WORKDIR}: unusable last path part"
log="${REMOTE_LOGS}/${run_name}.log"
pid_file="${REMOTE_LOGS}/capo.pid"

trainer=(env PYTHONPATH="${REMOTE_DIR}" PYTHONUNBUFFERED=1 "${ENVS[@]+"${ENVS[@]}"}"
  nohup "${REMOTE_VENV}/bin/python" -m capo_jax.main "--config=${REMOTE_DIR}/${CONFIG}"
  "--workdir=${WORKDIR}" "${TRAINER_ARGS[@]+"${TRAINER_ARGS[@]}"}")
# shellcheck disable=SC2016  # $-expressions below are for the workers' shell
{
  script="set -e; mkdir -p ${REMOTE_LOGS}; pid=\$(cat ${pid_file} 2>/dev/null || true)"
  script+='; if [ -n "$pid" ] && grep -qs capo_jax.main /proc/$pid/cmdline; then'
  if ((RESTART)); then
    # SIGTERM makes the trainer save a checkpoint before it exits: give it time.
    script+=' kill "$pid"; for _ in $(seq 900); do kill -0 "$pid" 2>/dev/null || break'
    script+='; sleep 1; done; if kill -0 "$pid" 2>/dev/null; then echo "$(hostname): pid $pid'
    script+=' still running 15 minutes after SIGTERM; not starting another" >&2; exit 1; fi'
  else
    script+=' echo "$(hostname): capo_jax.main is already running (pid $pid): follow it'
    script+=' with logs.sh, or pass --restart" >&2; exit 1'
  fi
  script+="; fi; $(shell_quote "${trainer[@]}") >> ${log} 2>&1 < /dev/null &"
  script+=" echo \$! > ${pid_file}; ln -sfn ${run_name}.log ${REMOTE_LOGS}/latest.log"
  script+='; echo "$(hostname): started pid $(cat '"${pid_file}"'), log ~/'"${log}"'"'
}
on_workers all "${script}"
note "follow worker 0 with: launch/logs.sh --name=${TPU_NAME} --zone=${ZONE}"
