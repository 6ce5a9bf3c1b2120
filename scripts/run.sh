#!/usr/bin/env bash
# The main job: sets up, builds, starts indexer-server (CUDA backend when a GPU is usable, else
# CPU) on a local port, drives it with a short decode workload (indexer-cli demo: prefill, then
# Batch decode steps, every answer checked), prints what it did and how fast, and stops the
# server with SIGTERM. Extra arguments go to `indexer-cli demo` (see its --help).
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
"${cli[@]}" demo "$@"
kill -TERM $server
trap - EXIT
wait $server && echo "run: server drained and exited 0" || { tail "$log"; exit 1; }
