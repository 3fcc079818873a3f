#!/usr/bin/env bash
# The README's first command (`make demo`): a short benchmark on 4 ranks of this
# machine, a few minutes on 2 cores. Plain Horovod and omnihvd train the same CNN on
# Fashion-MNIST from the same seed, at the paper's HL4 (speeds 9:9:6:24) and through
# its dynamic schedule HL1 -> HL2 -> HL4 -> HL8 -> HL4 -> HL2 -> HL1; it ends with the
# table and the paths of the plots. Extra arguments go to benchmarks/bench.py.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# Results go to benchmarks/results/local/ (not tracked): benchmarks/results/demo.* are
# the run that docs/results.rst and benchmarks/RESULTS.md quote (--out to change).
exec bash "$HERE/run_bench.sh" --name demo --out "$HERE/results/local" --levels HL4 \
    --dynamic dynamic:60 --variants plain,omnihvd --steps 120 --no-tta "$@"
