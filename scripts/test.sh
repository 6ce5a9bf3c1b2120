#!/usr/bin/env bash
# Sets up, builds and runs every test (GoogleTest suites under ctest, the Python client test).
# GPU tests skip with a message where no GPU is usable. Extra arguments go to ctest.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup.sh"
"$root/scripts/build.sh"
cd "${BUILD_DIR:-$root/build}"
ctest --output-on-failure --timeout 900 -j "$(nproc)" "$@"
