# shellcheck shell=bash disable=SC2034  # the variables are used by the scripts sourcing this
# Shared settings, flag parsing and helpers of the launch/*.sh scripts.
# Sourced, never run. Every setting below can come from the environment or
# from the flag named next to it, e.g. `ZONE=us-central2-b` or `--zone=...`.

set -euo pipefail

LAUNCH_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "${LAUNCH_DIR}/.." && pwd)"

TPU_NAME="${TPU_NAME:-}"              # --name: the TPU VM (or queued resource) name
PROJECT="${PROJECT:-}"                # --project: empty = gcloud's configured project
ZONE="${ZONE:-}"                      # --zone, e.g. us-central2-b (v4), us-west4-a (v5e)
ACCELERATOR="${ACCELERATOR:-}"        # --accelerator, e.g. v4-32, v5litepod-16, v5p-64, v6e-16
RUNTIME_VERSION="${RUNTIME_VERSION:-}"  # --version: empty = the default of the generation
GCLOUD_TRACK="${GCLOUD_TRACK:-}"      # --alpha sets "alpha": `gcloud alpha compute tpus ...`
DRY_RUN="${DRY_RUN:-0}"               # --dry-run: print each command instead of running it
# Paths on every worker, relative to the ssh user's home directory.
REMOTE_DIR="${REMOTE_DIR:-capo-jax}"
REMOTE_VENV="${REMOTE_VENV:-capo-venv}"
REMOTE_LOGS="${REMOTE_LOGS:-capo-logs}"

COMMON_FLAGS_HELP="Common flags (or the environment variable in brackets):
  --name=NAME          TPU VM name [TPU_NAME]
  --zone=ZONE          zone, e.g. us-central2-b [ZONE]
  --project=PROJECT    project; default: gcloud's configured one [PROJECT]
  --alpha              use 'gcloud alpha compute tpus' (older SDKs, alpha-only flags) [GCLOUD_TRACK=alpha]
  --dry-run            print every command instead of running it [DRY_RUN=1]
  -h, --help           this text"

die() {
  echo "$(basename "$0"): error: $*" >&2
  exit 2
}

note() {
  echo "# $*" >&2
}

# Splits every "--flag=value" into "--flag" "value"; words after "--" pass
# through untouched (they belong to the trainer). Result in ARGS.
normalize_args() {
  ARGS=()
  while (($#)); do
    case "$1" in
      --) ARGS+=("$@"); return ;;
      --*=*) ARGS+=("${1%%=*}" "${1#*=}") ;;
      *) ARGS+=("$1") ;;
    esac
    shift
  done
}

# need_value FLAG VALUE: prints VALUE, or fails when the flag has none.
need_value() {
  if (($# < 2)) || [[ -z "$2" || "$2" == --* ]]; then
    die "$1 needs a value, e.g. $1=VALUE"
  fi
  printf '%s\n' "$2"
}

# Handles a flag every script accepts. Sets SHIFT to the number of words used
# (0 when the flag is not a common one). Calls the script's usage() on --help.
parse_common_flag() {
  SHIFT=2
  case "$1" in
    --name) TPU_NAME="$(need_value "$@")" ;;
    --zone) ZONE="$(need_value "$@")" ;;
    --project) PROJECT="$(need_value "$@")" ;;
    --alpha) GCLOUD_TRACK=alpha; SHIFT=1 ;;
    --dry-run) DRY_RUN=1; SHIFT=1 ;;
    -h | --help) usage; exit 0 ;;
    *) SHIFT=0 ;;
  esac
}

