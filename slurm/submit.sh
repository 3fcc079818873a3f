#!/usr/bin/env bash
# Submit an omnihvd Slurm template with the site settings of slurm/site.sh.
#
#   slurm/submit.sh TEMPLATE [SCRIPT ARGS...]     prints the job id
#
# Adds to sbatch: the partition (for a heterogeneous template, one partition per
# component from OMNIHVD_HET_PARTITIONS), the account, the log file
# OMNIHVD_LOG_DIR/JOBNAME-JOBID.out, and OMNIHVD_SLURM_DIR so that the job finds
# common.sh and site.sh. SCRIPT ARGS reach the training script. Extra sbatch options
# go in OMNIHVD_SBATCH_OPTS (split on spaces), e.g. OMNIHVD_SBATCH_OPTS="--time=5".
set -euo pipefail

if [ $# -lt 1 ] || [ ! -f "$1" ]; then
    echo "usage: $0 TEMPLATE [SCRIPT ARGS...]   (TEMPLATE: one of $(dirname "$0")/*.sbatch)" >&2
    exit 2
fi
template="$1"
shift
OMNIHVD_SLURM_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OMNIHVD_ROOT="${OMNIHVD_ROOT:-$(dirname "$OMNIHVD_SLURM_DIR")}"
export OMNIHVD_SLURM_DIR OMNIHVD_ROOT
# shellcheck source=site.sh
source "$OMNIHVD_SLURM_DIR/site.sh"

mkdir -p "$OMNIHVD_LOG_DIR"   # Slurm does not create the log's folder
# shellcheck disable=SC2206
opts=(--parsable --output="$OMNIHVD_LOG_DIR/%x-%j.out" ${OMNIHVD_SBATCH_OPTS:-})
account=()
[ -n "$OMNIHVD_ACCOUNT" ] && account=(--account="$OMNIHVD_ACCOUNT")

# ${a[@]+"${a[@]}"}: an empty array under set -u, also in bash before 4.4
if grep -q '^#SBATCH hetjob' "$template"; then
    read -r -a parts <<<"$OMNIHVD_HET_PARTITIONS"
    if [ "${#parts[@]}" -eq 0 ]; then   # the template's own --partition lines, if any
        exec sbatch "${opts[@]}" ${account[@]+"${account[@]}"} "$template" "$@"
    fi
    if [ "${#parts[@]}" -ne 2 ]; then
        echo "$0: OMNIHVD_HET_PARTITIONS must name two partitions (or none), got" \
            "'$OMNIHVD_HET_PARTITIONS' (edit slurm/site.sh)" >&2
        exit 2
    fi
    if grep -q '^#SBATCH .*--partition' "$template"; then
        echo "$0: OMNIHVD_HET_PARTITIONS='$OMNIHVD_HET_PARTITIONS' replaces the template's" \
            "--partition lines" >&2
    fi
    # "A : B" gives each component of the hetjob its own options.
    exec sbatch "${opts[@]}" ${account[@]+"${account[@]}"} --partition="${parts[0]}" \
        : ${account[@]+"${account[@]}"} --partition="${parts[1]}" "$template" "$@"
fi
partition=()
[ -n "$OMNIHVD_PARTITION" ] && partition=(--partition="$OMNIHVD_PARTITION")
exec sbatch "${opts[@]}" ${account[@]+"${account[@]}"} ${partition[@]+"${partition[@]}"} \
    "$template" "$@"
