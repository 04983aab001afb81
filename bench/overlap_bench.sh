#!/usr/bin/env bash
# Before/after a change to the worker's step (issue #17's overlap): the same job trained by two
# builds of Tessera, alternating in each round, so both see the same load on this shared machine.
# 2 workers (1 thread each) and 2 shards, BSP, on `tessera local`, or, with RATE_MBIT > 0, behind
# an emulated link of RATE_MBIT per direction per shard (build/bin/slow_link_benchmark).
#
#   BEFORE_BUILD=/work/before/build bench/overlap_bench.sh            # MODEL=mlp, loopback
#   MODEL=cnn STEPS=60 RATE_MBIT=1000 ROUNDS=3 BEFORE_BUILD=... bench/overlap_bench.sh
#
# MODEL mlp: examples/fashion_mlp.textproto for EPOCHS (2) epochs; cnn: examples/fashion_cnn
# .textproto for STEPS (100) steps. BEFORE_BUILD names the other build folder (it needs
# bin/tessera, tessera-coordinator, tessera-server, tessera-worker, and slow_link_benchmark for a
# link); BUILD_DIR (build) is this one. Prints one JSON line per run (bench/local_run_summary.py)
# and a Markdown table of samples per second, the final test accuracy and rank 0's mean seconds
# per step in compute, exchange (waiting for weights: after backward, and inside the next forward
# pass once it overlaps), install and data, and, where the build reports them, the round trip of
# each step's last-answered request and how much of it waited at the shards' gate.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
BEFORE_BUILD=${BEFORE_BUILD:?set BEFORE_BUILD to the build folder to compare against}
MODEL=${MODEL:-mlp}
EPOCHS=${EPOCHS:-2}
STEPS=${STEPS:-100}
ROUNDS=${ROUNDS:-3}
RATE_MBIT=${RATE_MBIT:-0}
PY=/usr/bin/python3
OUT=${OUT:-$(mktemp -d /tmp/tessera-overlap.XXXXXX)}
mkdir -p "$OUT"
export OMP_WAIT_POLICY=passive

spec="$OUT/spec.textproto"
case "$MODEL" in
  mlp) sed -e "s/^epochs: .*/epochs: $EPOCHS/" examples/fashion_mlp.textproto > "$spec" ;;
  cnn)
    sed -e 's/^epochs: .*/epochs: 1/' examples/fashion_cnn.textproto > "$spec"
    echo "max_steps: $STEPS" >> "$spec"
    ;;
  *) echo "MODEL must be mlp or cnn, got $MODEL" >&2; exit 64 ;;
esac
grep -q '^num_workers:' "$spec" || echo "num_workers: 2" >> "$spec"
grep -q '^consistency:' "$spec" || echo 'consistency: "bsp"' >> "$spec"

for dir in "$BUILD_DIR" "$BEFORE_BUILD"; do
  tool=tessera; [ "$RATE_MBIT" = 0 ] || tool=slow_link_benchmark
  [ -x "$dir/bin/$tool" ] || { echo "build first: $dir/bin/$tool is missing" >&2; exit 64; }
done

results="$OUT/results.jsonl"
: > "$results"
for round in $(seq 1 "$ROUNDS"); do
  for build in before after; do
    dir=$BUILD_DIR; [ "$build" = before ] && dir=$BEFORE_BUILD
    log="$OUT/$build-$round.out"
    echo "round $round: $build ($dir), $MODEL, link ${RATE_MBIT} Mbit/s (0: loopback)" >&2
    if [ "$RATE_MBIT" = 0 ]; then
      "$dir/bin/tessera" local --job "$spec" --shards 2 --workers 2 --threads 1 --output json \
        > "$log" 2> "$OUT/$build-$round.err"
    else
      "$dir/bin/slow_link_benchmark" --job "$spec" --shards 2 --workers 2 --threads 1 \
        --rate_mbit "$RATE_MBIT" --output json > "$log" 2> "$OUT/$build-$round.err"
    fi
    "$PY" bench/local_run_summary.py "$log" --target 0.85 --workers 2 --label "build=$build" \
      --label "round=$round" --label "model=$MODEL" --label "rate_mbit=$RATE_MBIT" | tee -a "$results"
  done
done

"$PY" - "$results" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print()
print("| round | build | samples/s | after / before | final test acc | compute | exchange | install | data | last request: round trip | of it at the gate |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
def ms(st, key):
    return f"{st[key]*1e3:.2f} ms" if key in st else "n/a"

before = {r["round"]: r for r in rows if r["build"] == "before"}
for r in rows:
    st = r["step_times"]
    ratio = r["samples_per_second"] / before[r["round"]]["samples_per_second"]
    print(f"| {r['round']} | {r['build']} | {r['samples_per_second']:.0f} | "
          f"{ratio if r['build'] == 'after' else 1:.3f} | {r['test_accuracy']:.4f} | "
          f"{ms(st, 'compute')} | {ms(st, 'exchange')} | {ms(st, 'install')} | {ms(st, 'data')} | "
          f"{ms(st, 'round_trip')} | {ms(st, 'gate_wait')} |")
EOF
