#!/usr/bin/env bash
# Configures into build/ (or $BUILD_DIR) and builds with every core. Extra arguments go to
# cmake's configure step (for example -DTESSERA_CUDA=OFF). $BUILD_TARGETS (space-separated) builds
# only those targets and what they need; unset, everything (tests and benchmarks included).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=${CMAKE_BUILD_TYPE:-RelWithDebInfo} "$@"
targets=()
for t in ${BUILD_TARGETS:-}; do targets+=(--target "$t"); done
cmake --build "$BUILD_DIR" -j "$(nproc)" "${targets[@]}"
