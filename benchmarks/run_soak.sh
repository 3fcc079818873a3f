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
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$ROOT/.venv/bin/python"
[ -x "$PY" ] || { echo "no $PY: run 'bash tools/setup.sh' (or 'make setup') first" >&2; exit 1; }
command -v mpirun >/dev/null || { echo "mpirun not found: run 'bash tools/setup.sh'" >&2; exit 1; }

# Launch settings belong to this script, not to the library: running as root inside
# containers needs OpenMPI's consent, and 4 ranks on fewer cores need oversubscription
# (soak.py passes --oversubscribe itself).
if [ "$(id -u)" = 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
# One torch thread per rank: several ranks share the cores.
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

cd "$ROOT"
exec "$PY" benchmarks/soak.py "$@"
