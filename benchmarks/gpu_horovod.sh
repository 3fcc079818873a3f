#!/usr/bin/env bash
# The Horovod callback on a GPU, in one run of at most about 8 minutes (issue 54, part 3;
# benchmarks/gpu_checks.sh does the rest of the GPU checks, with DDP over gloo):
#   0. env: the GPU, python, torch, numpy, mpi4py (and its MPI), mpirun, mpicc, nvcc,
#      cmake, g++;
#   1. build: Horovod 0.28.1 from its sdist, carried as one file
#      (.cache/horovod-0.28.1.tar.gz, made by tools/fetch_horovod_sdist.sh where PyPI is
#      reachable), against the machine's CUDA torch: PyTorch and MPI, no TensorFlow, no
#      MXNet, no Gloo, and no GPU operations (HOROVOD_GPU_OPERATIONS unset: no NCCL),
#      through a C++17 compiler wrapper as tools/setup.sh does, into $PREFIX/site
#      (skipped when that Horovod already imports: a rerun on the same warm machine);
#   2. exact_mixed: tests/mpi_scripts/balancer_loop.py, Horovod, op Average, 3 ranks:
#      rank 0 on the GPU, ranks 1 and 2 on the CPU (a mixed world); sub-batches of
#      unequal count per rank; every step's float64 gradient against one process over
#      the global batch (1e-12), every epoch each sample once;
#   3. exact_cuda: the same with op Sum and all 3 ranks on the GPU;
#   4. balance: benchmarks/gpu_horovod_balance.py, 2 ranks: rank 0 on the CPU, rank 1 on
#      the GPU with a heavier stream of work (a spin kernel per sample, 3 times rank 0's
#      time per sample); omnihvd.Balancer must give rank 1 at most 45% of the batch, 5
#      points less than plain Horovod's half, and a step at least 10% shorter than
#      plain's (PASS/FAIL line with the figures).
# Each part's output is saved under OUTDIR (default: $OUT when set, else ./gpu-horovod);
# the exit status is the number of parts that failed (a part the build or the time
# budget left unrun counts as failed).
#
# Why a CPU rank and a GPU rank can share one allreduce: built without GPU operations
# (HOROVOD_GPU_ALLREDUCE undefined), horovod/torch/mpi_ops_v2.cc registers
# DoAllreduceCudaOnCPU (likewise ...BroadcastCudaOnCPU, ...AllgatherCudaOnCPU) for
# the torch.cuda.* tensor types (PYBIND11_MODULE, the "#else" branches): it copies the
# tensor to a host buffer (tensor.to(kCPU, non_blocking=true)), enqueues the allreduce
# on CPU_DEVICE_ID, and in the completion callback copies the result back under the
# tensor's device guard. So every rank's request says CPU, and the controller's check
# that all ranks use CPU or all use GPU (horovod/common/controller.cc,
# ConstructResponse: "Mismatched ... CPU/GPU device selection") passes in a mixed
# world. The asynchronous device-to-host copy is safe only because the torch
# extension is built with HAVE_GPU: horovod/torch/CMakeLists.txt calls add_cuda()
# whenever torch has CUDA and nvcc is found (CUDA_HOME), even with no GPU operations;
# then the ready event recorded after the copy is waited for before MPI reads the
# buffer (HorovodOp::WaitForData, ops/collective_operations.cc). Without nvcc (no
# HAVE_GPU) the event list is empty and MPI could read the buffer before the copy
# ends: the build step says so in its log.
# Two changes to the unpacked source, checked to apply: CMAKE_CUDA_STANDARD 11 -> 17
# in horovod/common/ops/cuda/CMakeLists.txt (the CUDA 13 headers and GCC >= 14 want a
# newer C++; horovod PR #4313), and get_python_inc from distutils -> sysconfig in
# horovod/torch/CMakeLists.txt (Python 3.12 has no distutils of its own).
# HOROVOD_BUILD_CUDA_CC_LIST is the GPU's compute capability (90 on an H100/H200), so
# nvcc builds horovod's few kernels for one architecture only.
#
# On the device machine (python3 there is the CUDA torch; nothing is installed):
#   here, once:  bash tools/fetch_horovod_sdist.sh      (writes .cache/horovod-0.28.1.tar.gz)
#   device run:  command "bash benchmarks/gpu_horovod.sh $OUT", carry [".cache"],
#                timeout_s 560 (the script keeps to GPU_HOROVOD_BUDGET, 500 s by default)
# Here, without a GPU:
#   GPU_HOROVOD_DEVICE=cpu bash benchmarks/gpu_horovod.sh [OUTDIR]   the same parts on the
#       CPU with the installed Horovod (.venv): exact_mixed on cpu,cpu,cpu, exact_cuda on
#       cpu, balance with --device cpu; no build
#   GPU_HOROVOD_DRY_RUN=1 bash benchmarks/gpu_horovod.sh [OUTDIR]    checks the sdist,
#       unpacks and patches it and prints the build command; builds and runs nothing
# Other settings: HOROVOD_SDIST (the sdist's path), GPU_HOROVOD_PREFIX (build folder,
# default /tmp/omnihvd-horovod), GPU_HOROVOD_BUDGET (seconds for the whole script),
# PYTHON (default .venv/bin/python where there is one, else python3).
#
# Usage: bash benchmarks/gpu_horovod.sh [OUTDIR]
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=${1:-${OUT:-gpu-horovod}}
mkdir -p "$out"
mode=${GPU_HOROVOD_DEVICE:-cuda}
dry=${GPU_HOROVOD_DRY_RUN:-0}
version=0.28.1
sdist=${HOROVOD_SDIST:-.cache/horovod-$version.tar.gz}
prefix=${GPU_HOROVOD_PREFIX:-/tmp/omnihvd-horovod}
budget=${GPU_HOROVOD_BUDGET:-500}
py=${PYTHON:-$([ -x .venv/bin/python ] && echo "$root/.venv/bin/python" || echo python3)}
case "$mode" in cuda | cpu) ;; *) echo "gpu_horovod: GPU_HOROVOD_DEVICE is cuda or cpu, not $mode" >&2; exit 64 ;; esac
export PYTHONPATH=$prefix/site:$root${PYTHONPATH:+:$PYTHONPATH}
export PATH=$prefix/site/bin:$PATH
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none   # no CMA between ranks (VMs, containers)
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)   # nproc obeys OMP_NUM_THREADS
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
unset PYTHONUNBUFFERED   # mpirun splices unbuffered ranks' lines; the scripts flush
failed=0
SECONDS=0

