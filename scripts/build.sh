#!/usr/bin/env bash
# Configures and builds indexer into $BUILD_DIR (default ./build), Release, with the CUDA backend
# when nvcc exists (CMAKE_CUDA_ARCHITECTURES defaults to 90a-real;90-virtual: H100/H200 code, PTX for newer GPUs).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build}
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
generator=()
command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
# INDEXER_WERROR=ON (CI) makes compiler warnings errors.
[ -f "$build/CMakeCache.txt" ] || cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DINDEXER_WERROR="${INDEXER_WERROR:-OFF}" "$@"
cmake --build "$build" --parallel "$(nproc)"
