#!/usr/bin/env bash
# Compressed gradients on a slow link (issue #17): the Fashion-MNIST MLP of
# examples/fashion_mlp.textproto (BSP, Adam at 1e-3, batch 64 per worker, 2 workers, 2 shards,
# one thread per worker), trained with each wire encoding while every shard sits behind an
# emulated link of RATE_MBIT per direction (build/bin/slow_link_benchmark: tessera local plus a
# rate-limited proxy per shard). Each round runs every encoding once, in turn, so they see the
# same load; the test split is scored at every epoch end.
#
#   bench/slow_link_bench.sh                               # RATE_MBIT=1000 EPOCHS=4 ROUNDS=1
#   RATE_MBIT=10000 ROUNDS=2 ENCODINGS="fp32 sign1" bench/slow_link_bench.sh
#   TOPK_FRACTION=0.05 bench/slow_link_bench.sh           # topk's fraction (default the spec's 0.01)
#   ENCODINGS="fp32 topk:delta_topk" PULL_TOPK_FRACTION=0.1 bench/slow_link_bench.sh
#   ENCODINGS="fp32 topk topk:delta_int8" TOPK_FRACTION=0.1 bench/slow_link_bench.sh
#
# An encoding WIRE:PULL sets the spec's wire_encoding to WIRE and its pull_encoding to PULL
# ("delta_topk", "delta_int8": weight deltas with the shard's error feedback;
# PULL_TOPK_FRACTION, default the spec's 0.1, sets delta_topk's pull_topk_fraction).
#
# Prints one JSON line per run and a Markdown table: seconds from the job's start to the first
# evaluation at or above TARGET (0.85) test accuracy, the final test accuracy, training samples
# per second, the bytes that crossed the shards' links per worker step in each direction, and
# each run's time to the target as a ratio to fp32's in the same round (above 1 is faster).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
EPOCHS=${EPOCHS:-4}
ROUNDS=${ROUNDS:-1}
TARGET=${TARGET:-0.85}
RATE_MBIT=${RATE_MBIT:-1000}
ENCODINGS=${ENCODINGS:-fp32 sign1 topk}
PY=/usr/bin/python3
OUT=${OUT:-$(mktemp -d /tmp/tessera-slow-link.XXXXXX)}
mkdir -p "$OUT"
export OMP_WAIT_POLICY=passive
[ -x "$BUILD_DIR/bin/slow_link_benchmark" ] ||
  { echo "build first: $BUILD_DIR/bin/slow_link_benchmark is missing" >&2; exit 64; }
spec() {  # spec WIRE[:PULL] FILE
  local wire=${1%%:*} pull=
  [ "$wire" = "$1" ] || pull=${1#*:}
  sed -e "s/^epochs: .*/epochs: $EPOCHS/" examples/fashion_mlp.textproto > "$2"
  grep -q '^num_workers:' "$2" || echo "num_workers: 2" >> "$2"
  printf 'eval { every_epochs: 1 }\nwire_encoding: "%s"\n' "$wire" >> "$2"
  if [ "$wire" = topk ] && [ -n "${TOPK_FRACTION:-}" ]; then
    echo "topk_fraction: $TOPK_FRACTION" >> "$2"
  fi
  if [ -n "$pull" ]; then
    echo "pull_encoding: \"$pull\"" >> "$2"
    if [ "$pull" = delta_topk ] && [ -n "${PULL_TOPK_FRACTION:-}" ]; then
      echo "pull_topk_fraction: $PULL_TOPK_FRACTION" >> "$2"
    fi
  fi
}
summarise() {  # summarise OUTPUT_FILE ENCODING ROUND
  "$PY" bench/local_run_summary.py "$1" --target "$TARGET" --workers 2 --label "encoding=$2" \
    --label "round=$3"
}
results="$OUT/results.jsonl"
: > "$results"
for round in $(seq 1 "$ROUNDS"); do
  for encoding in $ENCODINGS; do
    spec "$encoding" "$OUT/spec-$encoding.textproto"
    log="$OUT/$round-$encoding.out"
    echo "round $round: $encoding, $RATE_MBIT Mbit/s per shard link, $EPOCHS epochs" >&2
    "$BUILD_DIR/bin/slow_link_benchmark" --job "$OUT/spec-$encoding.textproto" --shards 2 \
      --workers 2 --threads 1 --rate_mbit "$RATE_MBIT" --output json > "$log" \
      2> "$OUT/$round-$encoding.err"
    summarise "$log" "$encoding" "$round" | tee -a "$results"
  done
done
"$PY" - "$results" "$TARGET" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
target = sys.argv[2]
base = {r["round"]: r for r in rows if r["encoding"] == "fp32"}
def f(x, fmt):
    return "n/a" if x is None else fmt.format(x)
print()
print(f"| round | encoding | Mbit/s | s to {target} | vs fp32 | final test acc | per epoch | samples/s | "
      "KB to shards / step | KB from shards / step |")
print("|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    b = base.get(r["round"])
    ratio = None
    if b and b["time_to_target"] and r["time_to_target"]:
        ratio = b["time_to_target"] / r["time_to_target"]
    print(f"| {r['round']} | {r['encoding']} | {r['rate_mbit']:g} | {f(r['time_to_target'], '{:.1f}')} | "
          f"{f(ratio, '{:.2f}')} | {r['test_accuracy']:.4f} | {', '.join(map(str, r['evaluations']))} | "
          f"{r['samples_per_second']:.0f} | {r['bytes_to_shards_per_step'] / 1e3:.0f} | "
          f"{r['bytes_from_shards_per_step'] / 1e3:.0f} |")
EOF
echo "raw results and logs: $OUT" >&2
