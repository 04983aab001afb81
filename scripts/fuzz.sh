#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz in a separate clang build (ASan + libFuzzer) and runs
# each for a bounded time. Exit status 1 when a target crashed (the reproducer's path and the
# command to replay it are printed), 2 for a usage or build error.
#
#   scripts/fuzz.sh [--seconds N] [--seed N] [--build-dir DIR] [--max-len BYTES] [--target NAME]...
#
# Defaults: 20 s per target, a random seed (--seed N > 0 fixes libFuzzer's, so that CI, which
# passes one through scripts/test.sh, mutates from the same random state on every run), build-fuzz/,
# inputs of at most 4096 bytes, every target. The corpus grows in DIR/fuzz-corpus/<target> (seeded
# from tests/fuzz/corpus/<target>), crashes land in DIR/fuzz-artifacts/. Longer runs by hand: scripts/fuzz.sh --seconds 3600.
# Needs clang and libclang-rt-14-dev (scripts/install-deps.sh installs them).
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=20
seed=0
build_dir=build-fuzz
max_len=4096
targets=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --seconds) seconds="$2"; shift 2 ;;
    --seed) seed="$2"; shift 2 ;;
    --build-dir) build_dir="$2"; shift 2 ;;
    --max-len) max_len="$2"; shift 2 ;;
    --target) targets+=("$2"); shift 2 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "fuzz.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
if ! [[ "$seconds" =~ ^[0-9]+$ && "$seconds" -gt 0 && "$max_len" =~ ^[0-9]+$ &&
      "$seed" =~ ^[0-9]+$ ]]; then
  echo "fuzz.sh: --seconds, --seed and --max-len take positive integers" >&2
  exit 2
fi
for tool in clang clang++ cmake; do
  command -v "$tool" >/dev/null || { echo "fuzz.sh: $tool is not installed" >&2; exit 2; }
done

start=$(date +%s)
mkdir -p "$build_dir"
CC=clang CXX=clang++ cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DTESSERA_FUZZ=ON -DTESSERA_CUDA=OFF -DTESSERA_BUILD_TESTS=OFF \
  -DTESSERA_BUILD_BENCHMARKS=OFF >"$build_dir/fuzz-configure.log" 2>&1 || {
  cat "$build_dir/fuzz-configure.log" >&2
  exit 2
}
if [[ ${#targets[@]} -eq 0 ]]; then
  mapfile -t targets < <(cmake --build "$build_dir" --target help | grep -o 'tessera_fuzz_[a-z_]*' | sort -u)
fi
if [[ ${#targets[@]} -eq 0 ]]; then
  echo "fuzz.sh: no fuzz targets configured in $build_dir" >&2
  exit 2
fi
cmake --build "$build_dir" -j "$(nproc)" --target "${targets[@]}" || exit 2
built=$(date +%s)
echo "fuzz.sh: built ${targets[*]} in $((built - start)) s"

failed=0
for target in "${targets[@]}"; do
  corpus="$build_dir/fuzz-corpus/$target"
  artifacts="$build_dir/fuzz-artifacts/$target/$(date +%Y%m%d-%H%M%S)"
  mkdir -p "$corpus" "$artifacts"
  seeds=()
  [[ -d "tests/fuzz/corpus/$target" ]] && seeds=("tests/fuzz/corpus/$target")
  log="$build_dir/fuzz-$target.log"
  # detect_leaks=0: Debian's uninstrumented gRPC and protobuf keep process-lifetime allocations.
  if ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1 "$build_dir/bin/$target" \
      -max_total_time="$seconds" -max_len="$max_len" -timeout=10 -rss_limit_mb=2048 \
      -print_final_stats=1 -seed="$seed" -artifact_prefix="$artifacts/" "$corpus" "${seeds[@]}" >"$log" 2>&1; then
    runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || true)
    echo "fuzz.sh: $target: ${runs:-?} inputs in ${seconds} s, no crash ($(ls "$corpus" | wc -l) corpus files)"
  else
    failed=1
    echo "fuzz.sh: $target CRASHED; last lines of $log:" >&2
    tail -n 40 "$log" >&2
    for reproducer in "$artifacts"/*; do
      [[ -f "$reproducer" ]] || continue
      echo "fuzz.sh: reproducer: $reproducer" >&2
      echo "fuzz.sh: replay: ASAN_OPTIONS=detect_leaks=0 $build_dir/bin/$target $reproducer" >&2
    done
  fi
done
echo "fuzz.sh: done in $(($(date +%s) - start)) s"
exit "$failed"