note() { echo "gpu_horovod: $*"; }

part() {  # part NAME SECONDS EXPECT COMMAND...: EXPECT, a text the output must hold
    local name=$1 seconds=$2 expect=$3 left rc
    shift 3
    left=$((budget - SECONDS - 5))
    if [ "$left" -lt 20 ]; then
        note "$name: not run, the time budget ($budget s) is spent" | tee "$out/$name.txt"
        failed=$((failed + 1))
        return 1
    fi
    [ "$seconds" -gt "$left" ] && seconds=$left
    echo "=== $name (at most $seconds s): $*"
    timeout -k 10 "$seconds" "$@" 2>&1 | tee "$out/$name.txt"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -eq 0 ] && [ -n "$expect" ] && ! grep -q "$expect" "$out/$name.txt"; then
        note "$name: exit 0 but no '$expect' in its output"
        rc=1
    fi
    [ "$rc" -eq 124 ] && note "$name: stopped after $seconds s"
    echo "=== $name: exit $rc after ${SECONDS} s in all"
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
    return "$rc"
}

not_run() {  # not_run NAME WHY
    note "$1: not run: $2" | tee "$out/$1.txt"
    failed=$((failed + 1))
}

environment() {
    nvidia-smi -L 2>&1 || echo "(no nvidia-smi)"
    timeout 90 "$py" - <<'EOF' 2>&1
import os, sys
print("python", sys.version.split()[0], sys.executable)
for name in ("torch", "numpy", "mpi4py", "horovod", "cloudpickle", "psutil", "yaml", "packaging"):
    try:
        module = __import__(name)
        print(name, getattr(module, "__version__", "?"), os.path.dirname(module.__file__))
    except Exception as e:
        print(name, "MISSING", type(e).__name__, e)
try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME
    print("torch cuda", torch.version.cuda, "available", torch.cuda.is_available(),
          "CUDA_HOME", CUDA_HOME)
    if torch.cuda.is_available():
        print("device", torch.cuda.get_device_name(0), "capability",
              torch.cuda.get_device_capability(0))
except Exception as e:
    print("torch cuda: ", e)
try:
    import mpi4py
    mpi4py.rc.initialize = mpi4py.rc.finalize = False
    from mpi4py import MPI
    print("mpi4py's MPI:", MPI.Get_library_version().strip().splitlines()[0])
except Exception as e:
    print("mpi4py's MPI: not loaded:", type(e).__name__, e)
EOF
    for tool in mpirun mpicc nvcc cmake g++ gcc; do
        printf '%s: %s\n' "$tool" "$(command -v "$tool" || echo MISSING)"
    done
    mpirun --version 2>&1 | sed -n '1p'
    mpicc -show 2>&1 | head -1
    nvcc --version 2>&1 | tail -2
    cmake --version 2>&1 | head -1
    g++ --version 2>&1 | head -1
    echo "cores $cores"
}

