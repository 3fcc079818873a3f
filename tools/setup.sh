#!/usr/bin/env bash
# One idempotent set-up for omnihvd: OpenMPI, .venv, torch, mpi4py, horovod (built
# with PyTorch + MPI + Gloo through a C++17 compiler wrapper, wheel cached outside the
# repository), omnihvd itself. Safe to run again; a second run takes seconds.
#
# Options (environment variables):
#   OMNIHVD_TORCH=2.13.0     torch version to install into .venv (default 2.13.0, the
#                            CPU wheel). OMNIHVD_TORCH=keep: create .venv with
#                            --system-site-packages and keep the torch (>= 2.1) the
#                            base python already has, e.g. a CUDA build on a GPU cluster.
#   OMNIHVD_PYTHON=python3   the base interpreter for .venv.
#   OMNIHVD_CACHE=~/.cache/omnihvd   where built horovod wheels are kept.
#   OMNIHVD_NO_APT=1         never call apt-get; only say what is missing.
set -Eeuo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
TORCH_WANTED="${OMNIHVD_TORCH:-2.13.0}"
BASE_PYTHON="${OMNIHVD_PYTHON:-python3}"
CACHE="${OMNIHVD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/omnihvd}"
HOROVOD_VERSION=0.28.1
DONE_MARK="$VENV/.omnihvd-setup-ok"

say() { printf '[omnihvd setup] %s\n' "$*"; }
die() {
    printf '\n[omnihvd setup] FAILED: %s\n' "$1" >&2
    [ -n "${2:-}" ] && printf '[omnihvd setup] fix: %s\n' "$2" >&2
    rm -f "$DONE_MARK"
    exit 1
}
trap 'die "command failed at tools/setup.sh line $LINENO: $BASH_COMMAND" "read the output above; rerun bash tools/setup.sh after fixing it"' ERR

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo -n "$@"; fi; }
apt_install() {
    # apt_install PKG...: install Debian packages when apt is usable, else say how.
    if [ -z "${OMNIHVD_NO_APT:-}" ] && command -v apt-get >/dev/null &&
        { [ "$(id -u)" = 0 ] || sudo -n true 2>/dev/null; }; then
        say "installing with apt: $*"
        as_root apt-get update -qq || die "apt-get update failed" "check the package mirror"
        DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "$@" >/dev/null ||
            die "apt-get install $* failed" "install them by hand: apt-get install $*"
        return 0
    fi
    return 1
}

# 1. OpenMPI (compiler wrappers and headers are needed to build mpi4py and horovod).
if ! command -v mpicc >/dev/null || ! command -v mpirun >/dev/null; then
    apt_install openmpi-bin libopenmpi-dev ||
        die "no MPI found (mpicc/mpirun are not on PATH)" \
            "install OpenMPI with headers (Debian/Ubuntu: apt-get install openmpi-bin libopenmpi-dev; RHEL: dnf install openmpi-devel; clusters: module load openmpi) and rerun"
fi
# Fashion-MNIST for the benchmarks and the example (optional for the library itself).
if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] && [ -z "${OMNIHVD_DATA:-}" ]; then
    apt_install dataset-fashion-mnist ||
        say "note: Fashion-MNIST is absent; benchmarks need it (apt-get install dataset-fashion-mnist, or set OMNIHVD_DATA to a folder with the four IDX .gz files)"
fi
# 2. The virtual environment. One without a working pip is a half-made one: redo it.
if [ ! -x "$PY" ] || ! "$PY" -m pip --version >/dev/null 2>&1; then
    command -v "$BASE_PYTHON" >/dev/null || die "no $BASE_PYTHON" "install Python >= 3.8 or set OMNIHVD_PYTHON"
    venv_args=()
    [ "$TORCH_WANTED" = keep ] && venv_args+=(--system-site-packages)
    make_venv() { rm -rf "$VENV"; "$BASE_PYTHON" -m venv ${venv_args[@]+"${venv_args[@]}"} "$VENV" >/dev/null 2>&1; }
    say "creating $VENV"
    if ! make_venv; then
        # Debian/Ubuntu ship venv's pip bootstrap (ensurepip) separately.
        { apt_install python3-venv && make_venv; } || {
            rm -rf "$VENV"
            die "could not create $VENV with $BASE_PYTHON -m venv" \
                "install the venv module (Debian/Ubuntu: apt-get install python3-venv) or set OMNIHVD_PYTHON"
        }
    fi
