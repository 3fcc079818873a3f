#!/usr/bin/env bash
# The full benchmark: 4 ranks on this machine, HL1/HL2/HL4/HL8, the dynamic schedule,
# and time to 88% test accuracy at HL4 (plain Horovod vs omnihvd, two seeds).
#
#   bash benchmarks/run_bench.sh                 # about 25 minutes on 2 quiet cores
#   bash benchmarks/run_bench.sh --levels HL4 --dynamic '' --name quick   # any bench.py option
#
# Results: benchmarks/results/<name>.json (default name: full), run logs and PNG plots
# next to it. Run it on a quiet machine: other processes distort the step times.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$ROOT/.venv/bin/python"
NP="${OMNIHVD_NP:-4}"
[ -x "$PY" ] || { echo "no $PY: run 'bash tools/setup.sh' (or 'make setup') first" >&2; exit 1; }
command -v mpirun >/dev/null || { echo "mpirun not found: run 'bash tools/setup.sh'" >&2; exit 1; }

# Launch settings belong to this script, not to the library: running as root inside
# containers needs OpenMPI's consent, and 4 ranks on fewer cores need oversubscription.
if [ "$(id -u)" = 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
# One torch thread per rank: several ranks share the cores.
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

cd "$ROOT"
exec mpirun -np "$NP" --oversubscribe --bind-to none \
    "$PY" benchmarks/bench.py --name full --tta --tta-seeds 0,1 "$@"
