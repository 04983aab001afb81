#!/usr/bin/env bash
# End-to-end training benchmark (issue #4): Tessera against a PyTorch parameter server, same run.
#
# Tessera: `tessera local` (a coordinator, S shards, 2 worker daemons on this machine) trains the
# Fashion-MNIST MLP of examples/fashion_mlp.textproto (batch 64 per worker, Adam lr 1e-3) for
# EPOCHS epochs, with S = 1 and 2 shards, in BSP and ASP. PyTorch: bench/pytorch_rpc_ps.py, the
# batch-updating parameter server of PyTorch's RPC tutorial (1 server, 2 trainers, the same model,
# batch, optimizer and data split), and bench/pytorch_ddp.py, DistributedDataParallel over gloo
# (2 processes, what a user would pick instead on one host), both on Debian's python3-torch with
# OpenBLAS (libopenblas0-pthread; on Debian's reference BLAS PyTorch is 3-4x slower and every ratio
# flatters Tessera). Each round runs every Tessera configuration and then both PyTorch references,
# and ratios are taken within a round, because the machine is shared and all must see the same
# load.
#
#   bench/e2e_bench.sh                  # EPOCHS=4 ROUNDS=1 BUILD_DIR=build
#   EPOCHS=4 ROUNDS=2 bench/e2e_bench.sh
#   PARTITION_BYTES=262144 bench/e2e_bench.sh   # the spec's partition_bytes (default 4 MiB)
#   MODES=bsp SHARDS=2 bench/e2e_bench.sh       # only some Tessera configurations
#   MODEL=cnn STEPS=150 MODES=bsp bench/e2e_bench.sh   # examples/fashion_cnn.textproto, 150 steps
#
# Prints one JSON line per run and a Markdown table: samples per second (training, all workers),
# the ratios to the PyTorch parameter server's and to DDP's, seconds from the job's start to the
# first evaluation at or above 0.85 test accuracy (evaluations run at every epoch end), the final test accuracy, and rank 0's mean
# seconds per step in compute, exchange (waiting for fresh weights: push, gate wait and pull), install,
# data.
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR=${BUILD_DIR:-build}
EPOCHS=${EPOCHS:-4}
ROUNDS=${ROUNDS:-1}
TARGET=${TARGET:-0.85}
PY=/usr/bin/python3
OUT=${OUT:-$(mktemp -d /tmp/tessera-e2e-bench.XXXXXX)}
mkdir -p "$OUT"
export OMP_WAIT_POLICY=passive

[ -x "$BUILD_DIR/bin/tessera" ] || { echo "build first: $BUILD_DIR/bin/tessera is missing" >&2; exit 64; }
"$PY" -c 'import torch.distributed.rpc' 2>/dev/null ||
  { echo "needs Debian's python3-torch (apt-get install python3-torch)" >&2; exit 69; }
# Debian's torch calls whichever libblas.so.3 is installed; its build config does not say which.
if ! "$PY" -c 'import torch, sys; sys.exit(not any("openblas" in l for l in open("/proc/self/maps")))' \
    2>/dev/null; then
  echo "warning: PyTorch is not on OpenBLAS (apt-get install libopenblas0-pthread):" \
    "the references run several times slower than they should" >&2
fi
MODES=${MODES:-bsp asp}
SHARDS=${SHARDS:-1 2}
MODEL=${MODEL:-mlp}
STEPS=${STEPS:-150}
case "$MODEL" in
  mlp) example=examples/fashion_mlp.textproto; limit=() ;;
  # The CNN trains for STEPS steps per worker of its first epoch on every side (EPOCHS is
  # ignored; an epoch is 468 steps per worker).
  cnn) example=examples/fashion_cnn.textproto; EPOCHS=1; limit=(--max-steps "$STEPS") ;;
  *) echo "MODEL must be mlp or cnn, got $MODEL" >&2; exit 64 ;;
esac

spec() {  # spec MODE FILE: the example model with EPOCHS epochs (cnn: STEPS steps) in MODE
  sed -e "s/^epochs: .*/epochs: $EPOCHS/" -e "s/^consistency: .*/consistency: \"$1\"/" \
    "$example" > "$2"
  if [ "$MODEL" = cnn ]; then echo "max_steps: $STEPS" >> "$2"; fi
  grep -q '^consistency:' "$2" || echo "consistency: \"$1\"" >> "$2"
  grep -q '^num_workers:' "$2" || echo "num_workers: 2" >> "$2"
  if [ -n "${PARTITION_BYTES:-}" ]; then echo "partition_bytes: $PARTITION_BYTES" >> "$2"; fi
  printf 'eval { every_epochs: 1 }\n' >> "$2"
}