horovod_ok() {  # Horovod 0.28.1 with PyTorch imports (from $prefix/site or installed)
    "$py" -c 'import horovod, horovod.torch as hvd, sys
sys.exit(horovod.__version__ != "'$version'")' >/dev/null 2>&1
}

build() {  # unpack, patch and build Horovod into $prefix/site (dry: all but the build)
    if [ "$dry" != 1 ] && horovod_ok; then
        note "Horovod $version already imports; no build"
        "$py" -c 'import horovod, horovod.torch as hvd; print(horovod.__file__, "mpi", hvd.mpi_built(), "gloo", hvd.gloo_built(), "nccl", hvd.nccl_built(), "cuda", hvd.cuda_built())'
        return 0
    fi
    if [ "$mode" = cpu ] && [ "$dry" != 1 ]; then
        note "no Horovod $version imports with $py: run bash tools/setup.sh (--device cpu uses the installed one)"
        return 3
    fi
    if [ ! -f "$sdist" ]; then
        note "no Horovod source at $sdist: run 'bash tools/fetch_horovod_sdist.sh' where PyPI is reachable, and carry .cache (the device tool's carry list)"
        return 3
    fi
    local src=$prefix/src/horovod-$version names
    names=$(tar -tzf "$sdist" 2>/dev/null) && grep -qx "horovod-$version/CMakeLists.txt" <<<"$names" || {
        note "$sdist is not horovod-$version's sdist (no horovod-$version/CMakeLists.txt in it)"
        return 3
    }
    rm -rf "$prefix/src" && mkdir -p "$prefix/src" "$prefix/bin" && tar -xzf "$sdist" -C "$prefix/src" || return 3
    # the two patches; each must apply
    local cuda_cmake=$src/horovod/common/ops/cuda/CMakeLists.txt torch_cmake=$src/horovod/torch/CMakeLists.txt
    sed -i 's/^set(CMAKE_CUDA_STANDARD 11)$/set(CMAKE_CUDA_STANDARD 17)/' "$cuda_cmake"
    grep -qx 'set(CMAKE_CUDA_STANDARD 17)' "$cuda_cmake" || { note "patch failed: CMAKE_CUDA_STANDARD in $cuda_cmake"; return 3; }
    sed -i 's/from distutils.sysconfig import get_python_inc; print(get_python_inc())/import sysconfig; print(sysconfig.get_paths()[\x27include\x27])/' "$torch_cmake"
    grep -q "import sysconfig; print(sysconfig.get_paths()\['include'\])" "$torch_cmake" || { note "patch failed: get_python_inc in $torch_cmake"; return 3; }
    note "unpacked and patched $sdist in $src"
    # torch >= 2.1's headers need C++17; horovod's CMakeLists forces C++14; the last
    # -std flag wins (tools/setup.sh does the same)
    printf '#!/bin/sh\nexec g++ "$@" -std=c++17\n' >"$prefix/bin/g++-c++17" && chmod +x "$prefix/bin/g++-c++17"
    # the CUDA toolkit: a folder with bin/nvcc and include/cuda_runtime.h, first on PATH
    # (an nvcc on PATH may be a wrapper script, e.g. /usr/local/bin/nvcc, whose folder's
    # parent is no toolkit: torch's CUDA_HOME would be wrong)
    local home nvcc_path
    nvcc_path=$(command -v nvcc 2>/dev/null) && nvcc_path=$(readlink -f "$nvcc_path")
    local unset_home=1
    for home in ${CUDA_HOME:-} ${CUDA_PATH:-} /usr/local/cuda ${nvcc_path:+$(dirname "$(dirname "$nvcc_path")")}; do
        if [ -x "$home/bin/nvcc" ] && [ -f "$home/include/cuda_runtime.h" ]; then
            export CUDA_HOME=$home HOROVOD_CUDA_HOME=$home PATH=$home/bin:$PATH
            unset_home=0
            break
        fi
    done
    if [ "$unset_home" = 1 ]; then
        note "WARNING: no CUDA toolkit (bin/nvcc with include/cuda_runtime.h): the torch extension is built without HAVE_GPU, so a CUDA tensor's host copy is not waited for before MPI reads it"
    fi
    local cc
    cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
    case "$cc" in
        [1-9][0-9] | [1-9][0-9][0-9]) ;;
        *) [ "$dry" = 1 ] || cc=$("$py" -c 'import torch; c = torch.cuda.get_device_capability(0) if torch.cuda.is_available() else None; print("%d%d" % c if c else "")' 2>/dev/null) ;;
    esac
    [ -n "$cc" ] && export HOROVOD_BUILD_CUDA_CC_LIST=$cc
    local ops
    if command -v mpicc >/dev/null && command -v mpirun >/dev/null; then
        ops=(HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_GLOO=1 HOROVOD_CPU_OPERATIONS=MPI)
    else   # no MPI to build against: Gloo, launched by horovodrun --gloo
        note "no mpicc/mpirun: building with Gloo instead of MPI"
        ops=(HOROVOD_WITHOUT_MPI=1 HOROVOD_WITH_GLOO=1 HOROVOD_CPU_OPERATIONS=GLOO)
    fi
    unset HOROVOD_GPU_OPERATIONS HOROVOD_GPU_ALLREDUCE HOROVOD_GPU_ALLGATHER HOROVOD_GPU_BROADCAST \
        HOROVOD_GPU_ALLTOALL HOROVOD_GPU_REDUCESCATTER HOROVOD_GPU
    local cmd=(env CXX="$prefix/bin/g++-c++17" CC=gcc HOROVOD_WITH_PYTORCH=1
        HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 "${ops[@]}"
        CMAKE_POLICY_VERSION_MINIMUM=3.5 MAKEFLAGS="-j$cores"
        "$py" -m pip install -v --no-build-isolation --no-deps --no-index --no-cache-dir
        --use-pep517 --disable-pip-version-check --target "$prefix/site" --upgrade "$src")
    note "build command (HOROVOD_BUILD_CUDA_CC_LIST=${HOROVOD_BUILD_CUDA_CC_LIST:-all}, CUDA_HOME=${CUDA_HOME:-none}): ${cmd[*]}"
    if [ "$dry" = 1 ]; then
        note "dry run: nothing built"
        return 0
    fi
    local seconds=$((budget - SECONDS - 150))   # leave the parts 150 s at least
    [ "$seconds" -gt 300 ] && seconds=300
    [ "$seconds" -ge 60 ] || { note "no time left to build (budget $budget s)"; return 1; }
    rm -rf "$prefix/site"
    note "building (at most $seconds s) ..."
    timeout -k 10 "$seconds" "${cmd[@]}"
    local rc=$?
    [ "$rc" -eq 124 ] && note "the build was stopped after $seconds s"
    [ "$rc" -eq 0 ] || return 1
    horovod_ok || { note "built, but horovod $version does not import from $prefix/site"; return 1; }
    "$py" -c 'import horovod, horovod.torch as hvd; print("built", horovod.__file__, "mpi", hvd.mpi_built(), "gloo", hvd.gloo_built(), "nccl", hvd.nccl_built(), "cuda", hvd.cuda_built())'
}