# parse_flags "$@": parses a script's command line. The common flags are
# handled here; any other word goes to the script's own parse_flag, called with
# the words left and, like parse_common_flag, setting SHIFT to the number it
# used (default 2: a flag and its value) or 0 for an unknown argument, which
# fails with UNKNOWN_ARG_HINT appended to the message.
parse_flags() {
  normalize_args "$@"
  set -- "${ARGS[@]+"${ARGS[@]}"}"
  while (($#)); do
    parse_common_flag "$@"
    if ((SHIFT == 0)); then
      SHIFT=2
      parse_flag "$@"
    fi
    ((SHIFT)) || die "unknown argument '$1' (see --help${UNKNOWN_ARG_HINT:-})"
    shift "${SHIFT}"
  done
}

# Checks the settings every gcloud call needs.
check_common() {
  [[ -n "${TPU_NAME}" ]] || die "missing --name (or TPU_NAME): the TPU VM to act on"
  [[ "${TPU_NAME}" =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ ]] ||
    die "--name=${TPU_NAME}: use lowercase letters, digits and '-', starting with a letter"
  [[ -n "${ZONE}" ]] || die "missing --zone (or ZONE), e.g. --zone=us-central2-b"
  [[ "${ZONE}" =~ ^[a-z]+-[a-z]+[0-9]+-[a-z]$ ]] ||
    die "--zone=${ZONE} does not look like a zone (e.g. us-central2-b, europe-west4-a)"
  [[ -z "${GCLOUD_TRACK}" || "${GCLOUD_TRACK}" == alpha || "${GCLOUD_TRACK}" == beta ]] ||
    die "GCLOUD_TRACK=${GCLOUD_TRACK}: expected empty, alpha or beta"
}

# Normalises ACCELERATOR (v5e-N -> v5litepod-N) and sets TPU_GEN, TPU_CHIPS and
# TPU_HOSTS. v4-N and v5p-N count TensorCores (2 per chip), v5litepod-N and
# v6e-N count chips. Multi-host slices have 4 chips per TPU VM (worker).
parse_accelerator() {
  local acc="${ACCELERATOR}" n
  [[ -n "${acc}" ]] || die "missing --accelerator (or ACCELERATOR), e.g. v4-32 or v5litepod-16"
  if [[ "${acc}" =~ ^v5e-([0-9]+)$ ]]; then
    acc="v5litepod-${BASH_REMATCH[1]}"
  fi
  [[ "${acc}" =~ ^(v4|v5p|v5litepod|v6e)-([0-9]+)$ ]] ||
    die "--accelerator=${ACCELERATOR}: expected v4-N, v5p-N, v5litepod-N (or v5e-N) or v6e-N"
  TPU_GEN="${BASH_REMATCH[1]}"
  n="${BASH_REMATCH[2]}"
  case "${TPU_GEN}" in
    v4 | v5p)
      ((n >= 8 && n % 8 == 0)) ||
        die "--accelerator=${acc}: ${TPU_GEN}-N counts TensorCores (2 per chip, 4 chips per" \
          "host), so N must be a multiple of 8"
      TPU_CHIPS=$((n / 2)) ;;
    *)
      [[ " 1 4 8 16 32 64 128 256 " == *" ${n} "* ]] ||
        die "--accelerator=${acc}: ${TPU_GEN}-N counts chips; N is one of 1 4 8 16 32 64 128 256"
      TPU_CHIPS=${n} ;;
  esac
  # v5e / v6e put up to 8 chips on one VM when the slice fits on one host.
  TPU_HOSTS=$(((TPU_CHIPS + 3) / 4))
  if [[ "${TPU_GEN}" == v5litepod || "${TPU_GEN}" == v6e ]] && ((TPU_CHIPS <= 8)); then
    TPU_HOSTS=1
  fi
  ACCELERATOR="${acc}"
}

# The runtime (VM image) version recommended for each generation.
default_runtime_version() {
  case "$1" in
    v4) echo tpu-ubuntu2204-base ;;
    v5p) echo v2-alpha-tpuv5 ;;
    v5litepod) echo v2-alpha-tpuv5-lite ;;
    v6e) echo v2-alpha-tpuv6e ;;
    *) die "no default runtime version for '$1'; pass --version" ;;
  esac
}

# Quotes words for a POSIX shell, leaving plain words bare so printed commands
# stay readable and can be pasted back into a terminal.
shell_quote() {
  local out=() word
  for word in "$@"; do
    if [[ "${word}" =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then
      out+=("${word}")
    else
      out+=("'${word//\'/\'\\\'\'}'")
    fi
  done
  printf '%s\n' "${out[*]}"
}

# run CMD...: runs it, or prints it under --dry-run.
run() {
  if ((DRY_RUN)); then
    shell_quote "$@"
  else
    "$@"
  fi
}

# gcloud_tpus SUBCOMMAND...: `gcloud [alpha] compute tpus SUBCOMMAND... --zone --project`.
gcloud_tpus() {
  local cmd=(gcloud)
  [[ -z "${GCLOUD_TRACK}" ]] || cmd+=("${GCLOUD_TRACK}")
  cmd+=(compute tpus "$@" "--zone=${ZONE}")
  [[ -z "${PROJECT}" ]] || cmd+=("--project=${PROJECT}")
  run "${cmd[@]}"
}

# on_workers WORKER COMMAND: runs the shell COMMAND on worker WORKER (0, 1-3, all).
on_workers() {
  gcloud_tpus tpu-vm ssh "${TPU_NAME}" "--worker=$1" "--command=$2"
}
