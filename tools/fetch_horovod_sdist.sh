#!/usr/bin/env bash
# Horovod's source as one file, for a machine without network (the device run of
# benchmarks/gpu_horovod.sh): downloads the sdist of horovod==$HOROVOD_VERSION
# (default 0.28.1, the version tools/setup.sh builds) from PyPI into .cache/
# (ignored by git) and checks that it is one. Idempotent: a second run checks the
# file already there and downloads nothing.
#
# Usage: bash tools/fetch_horovod_sdist.sh [DEST_DIR]     (default: .cache)
# Then carry the file: the device tool's carry list names ".cache" (about 4 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
version=${HOROVOD_VERSION:-0.28.1}
dest=${1:-.cache}
file="$dest/horovod-$version.tar.gz"
py=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}

check() {  # a gzip'd tar whose top folder is horovod-VERSION with setup.py and CMakeLists.txt
    local names
    names=$(tar -tzf "$1" 2>/dev/null) || return 1
    grep -qx "horovod-$version/setup.py" <<<"$names" &&
        grep -qx "horovod-$version/CMakeLists.txt" <<<"$names" &&
        grep -qx "horovod-$version/horovod/torch/mpi_ops_v2.cc" <<<"$names"
}

if [ -f "$file" ] && check "$file"; then
    echo "fetch_horovod_sdist: $file is there ($(du -k "$file" | cut -f1) KiB, sha256 $(sha256sum "$file" | cut -c1-16)...)"
    exit 0
fi
mkdir -p "$dest"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$py" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
    "horovod==$version" -d "$tmp" || {
    echo "fetch_horovod_sdist: pip could not download horovod==$version's sdist (no network to PyPI?)" >&2
    exit 1
}
got=$(ls "$tmp"/horovod-"$version".tar.gz 2>/dev/null || true)
if [ -z "$got" ] || ! check "$got"; then
    echo "fetch_horovod_sdist: what pip downloaded is not horovod-$version's source: $(ls "$tmp")" >&2
    exit 1
fi
mv "$got" "$file"
echo "fetch_horovod_sdist: wrote $file ($(du -k "$file" | cut -f1) KiB, sha256 $(sha256sum "$file" | cut -c1-16)...)"
