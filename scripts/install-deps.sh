#!/usr/bin/env bash
# Installs every Debian 12 (bookworm) package that scripts/demo.sh and scripts/test.sh need on a
# fresh, minimal Debian 12 root: the build, every test and the fuzzers. Does nothing when all are
# present. Run as root, or as a user with sudo.
#
#   scripts/install-deps.sh           install what is missing
#   scripts/install-deps.sh --list    print the packages, one line, and exit (for a machine where
#                                     an administrator installs them: apt-get install --no-install-recommends ...)
#
# This list is the one place the project's system packages are named. Packages are installed with
# --no-install-recommends, so a package that another one only *recommends* but the build needs is
# named here (docs/decisions.md, "Build"): ocl-icd-opencl-dev (libdnnl-dev's CMake config calls
# find_package(OpenCL)) and libomp-dev (clang's OpenMP runtime, for the fuzz build).
set -euo pipefail

PACKAGES=(
  # build
  build-essential cmake pkg-config git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libspdlog-dev libcli11-dev zlib1g-dev libsqlite3-dev libisal-dev
  libdnnl-dev ocl-icd-opencl-dev
  prometheus-cpp-dev libsystemd-dev
  # tests
  libgtest-dev libgmock-dev libbenchmark-dev
  openssl iproute2 systemd prometheus python3 python3-numpy python3-grpcio
  # benchmarks: tessera-bench's ZeroMQ reference (pushpull --reference zmq)
  libzmq3-dev
  # fuzzers (scripts/fuzz.sh): clang with libFuzzer/ASan and its OpenMP runtime
  clang libclang-rt-14-dev libomp-dev
  # data: Fashion-MNIST in /usr/share/datasets/fashion-mnist
  dataset-fashion-mnist
)

case "${1:-}" in
  --list) echo "${PACKAGES[*]}"; exit 0 ;;
  -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
  "") ;;
  *) echo "install-deps: unknown argument $1 (see --help)" >&2; exit 64 ;;
esac

if ! command -v dpkg-query >/dev/null || ! command -v apt-get >/dev/null; then
  echo "install-deps: this is not a Debian system (no dpkg/apt-get); install the equivalents of:" >&2
  echo "  ${PACKAGES[*]}" >&2
  exit 69
fi

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null; then
    SUDO="sudo"
  else
    echo "install-deps: missing ${missing[*]}" >&2
    echo "install-deps: not root and no sudo; ask an administrator to run:" >&2
    echo "  apt-get install --no-install-recommends ${missing[*]}" >&2
    exit 77
  fi
fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
