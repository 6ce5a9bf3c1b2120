#!/usr/bin/env bash
# Runs the CPU tests under sanitizers, each in a clang build folder of its own (CPU backend only,
# RelWithDebInfo):
#
#   scripts/sanitize.sh asan   AddressSanitizer (with LeakSanitizer) + UndefinedBehaviorSanitizer:
#                              every CPU test (ctest without the gpu and deploy labels); folder
#                              $ASAN_BUILD_DIR, default ./build-asan
#   scripts/sanitize.sh tsan   ThreadSanitizer: the concurrency tests (engine stress, the select
#                              batcher and several devices, the service's
#                              handlers on many threads, the handler threads' executor, the shutdown's call tracker, and the real server end to end under the
#                              soak and shutdown tests' concurrent clients); folder
#                              $TSAN_BUILD_DIR, default ./build-tsan
#   scripts/sanitize.sh        both
#
# A finding fails the test that made it (the sanitizers halt on the first report) and so this
# script. Nothing is suppressed, except in scripts/tsan.supp (each entry says why). Extra
# arguments go to ctest. The asan folder is also configured for libFuzzer (-DINDEXER_FUZZ=ON,
# edge coverage), so scripts/fuzz.sh can reuse it (FUZZ_BUILD_DIR=build-asan) instead of
# building the tree a third time. INDEXER_WERROR=ON (CI) makes compiler warnings errors in a
# folder configured afresh.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
mode=${1:-all}
[ $# -gt 0 ] && shift

command -v clang++ >/dev/null || "$root/scripts/setup.sh"
generator=()
command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)

configure() {  # folder, extra cmake arguments...
  local build=$1
  shift
  [ -f "$build/CMakeCache.txt" ] && return 0
  CC=clang CXX=clang++ cmake -S "$root" -B "$build" "${generator[@]}" \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DINDEXER_ENABLE_CUDA=OFF \
    -DINDEXER_WERROR="${INDEXER_WERROR:-OFF}" "$@"
}

run_asan() {
  local build=${ASAN_BUILD_DIR:-$root/build-asan}
  # Edge coverage for the fuzzer, but not -fsanitize=fuzzer-no-link's comparison tracing, which
  # makes the compute-heavy tests about 2.5 times slower.
  configure "$build" -DINDEXER_FUZZ=ON \
    -DCMAKE_CXX_FLAGS="-fsanitize=address,undefined -fsanitize-coverage=inline-8bit-counters,indirect-calls,pc-table -fno-sanitize-recover=all -fno-omit-frame-pointer"
  cmake --build "$build" --parallel "$(nproc)"
  # detect_leaks: the test binaries and every indexer-server they start check for leaks at exit.
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:detect_stack_use_after_return=1:strict_init_order=1 \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  INDEXER_SOAK_SECONDS=${INDEXER_SOAK_SECONDS:-20} INDEXER_SOAK_SETTLE_MS=1000 \
    ctest --test-dir "$build" --output-on-failure --timeout 900 -j "$(nproc)" -LE 'gpu|deploy' "$@"
}

run_tsan() {
  local build=${TSAN_BUILD_DIR:-$root/build-tsan}
  configure "$build" -DCMAKE_CXX_FLAGS="-fsanitize=thread -fno-omit-frame-pointer"
  local tests=(engine_parts_test engine_stress_test select_batcher_test multi_device_test
               service_concurrency_test request_executor_test call_tracker_test soak_test shutdown_test)
  cmake --build "$build" --parallel "$(nproc)" --target "${tests[@]}" indexer-server
  TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$root/scripts/tsan.supp" \
  INDEXER_SOAK_SECONDS=${INDEXER_SOAK_SECONDS:-20} INDEXER_SOAK_SETTLE_MS=1000 \
    ctest --test-dir "$build" --output-on-failure --timeout 900 -j "$(nproc)" \
      -R "^($(IFS='|'; echo "${tests[*]}"))\$" "$@"
}

case "$mode" in
  asan) run_asan "$@" ;;
  tsan) run_tsan "$@" ;;
  all) run_asan "$@"; run_tsan "$@" ;;
  *) echo "usage: scripts/sanitize.sh [asan|tsan|all] [ctest arguments...]" >&2; exit 2 ;;
esac
