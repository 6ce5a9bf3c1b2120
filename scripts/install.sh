#!/usr/bin/env bash
# Installs the built programs into PREFIX (default /opt/indexer): PREFIX/bin/{indexer-server,
# indexer-cli, indexer-bench} and, in PREFIX/lib, the shared libraries they need that are not
# part of the C/C++ runtime or the GPU driver (gRPC, protobuf, Abseil, spdlog, ...), so that a
# slim runtime image (docker/Dockerfile) can run them with LD_LIBRARY_PATH=PREFIX/lib.
# Run after scripts/build.sh. The Dockerfile runs exactly this; so does the CI deploy test.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build}
prefix=${1:-/opt/indexer}
mkdir -p "$prefix/bin" "$prefix/lib"
programs=("$build/server/indexer-server" "$build/client/cpp/indexer-cli")
[ -x "$build/client/bench/indexer-bench" ] && programs+=("$build/client/bench/indexer-bench")
for program in "${programs[@]}"; do
  [ -x "$program" ] || { echo "install: $program is missing; run scripts/build.sh first" >&2; exit 1; }
  install -m 755 "$program" "$prefix/bin/"
  # Libraries resolved by the loader, minus libc, libm, libstdc++, libgcc, the loader and the
  # CUDA driver (the base image and the NVIDIA container runtime provide those).
  ldd "$program" | awk '$3 ~ /^\// {print $3}' |
    { grep -vE '/(libc|libm|libstdc\+\+|libgcc_s|libdl|libpthread|librt|ld-linux[^/]*|libcuda|libnvidia[^/]*)\.so' || true; } |
    while read -r lib; do cp -L "$lib" "$prefix/lib/"; done
done
echo "install: $(ls "$prefix/bin" | tr '\n' ' ')and $(ls "$prefix/lib" | wc -l) libraries in $prefix"
