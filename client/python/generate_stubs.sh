#!/usr/bin/env bash
# Generates the Python stubs of the indexer API into OUT_DIR, for users without the CMake build
# (which writes the same files into <build>/python). Needs protoc and grpc_python_plugin
# (Debian: protobuf-compiler, protobuf-compiler-grpc). Then: PYTHONPATH=OUT_DIR:client/python
set -euo pipefail
if [ $# -ne 1 ]; then
  echo "usage: $0 OUT_DIR" >&2
  exit 2
fi
out=$1
proto_dir=$(cd "$(dirname "$0")/../../proto" && pwd)
plugin=$(command -v grpc_python_plugin) || { echo "grpc_python_plugin not found (apt-get install protobuf-compiler-grpc)" >&2; exit 1; }
mkdir -p "$out"
protoc -I"$proto_dir" --python_out="$out" --grpc_out="$out" --plugin=protoc-gen-grpc="$plugin" \
  "$proto_dir/indexer/v1/indexer.proto"
# The standard health service, used by IndexerClient.health().
health=/usr/share/grpc-proto/grpc/health/v1/health.proto
if [ -f "$health" ]; then
  protoc -I/usr/share/grpc-proto --python_out="$out" --grpc_out="$out" \
    --plugin=protoc-gen-grpc="$plugin" "$health"
else
  echo "note: $health not found (Debian: grpc-proto); IndexerClient.health() will be unavailable" >&2
fi
echo "stubs written to $out; run with PYTHONPATH=$out:$(cd "$(dirname "$0")" && pwd)"