launcher() {  # launcher NP: sets L, the command that starts NP ranks (horovodrun --gloo
    # where this Horovod has no MPI)
    local with_mpi
    with_mpi=$("$py" -c 'import horovod.torch as hvd; print(int(hvd.mpi_built()))' 2>/dev/null)
    if [ "$with_mpi" = 1 ] && command -v mpirun >/dev/null; then
        if mpirun --version 2>&1 | grep -q "Open MPI\|OpenRTE"; then
            L=(mpirun -np "$1" --oversubscribe --bind-to none)
        else
            L=(mpirun -np "$1")
        fi
    else
        L=(horovodrun -np "$1" -H "localhost:$1" --gloo)
    fi
}

note "mode $mode, python $py, outputs in $out, budget $budget s"
if [ "$dry" = 1 ]; then
    build 2>&1 | tee "$out/build.txt"
    rc=${PIPESTATUS[0]}
    note "dry run: build preparation exit $rc; nothing run"
    exit $((rc != 0))
fi
if [ "$mode" = cuda ] && ! "$py" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    note "no CUDA device is available here; this check needs one GPU (nothing was checked; GPU_HOROVOD_DEVICE=cpu runs its CPU side)"
    exit 2
fi
environment 2>&1 | tee "$out/env.txt"
if [ "$mode" = cuda ]; then
    mixed=cuda,cpu,cpu all=cuda
else
    mixed=cpu,cpu,cpu all=cpu
fi
# in this shell (not a pipe): the build exports CUDA_HOME and PATH for the parts
echo "=== build: log in $out/build.txt"
build >"$out/build.txt" 2>&1
rc=$?
tail -n 25 "$out/build.txt"
echo "=== build: exit $rc after $SECONDS s in all"
if [ "$rc" -eq 0 ]; then
    launcher 3
    part exact_mixed 120 "BALANCER-OK" "${L[@]}" "$py" tests/mpi_scripts/balancer_loop.py hvd average 4 0 "$mixed"
    part exact_cuda 120 "BALANCER-OK" "${L[@]}" "$py" tests/mpi_scripts/balancer_loop.py hvd sum 4 0 "$all"
    launcher 2
    part balance 180 "^PASS" "${L[@]}" "$py" benchmarks/gpu_horovod_balance.py --device "$mode"
else
    failed=$((failed + 1))
    for name in exact_mixed exact_cuda balance; do not_run "$name" "no Horovod (see build.txt)"; done
fi
note "$failed part(s) failed after $SECONDS s; outputs in $out"
exit "$failed"
