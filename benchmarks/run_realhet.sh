#!/usr/bin/env bash
# Real CPU heterogeneity benchmark: pinned core sets, CPU quotas, a mid-run change,
# imposed from outside on examples/train_fashion_mnist.py (needs root for cgroups).
#
#   bash benchmarks/run_realhet.sh                          # every default scenario
#   bash benchmarks/run_realhet.sh --scenarios 2:1:1 --merge  # one, kept with the others
#   bash benchmarks/run_realhet.sh --code /path/to/other/tree --out benchmarks/results/other
#
# Results: benchmarks/results/realhet.json and .md. Run it on a quiet machine.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/launch_env.sh"
exec "$PY" benchmarks/realhet.py "$@"
