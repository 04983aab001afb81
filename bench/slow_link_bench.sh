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
spec() {  # spec ENCODING FILE
  sed -e "s/^epochs: .*/epochs: $EPOCHS/" examples/fashion_mlp.textproto > "$2"
  grep -q '^num_workers:' "$2" || echo "num_workers: 2" >> "$2"
  printf 'eval { every_epochs: 1 }\nwire_encoding: "%s"\n' "$1" >> "$2"
  if [ "$1" = topk ] && [ -n "${TOPK_FRACTION:-}" ]; then
    echo "topk_fraction: $TOPK_FRACTION" >> "$2"
  fi
}
summarise() {  # summarise OUTPUT_FILE ENCODING ROUND
  "$PY" - "$@" "$TARGET" <<'EOF'
import json, sys
path, encoding, rnd, target = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
events, record, link = [], None, None
for line in open(path):
    line = line.strip()
    if not line.startswith("{"):
        continue
    d = json.loads(line)
    if "event" in d:
        events.append(d["event"])
    elif "link" in d:
        link = d["link"]
    elif "id" in d:
        record = d
start = int(record.get("start_time_ms", 0))
to_target, evals = None, []
for e in events:
    if not e.get("evaluated"):
        continue
    if not evals or evals[-1] != round(e["test_accuracy"], 4):
        evals.append(round(e["test_accuracy"], 4))
    if to_target is None and e["test_accuracy"] >= target:
        to_target = (int(e["time_ms"]) - start) / 1000.0
steps = int(record.get("steps", 0)) * 2  # worker steps, both workers
print(json.dumps({
    "encoding": encoding, "round": rnd, "state": record.get("state_name"),
    "samples_per_second": record.get("samples_per_second"),
    "seconds": (int(record.get("end_time_ms", 0)) - start) / 1000.0,
    "time_to_target": to_target, "test_accuracy": record.get("test_accuracy"),
    "evaluations": evals,
    "bytes_to_shards_per_step": link["bytes_to_shards"] / max(steps, 1),
    "bytes_from_shards_per_step": link["bytes_from_shards"] / max(steps, 1),
    "rate_mbit": link["rate_mbit"]}))
EOF
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
