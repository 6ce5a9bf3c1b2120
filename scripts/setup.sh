#!/usr/bin/env bash
# Installs every system package indexer needs to build, test and run, with apt-get.
# Idempotent: installs only what is missing. Debian 12 (bookworm) and Ubuntu 24.04 (noble).
# The CUDA toolkit is not installed here: where nvcc is on PATH (or /usr/local/cuda/bin) the
# CUDA backend is built too; without it the build has the CPU backend only.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git ca-certificates
  libgrpc++-dev libgrpc-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler grpc-proto
  libabsl-dev libspdlog-dev libfmt-dev libgtest-dev libgmock-dev prometheus-cpp-dev
  libcivetweb-dev  # the HTTP server of the /metrics endpoint (server/metrics_endpoint.cc)
  python3 python3-grpcio python3-numpy python3-protobuf
  python3-pip python3-venv python3-setuptools python3-wheel  # pip install ./client/python (tests/python)
  procps
  openssl  # makes the test certificates of the TLS tests (tests/security/make_test_certs.sh)
  chromium  # headless, renders indexer-bench's HTML report in its test (bench_report_render_test)
  nginx python3-yaml  # the deployment tests: sticky routing through nginx, manifests parsed
  yamllint  # the deployment tests lint every YAML file under docker/
  prometheus  # promtool: the metrics tests check the live /metrics exposition with it
  clang libclang-rt-dev  # sanitizer and libFuzzer builds (scripts/sanitize.sh, scripts/fuzz.sh)
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#packages[@]} packages already installed"
  exit 0
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q
$sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
