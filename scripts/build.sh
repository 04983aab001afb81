#!/usr/bin/env bash
# Configures into build/ and builds with every core. Extra arguments go to cmake's configure step
# (for example -DTESSERA_CUDA=OFF).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=${CMAKE_BUILD_TYPE:-RelWithDebInfo} "$@"
cmake --build "$BUILD_DIR" -j "$(nproc)"
