# Sourced by the benchmark launchers: checks the set-up and sets what mpirun needs.
# Launch settings belong here, not in the library: running as root inside containers
# needs OpenMPI's consent; several ranks share the cores, so one torch thread each.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$ROOT/.venv/bin/python"
[ -x "$PY" ] || { echo "no $PY: run 'bash tools/setup.sh' (or 'make setup') first" >&2; exit 1; }
command -v mpirun >/dev/null || { echo "mpirun not found: run 'bash tools/setup.sh'" >&2; exit 1; }
if [ "$(id -u)" = 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT"