fi
PIP=("$PY" -m pip install -q --disable-pip-version-check)

# 3. torch.
torch_version() { "$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || true; }
TORCH_VERSION="$(torch_version)"   # e.g. 2.13.0+cpu; empty when torch does not import
if [ "$TORCH_WANTED" = keep ]; then
    # a .venv made before (by make demo, say) without the base python's packages
    # would keep its own torch -- the CPU wheel -- instead of the site's
    grep -qi '^include-system-site-packages *= *true' "$VENV/pyvenv.cfg" ||
        die "OMNIHVD_TORCH=keep, but $VENV was made without the base python's packages" \
            "rm -rf $VENV and rerun with OMNIHVD_TORCH=keep"
    if [ -z "$TORCH_VERSION" ]; then
        die "OMNIHVD_TORCH=keep, but $BASE_PYTHON has no working torch" "install torch >= 2.1 into it, or unset OMNIHVD_TORCH"
    fi
    case "$TORCH_VERSION" in
        0.* | 1.* | 2.0 | 2.0.* | 2.0+*) die "torch $TORCH_VERSION is too old" "omnihvd needs torch >= 2.1" ;;
    esac
elif [ "${TORCH_VERSION%%+*}" != "$TORCH_WANTED" ]; then
    say "installing torch==$TORCH_WANTED"
    "${PIP[@]}" "torch==$TORCH_WANTED" || die "pip could not install torch==$TORCH_WANTED" \
        "set OMNIHVD_TORCH to an available version, or OMNIHVD_TORCH=keep to use the base python's torch"
    TORCH_VERSION="$(torch_version)"
    [ -n "$TORCH_VERSION" ] || die "torch==$TORCH_WANTED was installed but does not import" \
        "run $PY -c 'import torch' to see why"
fi

# 4. Python dependencies (numpy, mpi4py, horovod's build requirements, test tools).
"$PY" -c 'import setuptools, wheel, numpy, mpi4py, cffi, psutil, yaml, cloudpickle, packaging, pytest, hypothesis, matplotlib' 2>/dev/null || {
    say "installing numpy, mpi4py, build and test requirements"
    "${PIP[@]}" setuptools wheel numpy mpi4py cffi psutil pyyaml cloudpickle packaging pytest hypothesis matplotlib ||
        die "pip install of the dependencies failed" "see pip's message above"
}

# 5. horovod, built against this torch and this MPI, cached by both.
horovod_ok() {
    "$PY" - <<'EOF' 2>/dev/null
import os, horovod, horovod.torch as hvd
assert horovod.__version__ == "0.28.1" and hvd.mpi_built()
assert hvd.nccl_built() or os.environ.get("HOROVOD_GPU_OPERATIONS") != "NCCL"
EOF
}
if ! horovod_ok; then
    # The wheel fits one python, one torch, one MPI and one set of HOROVOD_* options.
    # MPICH prints its version on a later line than Open MPI, hence the first line
    # with a digit; the hash tells apart MPIs of one version installed in two places.
    MPI_TEXT="$( { mpirun --version 2>&1 || true; } | sed -n '/[0-9]/{p;q;}')"
    MPI_ID="$(printf '%s' "$MPI_TEXT" | tr -cd '[:alnum:]._-' | cut -c1-40)"
    MPI_HASH="$( { printf '%s\n' "$MPI_TEXT"; mpicc -show 2>&1 || true; env | grep '^HOROVOD_' | sort || true; } |
        sha256sum | cut -c1-8)"
    PY_TAG="$("$PY" -c 'import sys; print("py%d%d" % sys.version_info[:2])')"
    KEY="horovod-$HOROVOD_VERSION-$PY_TAG-torch$(echo "$TORCH_VERSION" | tr '+' '_')-$MPI_ID-$MPI_HASH"
    WHEEL_DIR="$CACHE/wheels/$KEY"
    if ! ls "$WHEEL_DIR"/horovod-*.whl >/dev/null 2>&1; then
        command -v g++ >/dev/null || apt_install g++ || die "no C++ compiler (g++)" "install g++ and rerun"
        command -v cmake >/dev/null || apt_install cmake || die "no cmake" "install cmake (>= 3.13) and rerun"
        say "building horovod $HOROVOD_VERSION with PyTorch + MPI + Gloo (about 10 minutes of CPU time, once: the wheel is cached)"
        mkdir -p "$CACHE/bin"
        # horovod's CMakeLists forces C++14; torch >= 2.1 headers need C++17. The last
        # -std flag wins, so appending one fixes every compile without patching horovod.
        cat >"$CACHE/bin/g++-c++17" <<'EOF'
