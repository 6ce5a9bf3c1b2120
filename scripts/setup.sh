#!/usr/bin/env bash
# Installs every system package indexer needs to build, test and run, with apt-get.
# Idempotent: installs only what is missing. Debian 12 (bookworm) and Ubuntu 24.04 (noble).
# The CUDA toolkit is not installed here: where nvcc is on PATH (or /usr/local/cuda/bin) the
# CUDA backend is built too; without it the build has the CPU backend only.
#
#   scripts/setup.sh               what building and every test need
#   scripts/setup.sh --build-only  what building the programs needs (-DBUILD_TESTING=OFF; the
#                                  container image's build stage)
#   scripts/setup.sh --list [--build-only]   prints the package names instead of installing
set -euo pipefail

build_only=0
list=0
for arg in "$@"; do
  case "$arg" in
    --build-only) build_only=1 ;;
    --list) list=1 ;;
    -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;;  # the header comment
    *) echo "setup: unknown argument '$arg' (--build-only, --list)" >&2; exit 2 ;;
  esac
done

build_packages=(
  build-essential cmake ninja-build pkg-config git ca-certificates
  libgrpc++-dev libgrpc-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler grpc-proto
  libabsl-dev libspdlog-dev libfmt-dev prometheus-cpp-dev
  libcivetweb-dev  # the HTTP server of the /metrics endpoint (server/metrics_endpoint.cc)
)
test_packages=(
  libgtest-dev libgmock-dev
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
packages=("${build_packages[@]}")
[ $build_only -eq 1 ] || packages+=("${test_packages[@]}")
if [ $list -eq 1 ]; then
  printf '%s\n' "${packages[@]}"
  exit 0
fi

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
