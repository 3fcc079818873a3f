#!/usr/bin/env bash
# Fault and load test: thousands of steps on 4 ranks with changing heterogeneity,
# injected slow steps, one rank failure and a resume from the last checkpoint.
#
#   bash benchmarks/run_soak.sh                  # a few minutes on 2 cores
#   bash benchmarks/run_soak.sh --period 100     # any soak.py option (--help)
#
# Report: printed, and benchmarks/results/soak.json. Exit status 1 when the report
# lists a problem (a sample repeated or skipped, steps missing, ranks disagreeing).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/launch_env.sh"
exec "$PY" benchmarks/soak.py "$@"
