#!/usr/bin/env bash
# Installs the dependencies, builds into build/, and runs the whole test suite.
# Extra arguments go to ctest (for example -R ParameterStore or -L e2e).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh
(cd "${BUILD_DIR:-build}" && ctest --output-on-failure -j "$(nproc)" "$@")
scripts/fuzz.sh --seconds 15 --seed 1 --build-dir "${FUZZ_BUILD_DIR:-build-fuzz}"
