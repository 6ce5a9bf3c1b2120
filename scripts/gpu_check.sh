#!/usr/bin/env bash
# Runs on a machine with an NVIDIA GPU (sm_90a: H100/H200), from the repository root, after
# scripts/gpu_bundle.sh made .device/: the GPU test suite, a compute-sanitizer pass, the kernel
# benchmark and, right after it on the same GPU, the seed's benchmark, then the ratio table.
# Logs go to $OUT (default ./gpu-out).
#
#   scripts/gpu_check.sh [tests|bench|all]    (default all)
#     tests: GPU tests and compute-sanitizer; bench: our benchmark, its decode timeline and the
#     streaming probe;
#     all: both, then the seed
#   scripts/gpu_check.sh faults
#     GPU faults: a capacity larger than the card must fail at start with a clear message, and
#     the fuzz corpus (tests/fuzz/corpus) replayed on the CUDA backend must hold every invariant
#   scripts/gpu_check.sh backend [ARGS]
#     the CUDA backend's tests (without gpu_select_test and compute-sanitizer), the service
#     demo, faults, then service with ARGS
#   scripts/gpu_check.sh service [ARGS]
#     the service benchmark (scripts/service_bench.py: decode steps over gRPC against the kernel
#     time, batching on/off, indexer against the echo server) into $OUT/service (three files),
#     about 100 s; ARGS go to the script (e.g. --cases decode, or --devices 0,1 on two GPUs)
# BUNDLE=DIR uses binaries bundled elsewhere than .device/bundle.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
what=${1:-all}
out=${OUT:-$root/gpu-out}
mkdir -p "$out"
bundle=${BUNDLE:-.device/bundle}   # BUNDLE: another folder made like it
# The archive gpu_bundle.sh made, unpacked afresh each time: a GPU machine may keep an older
# unpacked .device/bundle from an earlier run.
if [ -z "${BUNDLE:-}" ] && [ -f .device/bundle.tgz ]; then
  rm -rf .device/bundle
  tar xzf .device/bundle.tgz -C .device || { echo "cannot unpack .device/bundle.tgz" >&2; exit 1; }
