#!/usr/bin/env bash
# Builds the GPU binaries here (sm_90a) and bundles them, with the shared libraries they need and
# the seed's benchmark, into .device/ (git-ignored), for scripts/gpu_check.sh on the GPU machine
# (scripts/service_bench.py, which gpu_check.sh service runs, is in the tree and needs no bundling):
#
#   scripts/gpu_bundle.sh [BUILD_DIR]      then run gpu_check.sh there with .device carried.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build-gpu}
# sm_90a code only (no PTX): the bundle runs on the H200 and must stay small.
launcher=()
if command -v ccache >/dev/null 2>&1; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a-real \
  "${launcher[@]}" >/dev/null
cmake --build "$build" --target gpu_select_test cuda_backend_test cuda_region_test security_gpu_test indexer-kernel-bench \
  indexer-stream-probe indexer-launch-probe indexer-server indexer-cli indexer-bench indexer-echo-server fuzz_corpus_test
rm -rf "$root/.device/bundle" "$root/.device/bench"
mkdir -p "$root/.device"
bundler=${BUNDLE_LIBS:-$root/../shared/tools/bundle-libs.sh}
for bin in "$build/tests/gpu/gpu_select_test" "$build/tests/gpu/cuda_backend_test" "$build/tests/gpu/cuda_region_test" \
           "$build/tests/security/security_gpu_test" \
           "$build/kernels/indexer-kernel-bench" "$build/kernels/indexer-stream-probe" "$build/kernels/indexer-launch-probe" "$build/server/indexer-server" \
           "$build/client/cpp/indexer-cli" "$build/client/bench/indexer-bench" \
           "$build/client/bench/indexer-echo-server" "$build/tests/fuzz/fuzz_corpus_test"; do
  # bundle-libs.sh stops early for a binary that needs no extra library; check the copy instead.
  "$bundler" "$root/.device/bundle" "$bin" >/dev/null || true
  [ -x "$root/.device/bundle/$(basename "$bin")" ] || { echo "bundling $bin failed" >&2; exit 1; }
done
cp -r "${SEED_BENCH_DIR:-$root/../shared/bench}" "$root/.device/bench"
du -sh "$root/.device/bundle" "$root/.device/bench"
# Carry the archive to the GPU machine (.device/bundle.tgz and .device/bench, kept under 60 MiB:
# the unpacked bundle is larger); gpu_check.sh unpacks it (afresh) when it is there.
tar czf "$root/.device/bundle.tgz" -C "$root/.device" bundle
kib=$(du -sck "$root/.device/bundle.tgz" "$root/.device/bench" | tail -n 1 | cut -f1)
echo ".device/bundle.tgz and .device/bench: ${kib} KiB to carry"
[ "$kib" -lt $((60 * 1024)) ] || { echo "over the 60 MiB to carry to the GPU machine" >&2; exit 1; }
