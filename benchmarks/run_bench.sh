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
source "$(dirname "${BASH_SOURCE[0]}")/launch_env.sh"
NP="${OMNIHVD_NP:-4}"
exec mpirun -np "$NP" --oversubscribe --bind-to none \
    "$PY" benchmarks/bench.py --name full --tta --tta-seeds 0,1 "$@"