fi
export LD_LIBRARY_PATH=$root/$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
status=0
step() { echo; echo "=== $* ==="; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv | tee "$out/nvidia-smi.txt"

if [ "$what" = tests ] || [ "$what" = all ] || [ "$what" = backend ]; then
  step "GPU tests (kernels vs CPU reference)"
  if [ "$what" = backend ]; then
    echo "(backend: gpu_select_test is left to 'tests')"
  else
    $bundle/gpu_select_test 2>&1 | tee "$out/gpu_select_test.log" | grep -E '^\[  (PASSED|FAILED|SKIPPED) |FAILED|Failure|error|seed' || true
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  fi
  step "CUDA backend vs CPU backend through the engine"
  $bundle/cuda_backend_test 2>&1 | tee "$out/cuda_backend_test.log" | grep -E '^\[  (PASSED|FAILED|SKIPPED) |FAILED|Failure' || true
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  step "CUDA regions through an indexer-server child"
  INDEXER_SERVER_BINARY=$bundle/indexer-server $bundle/cuda_region_test 2>&1 | tee "$out/cuda_region_test.log" | grep -E '^\[  (PASSED|FAILED|SKIPPED) |FAILED|Failure|answered' || true
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  # The Python client's CudaRegion, with torch: the installed package of a local build, carried
  # beside the bundle (PYTHON_PACKAGE, default build/python); skipped when it was not carried.
  if [ -d "${PYTHON_PACKAGE:-build/python}/indexer_client" ]; then
    step "Python CudaRegion (torch CUDA memory) against the CUDA server"
    PYTHONPATH=${PYTHON_PACKAGE:-build/python} INDEXER_SERVER_BIN=$bundle/indexer-server \
      python3 tests/python/test_cuda_region.py > "$out/python_cuda_region.log" 2>&1
    rc=$?
    tail -n 3 "$out/python_cuda_region.log"
    [ "$rc" -eq 0 ] || status=1
  fi
  step "snapshots across the CUDA and CPU backends"
  $bundle/security_gpu_test 2>&1 | tee "$out/security_gpu_test.log" | grep -E '^\[  (PASSED|FAILED|SKIPPED) |FAILED|Failure' || true
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  for tool in $([ "$what" = backend ] || echo memcheck racecheck); do
    step "compute-sanitizer $tool"
    compute-sanitizer --tool $tool --error-exitcode 9 $bundle/gpu_select_test --gtest_filter='*SanitizerSmall*' \
      >> "$out/sanitizer.log" 2>&1
    rc=$?
    tail -n 3 "$out/sanitizer.log"
    [ $rc -eq 0 ] || { echo "compute-sanitizer $tool: exit $rc"; status=1; }
  done
fi

if [ "$what" = tests ] || [ "$what" = all ] || [ "$what" = backend ]; then
  step "the service on the GPU: indexer-server --device=cuda driven by indexer-cli demo"
  $bundle/indexer-server --listen=127.0.0.1:50191 --metrics_listen=127.0.0.1:50192 --device=cuda \
    --capacity=16GiB > "$out/server.log" 2>&1 &
  server=$!
  for _ in $(seq 100); do $bundle/indexer-cli --server=127.0.0.1:50191 health >/dev/null 2>&1 && break; sleep 0.2; done
  $bundle/indexer-cli --server=127.0.0.1:50191 demo --sequences=32 --tokens=32768 --steps=64 2>&1 | tee -a "$out/server.log" || status=1
  step "the GPU server's /metrics: NVML's device gauges and the CUDA backend's counters"
  python3 scripts/check_gpu_metrics.py http://127.0.0.1:50192/metrics 2>&1 | tee "$out/gpu_metrics.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  kill -TERM $server; wait $server || { echo "indexer-server exited $?"; status=1; }
  grep -E "serving on|stopped" "$out/server.log"
fi

if [ "$what" = bench ] || [ "$what" = all ]; then
  step "kernel benchmark"
  $bundle/indexer-kernel-bench --preset=all --storage=all > "$out/kernel_bench.jsonl" 2>&1 || status=1
  grep -v '^{' "$out/kernel_bench.jsonl"
  step "where the decode time goes (--timeline: %globaltimer stamps of one run per case)"
  $bundle/indexer-kernel-bench --preset=decode --storage=bf16 --reps=20 --timeline 2>&1 | grep -v '^{' \
    | tee "$out/timeline.txt" || status=1
  step "streaming probe (access patterns on the B=256 L=128K bytes)"
  $bundle/indexer-stream-probe 262144 2>&1 | tee "$out/stream_probe.txt" || status=1
  step "launch probe (the host's cost of one small device round trip)"
  $bundle/indexer-launch-probe 2>&1 | tee "$out/launch_probe.txt" || status=1
fi
if [ "$what" = sweep ]; then
  # Blocks per CTA against time on the large and the medium decode cases.
  for chunk in ${SWEEP_CHUNKS:-8 16 32 64 128}; do
    step "max-chunk $chunk"
    $bundle/indexer-kernel-bench --case=256,131072,1,1,uniform --case=256,131072,4,1,uniform \
      --case=64,32768,4,1,uniform --case=16,32768,1,4,uniform --case=64,131072,1,4,uniform \
      --case=1,131072,4,1,uniform --storage=bf16 --reps=50 --max-chunk=$chunk | grep -v '^{'
  done
fi
if [ "$what" = profile ]; then
  # Nsight Compute on a few decode cases (clocks left alone): where the time goes.
  for c in ${PROFILE_CASES:-1,4096,1,1,uniform 1,131072,4,1,uniform 256,131072,1,1,uniform}; do
    step "ncu $c"
    ncu --clock-control none --kernel-name regex:DecodeSelect --launch-skip 25 --launch-count 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
      --section LaunchStats $bundle/indexer-kernel-bench --case=$c --storage=${PROFILE_STORAGE:-bf16} --reps=10 \
      > "$out/ncu_${c//,/_}.txt" 2>&1
    grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Block Limit|Stall|Warp Cycles Per Issued|Grid Size|Dynamic Shared" "$out/ncu_${c//,/_}.txt" | head -30
  done
fi
if [ "$what" = faults ] || [ "$what" = backend ]; then
  step "GPU faults: a pool larger than the card"
  for devices in 0 all; do
    start=$(date +%s%N)
    $bundle/indexer-server --listen=127.0.0.1:50193 --device=cuda --devices=$devices --capacity=4096GiB \
      > "$out/capacity_$devices.log" 2>&1
    rc=$?
    echo "--devices=$devices --capacity=4096GiB: exit $rc after $(( ($(date +%s%N) - start) / 1000000 )) ms"
    tail -n 2 "$out/capacity_$devices.log"
    [ $rc -ne 0 ] && grep -qi "capacity\|memory" "$out/capacity_$devices.log" || { echo "expected a clear refusal"; status=1; }
  done
  step "GPU faults: the fuzz corpus on the CUDA backend"
  INDEXER_FUZZ_DEVICE=cuda $bundle/fuzz_corpus_test tests/fuzz/corpus 2>&1 | tail -n 3 | tee "$out/fuzz_corpus_cuda.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "fuzz corpus on CUDA failed"; status=1; }
fi
if [ "$what" = service ] || [ "$what" = backend ]; then
  step "service benchmark (indexer-server, indexer-echo-server and indexer-bench on this machine)"
  python3 scripts/service_bench.py --device cuda --bin $bundle --out "$out/service" "${@:2}" || status=1
fi
if [ "$what" = all ]; then
  step "seed benchmark (same GPU, right after)"
  PYTHONUNBUFFERED=1 python3 .device/bench/seed_bench.py --preset all --json "$out/seed.json" > "$out/seed_bench.log" 2>&1 || status=1
  tail -n 20 "$out/seed_bench.log"
  # Few files come back from the GPU machine: keep the seed's log with ours.
  cat "$out/seed_bench.log" >> "$out/kernel_bench.jsonl" && rm -f "$out/seed_bench.log"
  step "ratios"
  python3 scripts/compare_seed.py "$out/kernel_bench.jsonl" "$out/seed.json" | tee "$out/compare.txt"
fi
exit $status
