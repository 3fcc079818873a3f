#!/usr/bin/env bash
# Every GPU check of omnihvd in one run (about 3 minutes on one GPU; no Horovod build):
#   1. gpu_timing_check.py: the local time follows the device (matmuls of two sizes);
#   2. the same for a training step (forward + backward) at two batch sizes;
#   3. gpu_ddp_check.py: DDP's timing boundary (the last bucket) follows the device too,
#      and SyncBatchNorm is refused (NCCL world of one);
#   4. gpu_ddp_balance.py: rank 0 on the CPU, rank 1 alone on the GPU with device work
#      the host does not see; omnihvd moves samples away from it with device sync, not
#      with host time, and the step gets shorter;
#   5. balancer_loop.py: the drop-in on the GPU, exact with sub-batches;
#   6. the single-process tests of the timing and DDP code on the GPU's torch.
# Each part's output is saved under OUTDIR (default: $OUT when set, else ./gpu-checks);
# the exit status is the number of parts that failed.
#
# The Horovod callback on the GPU is benchmarks/gpu_horovod.sh (Horovod built there from a
# carried sdist; at most about 8 minutes, so a separate device run): here, once,
# `bash tools/fetch_horovod_sdist.sh` (writes .cache/horovod-0.28.1.tar.gz); then the
# device command `bash benchmarks/gpu_horovod.sh $OUT` with carry [".cache"] and
# timeout_s 560. Its header says what it checks and how to run its CPU side here.
#
# Usage: bash benchmarks/gpu_checks.sh [OUTDIR]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu-checks}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
py=${PYTHON:-python3}
failed=0

part() {  # part NAME SECONDS COMMAND...
    local name=$1 seconds=$2
    shift 2
    echo "=== $name: $*"
    timeout "$seconds" "$@" 2>&1 | tee "$out/$name.txt"
    local rc=$?
    echo "=== $name: exit $rc"
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

{ nvidia-smi -L; $py -c "import sys, torch, numpy; print(sys.version.split()[0], torch.__version__, numpy.__version__)"; } 2>&1 | tee "$out/env.txt"
part matmul 100 $py benchmarks/gpu_timing_check.py
part train 100 $py benchmarks/gpu_timing_check.py --workload train
part ddp_boundary 100 $py benchmarks/gpu_ddp_check.py
part ddp_balance 150 $py -m torch.distributed.run --standalone --nproc-per-node 2 \
    benchmarks/gpu_ddp_balance.py
# 5. the drop-in (omnihvd.Balancer) on the GPU: 3 ranks on it, DDP over gloo, sub-batches
#    of unequal count per rank; each step's float64 gradient against one process over
#    the global batch (1e-12), with the device synchronised where each pass ends
part balancer 150 $py -m torch.distributed.run --standalone --nproc-per-node 3 \
    tests/mpi_scripts/balancer_loop.py ddp average 4 0 cuda
part pytest 120 $py -m pytest -q -p no:cacheprovider tests/test_device.py tests/test_gpu_check.py \
    tests/test_ddp.py tests/test_timing.py
echo "gpu_checks: $failed part(s) failed; outputs in $out"
exit "$failed"