reference() {  # reference SCRIPT ROUND: one PyTorch reference run, its JSON line tagged with ROUND
  "$PY" "bench/$1.py" --epochs "$EPOCHS" --trainers 2 --target "$TARGET" --model "$MODEL" \
    ${limit[@]+"${limit[@]}"} 2> "$OUT/$1-$2.err" |
    tail -n 1 |
    "$PY" -c 'import json,sys; d=json.loads(sys.stdin.read()); d["round"]='"$2"'; print(json.dumps(d))' |
    tee -a "$results"
}

summarise_tessera() {  # summarise_tessera OUTPUT_FILE MODE SHARDS ROUND
  "$PY" bench/local_run_summary.py "$1" --target "$TARGET" --workers 2 --label system=tessera \
    --label "round=$4" --label "mode=$2" --label "shards=$3" --label workers=2
}

results="$OUT/results.jsonl"
: > "$results"
for round in $(seq 1 "$ROUNDS"); do
  for mode in $MODES; do
    for shards in $SHARDS; do
      spec "$mode" "$OUT/spec-$mode.textproto"
      log="$OUT/tessera-$round-$mode-$shards.out"
      echo "round $round: tessera $mode, $shards shard(s), 2 workers, $EPOCHS epochs" >&2
      "$BUILD_DIR/bin/tessera" local --job "$OUT/spec-$mode.textproto" --shards "$shards" \
        --workers 2 --threads 1 --output json > "$log" 2> "$OUT/tessera-$round-$mode-$shards.err"
      summarise_tessera "$log" "$mode" "$shards" "$round" | tee -a "$results"
    done
  done
  echo "round $round: pytorch rpc parameter server, 2 trainers, $EPOCHS epochs" >&2
  reference pytorch_rpc_ps "$round"
  echo "round $round: pytorch distributeddataparallel (gloo), 2 processes, $EPOCHS epochs" >&2
  reference pytorch_ddp "$round"
done

"$PY" - "$results" "$TARGET" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
target = sys.argv[2]
torch = {r["round"]: r for r in rows if r.get("system") == "pytorch-rpc-ps"}
ddp = {r["round"]: r for r in rows if r.get("system") == "pytorch-ddp"}
def f(x, fmt):
    return "n/a" if x is None else fmt.format(x)
print()
print(f"| round | system | mode | shards | samples/s | ratio to PyTorch PS | ratio to DDP | s to {target} | final test acc | compute | exchange | install | data |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    if r.get("system") == "tessera":
        t = torch[r["round"]]
        d = ddp[r["round"]]
        st = r["step_times"]
        print(f"| {r['round']} | Tessera | {r['mode'].upper()} | {r['shards']} | {r['samples_per_second']:.0f} | "
              f"{r['samples_per_second'] / t['samples_per_second']:.2f} | "
              f"{r['samples_per_second'] / d['samples_per_second']:.2f} | {f(r['time_to_target'], '{:.1f}')} | "
              f"{r['test_accuracy']:.4f} | {st['compute']*1e3:.2f} ms | {st['exchange']*1e3:.2f} ms | "
              f"{st['install']*1e3:.2f} ms | {st['data']*1e3:.2f} ms |")
for r in torch.values():
    d = ddp[r["round"]]
    print(f"| {r['round']} | PyTorch RPC PS | BSP | 1 | {r['samples_per_second']:.0f} | 1.00 | "
          f"{r['samples_per_second'] / d['samples_per_second']:.2f} | "
          f"{f(r['time_to_target'], '{:.1f}')} | {r['test_accuracy']:.4f} | {r['compute_per_step']*1e3:.2f} ms | "
          f"{r['rpc_per_step']*1e3:.2f} ms (rpc) | | |")
for r in ddp.values():
    t = torch[r["round"]]
    print(f"| {r['round']} | PyTorch DDP | BSP | - | {r['samples_per_second']:.0f} | "
          f"{r['samples_per_second'] / t['samples_per_second']:.2f} | 1.00 | "
          f"{f(r['time_to_target'], '{:.1f}')} | {r['test_accuracy']:.4f} | {r['compute_per_step']*1e3:.2f} ms | "
          f"(in backward) | | |")
EOF
echo "raw results and logs: $OUT" >&2
