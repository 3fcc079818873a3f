#!/usr/bin/env bash
# Asynchronous-mode benchmark (issue 6): async equal batches vs async omnihvd (each with
# and without the staleness-aware learning rate) vs sync omnihvd, at HL4 and HL8, each
# for the same wall-time budget; then the table, JSON and staleness plot.
#
#   bash benchmarks/run_async_bench.sh                 # defaults below
#   BUDGET=30 SEEDS="0 1" LEVELS=HL8 bash benchmarks/run_async_bench.sh
#
# Per-run files: benchmarks/results/async/<level>-<variant>-s<seed>.json
# Summary: benchmarks/results/async_bench.json, benchmarks/results/async_staleness.png
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
BUDGET=${BUDGET:-45}
SEEDS=${SEEDS:-0}
LEVELS=${LEVELS:-"HL4 HL8"}
VARIANTS=${VARIANTS:-"async-equal async-omnihvd async-equal-slr async-omnihvd-slr sync-omnihvd"}
LR=${LR:-0.1}
OUT=benchmarks/results/async
mkdir -p "$OUT"
# Launch settings for this machine (root, more ranks than cores), not the library's.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
for seed in $SEEDS; do
  for level in $LEVELS; do
    for variant in $VARIANTS; do
      case $variant in async-*) np=5 ;; *) np=4 ;; esac
      timeout $(( ${BUDGET%.*} + 240 )) mpirun -np $np --oversubscribe --bind-to none \
        "$PY" benchmarks/async_bench.py run --variant "$variant" --level "$level" \
        --seed "$seed" --budget "$BUDGET" --lr "$LR" --out "$OUT/$level-$variant-s$seed.json"
    done
  done
done
"$PY" benchmarks/async_bench.py report --inputs "$OUT"