#!/bin/sh
exec g++ "$@" -std=c++17
EOF
        chmod +x "$CACHE/bin/g++-c++17"
        BUILD="$(mktemp -d)"
        # --no-cache-dir: pip's own wheel cache is keyed by the sdist alone and would
        # hand back a horovod built for another torch or MPI.
        # PyTorch and MPI are what omnihvd needs; Gloo and MPI for CPU operations are
        # defaults a user's own HOROVOD_WITH_GLOO / HOROVOD_CPU_OPERATIONS replace.
        if ! env CXX="$CACHE/bin/g++-c++17" HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 \
            HOROVOD_WITH_GLOO="${HOROVOD_WITH_GLOO:-1}" \
            HOROVOD_CPU_OPERATIONS="${HOROVOD_CPU_OPERATIONS:-MPI}" \
            HOROVOD_WITHOUT_TENSORFLOW="${HOROVOD_WITHOUT_TENSORFLOW:-1}" \
            HOROVOD_WITHOUT_MXNET="${HOROVOD_WITHOUT_MXNET:-1}" \
            MAKEFLAGS="-j$(nproc)" \
            "$PY" -m pip wheel -q --no-cache-dir --no-build-isolation --no-deps --no-binary horovod \
            "horovod==$HOROVOD_VERSION" -w "$BUILD" >"$BUILD/build.log" 2>&1; then
            tail -n 40 "$BUILD/build.log" >&2
            die "building horovod failed (full log: $BUILD/build.log)" \
                "check that mpicc, g++ and cmake work and that torch imports; then rerun"
        fi
        mkdir -p "$WHEEL_DIR.tmp" && mv "$BUILD"/horovod-*.whl "$WHEEL_DIR.tmp/"
        rm -rf "$WHEEL_DIR" && mv "$WHEEL_DIR.tmp" "$WHEEL_DIR"   # atomic: no half-built cache
        rm -rf "$BUILD"
    else
        say "using cached horovod wheel from $WHEEL_DIR"
    fi
    "${PIP[@]}" --no-deps --force-reinstall "$WHEEL_DIR"/horovod-*.whl ||
        die "could not install the horovod wheel" "remove $WHEEL_DIR and rerun to rebuild it"
    horovod_ok || die "horovod installed but is not built with PyTorch and MPI" \
        "remove $WHEEL_DIR and rerun; run .venv/bin/omnihvd doctor for details"
fi

# 6. omnihvd itself (editable, with its console script).
# Checked from / so that the current folder cannot stand in for the installed package;
# the console script must run too (it names its module, which may have moved).
(cd / && "$PY" -c 'import omnihvd, os, sys; sys.exit(os.path.dirname(omnihvd.__file__) != sys.argv[1])' \
    "$ROOT/omnihvd") 2>/dev/null && [ -x "$VENV/bin/omnihvd" ] &&
    "$VENV/bin/omnihvd" --help >/dev/null 2>&1 ||
    "${PIP[@]}" --no-deps --no-build-isolation -e "$ROOT" || die "pip install -e . failed" "see pip's message above"

"$VENV/bin/omnihvd" doctor --quiet || die "omnihvd doctor found a problem" "run .venv/bin/omnihvd doctor and follow its fixes"
touch "$DONE_MARK"
say "ready: $VENV (torch $TORCH_VERSION, horovod $HOROVOD_VERSION)"
