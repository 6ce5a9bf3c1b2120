#!/usr/bin/env bash
# The main job: sets up, builds, starts indexer-server (CUDA backend when a GPU is usable, else
# CPU) on a local port, drives it with indexer-bench (the load tester: sequences prefilled,
# decoded as Batch calls and released, the way a scheduler does it), prints what it did and how
# fast, and stops the server with SIGTERM. Two passes: a short one that checks every answer
# against the CPU reference, then a closed-loop load test whose summary (throughput, latency
# percentiles, histogram, status codes) is printed and also written as $build/bench-report.html
# and .json. Extra arguments go to the load test's indexer-bench (see its --help), e.g.
#   scripts/run.sh --duration=30s --concurrency=4
#   scripts/run.sh --sweep=concurrency:1,2,4,8 --sweep_max_latency=50ms
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup.sh"
"$root/scripts/build.sh"
build=${BUILD_DIR:-$root/build}
port=${INDEXER_PORT:-50151}
log=$(mktemp -t indexer-server.XXXXXX.log)
"$build/server/indexer-server" --listen="127.0.0.1:$port" --device="${INDEXER_DEVICE:-auto}" \
  --capacity="${INDEXER_CAPACITY:-2GiB}" >"$log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null || true' EXIT
cli=("$build/client/cpp/indexer-cli" --server="127.0.0.1:$port")
for _ in $(seq 100); do
  "${cli[@]}" health >/dev/null 2>&1 && break
  kill -0 $server 2>/dev/null || { cat "$log"; echo "run: indexer-server exited" >&2; exit 1; }
  sleep 0.1
done
head -n 1 "$log"
bench=("$build/client/bench/indexer-bench" --servers="127.0.0.1:$port" --progress=off)
echo "run: correctness pass: 16 sequences prefilled, decoded and released, every answer checked"
"${bench[@]}" --values=int --check --sequences=16 --duration=0 --warmup=0 --concurrency=2 \
  --prefill=uniform:1000-6000 --decode_steps=uniform:8-24 --attention_pages --summary=brief
echo "run: load test: 2 workers x 8 sequences (prefill 4k-12k tokens, 32-128 decode steps each," \
  "replaced when done), one Batch call per decode step, 10 s after a 2 s warm-up"
"${bench[@]}" --duration=10s --warmup=2s --concurrency=2 --batch=8 \
  --prefill=uniform:4096-12288 --decode_steps=uniform:32-128 \
  --html="$build/bench-report.html" --json="$build/bench-report.json" "$@"
kill -TERM $server
trap - EXIT
wait $server && echo "run: server drained and exited 0" || { tail "$log"; exit 1; }
