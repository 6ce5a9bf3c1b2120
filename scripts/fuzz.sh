#!/usr/bin/env bash
# Fuzzes the service layer (tests/fuzz/service_fuzzer.cc) for a while with libFuzzer,
# AddressSanitizer (with LeakSanitizer) and UndefinedBehaviorSanitizer.
#
#   scripts/fuzz.sh [SECONDS] [libFuzzer flags...]     default 60 s; e.g. scripts/fuzz.sh 600 -jobs=2
#
# Configures a clang build folder of its own ($FUZZ_BUILD_DIR, default ./build-fuzz: CPU backend
# only, RelWithDebInfo, -DINDEXER_FUZZ=ON, the whole tree compiled with
# -fsanitize=fuzzer-no-link,address,undefined), builds only the fuzzer and runs it over the
# committed corpus (tests/fuzz/corpus, read only) plus a scratch folder for what it finds. A
# finding stops the run: the input is saved as $FUZZ_ARTIFACTS/crash-* (or leak-*, timeout-*) and
# the script exits non-zero; replay it with `indexer-service-fuzzer FILE` (INDEXER_FUZZ_TRACE=1
# prints every call). FUZZ_MERGE=1 afterwards adds the inputs that reach new coverage, minimized,
# to tests/fuzz/corpus. scripts/sanitize.sh asan configures the same way, so CI points
# FUZZ_BUILD_DIR at its folder and builds once.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${FUZZ_BUILD_DIR:-$root/build-fuzz}
seconds=60
if [ $# -gt 0 ] && [[ $1 =~ ^[0-9]+$ ]]; then
  seconds=$1
  shift
fi

command -v clang++ >/dev/null || "$root/scripts/setup.sh"
if [ ! -f "$build/CMakeCache.txt" ]; then
  generator=()
  command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
  CC=clang CXX=clang++ cmake -S "$root" -B "$build" "${generator[@]}" \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DINDEXER_ENABLE_CUDA=OFF -DINDEXER_FUZZ=ON \
    -DINDEXER_WERROR="${INDEXER_WERROR:-OFF}" \
    -DCMAKE_CXX_FLAGS="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
fi
grep -q '^INDEXER_FUZZ:BOOL=ON' "$build/CMakeCache.txt" ||
  { echo "fuzz: $build was not configured with -DINDEXER_FUZZ=ON" >&2; exit 2; }
cmake --build "$build" --parallel "$(nproc)" --target indexer-service-fuzzer
fuzzer=$build/tests/fuzz/indexer-service-fuzzer

found=${FUZZ_WORK_DIR:-$build/fuzz-found}
artifacts=${FUZZ_ARTIFACTS:-$build/fuzz-artifacts}
mkdir -p "$found" "$artifacts"
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:detect_stack_use_after_return=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
echo "fuzz: $fuzzer for ${seconds} s over tests/fuzz/corpus (new inputs: $found)"
start=$(date +%s)
"$fuzzer" -max_total_time="$seconds" -max_len=4096 -timeout=30 -rss_limit_mb=4096 \
  -print_final_stats=1 -artifact_prefix="$artifacts/" "$@" "$found" "$root/tests/fuzz/corpus"
echo "fuzz: no finding in $(( $(date +%s) - start )) s"

if [ "${FUZZ_MERGE:-0}" = 1 ]; then
  before=$(ls "$root/tests/fuzz/corpus" | wc -l)
  "$fuzzer" -merge=1 -max_len=4096 "$root/tests/fuzz/corpus" "$found"
  echo "fuzz: corpus $before -> $(ls "$root/tests/fuzz/corpus" | wc -l) inputs"
fi
