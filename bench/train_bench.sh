#!/usr/bin/env bash
# Standalone training benchmark (issue #3): tessera-worker --standalone against PyTorch on the same
# model, batch and optimizer, measured in the same run, interleaved so that drift on a shared
# machine hits both alike.
#
#   bench/train_bench.sh                   # throughput, MLP and CNN, 1 and 2 threads
#   TTA=1 bench/train_bench.sh             # also time to accuracy: MLP to 0.883 (<= 15 epochs)
#   TTA=1 TTA_CNN=1 bench/train_bench.sh   # and the CNN to 0.916 (<= 10 epochs; slow on a CPU)
#
# Environment: BUILD_DIR (build), REPS (3, medians are reported), MLP_STEPS (600), CNN_STEPS
# (60), THREADS ("1 2"), DEVICE (cpu). PyTorch is Debian's python3-torch, a benchmark-only
# dependency: apt-get install -y python3-torch libopenblas0-pthread.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
WORKER=${WORKER:-$BUILD_DIR/bin/tessera-worker}
PY=${PY:-/usr/bin/python3}
REPS=${REPS:-3}
MLP_STEPS=${MLP_STEPS:-600}
CNN_STEPS=${CNN_STEPS:-60}
THREADS=${THREADS:-"1 2"}
DEVICE=${DEVICE:-cpu}
[[ -x $WORKER ]] || { echo "no $WORKER: build the tessera-worker target first" >&2; exit 1; }
$PY -c 'import torch' 2>/dev/null || { echo "$PY has no torch: apt-get install -y python3-torch libopenblas0-pthread" >&2; exit 1; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

json_field() { $PY -c 'import json,sys; print(json.loads(sys.stdin.readlines()[-1])[sys.argv[1]])' "$1"; }
median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }

# A throughput spec: the example with max_steps instead of epochs and no test split.
throughput_spec() {  # model steps
  sed -e "s/^epochs: .*/max_steps: $2/" -e '/test_images/d' -e '/test_labels/d' \
    "examples/fashion_$1.textproto" >"$tmp/$1_throughput.textproto"
  echo "$tmp/$1_throughput.textproto"
}

echo "# tessera-worker vs PyTorch $($PY -c 'import torch; print(torch.__version__)'), batch 64, Adam"
echo "# host: $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg), $(date -u +%FT%TZ)"
printf '%-5s %-8s %14s %14s %8s\n' model threads tessera_sps pytorch_sps ratio
declare -A best_t best_p
for model in mlp cnn; do
  steps=$MLP_STEPS
  [[ $model == cnn ]] && steps=$CNN_STEPS
  spec=$(throughput_spec $model "$steps")
  best_t[$model]=0
  best_p[$model]=0
  for threads in $THREADS; do
    ts="" ps=""
    for ((r = 0; r < REPS; r++)); do
      ts+=" $($WORKER --standalone --job "$spec" --device "$DEVICE" --threads "$threads" \
                --output json 2>/dev/null | json_field samples_per_second)"
      ps+=" $($PY bench/pytorch_reference.py --model $model --threads "$threads" \
                --steps "$steps" --warmup-steps 10 --device "$DEVICE" | json_field samples_per_second)"
    done
    t=$(echo "$ts" | median)
    p=$(echo "$ps" | median)
    printf '%-5s %-8s %14.0f %14.0f %8.2f\n' $model "$threads" "$t" "$p" "$(echo "$t / $p" | bc -l)"
    if (( $(echo "$t > ${best_t[$model]}" | bc -l) )); then best_t[$model]=$t; fi
    if (( $(echo "$p > ${best_p[$model]}" | bc -l) )); then best_p[$model]=$p; fi
  done
  printf '%-5s %-8s %14.0f %14.0f %8.2f\n' $model best "${best_t[$model]}" "${best_p[$model]}" \
    "$(echo "${best_t[$model]} / ${best_p[$model]}" | bc -l)"
done

tta() {  # model target max_epochs threads
  local out
  out=$($WORKER --standalone --job "examples/fashion_$1.textproto" --device "$DEVICE" \
          --threads "$4" --epochs "$3" --target_accuracy "$2" --output json 2>/dev/null)
  echo "$out" | $PY -c '
import json, sys
r = json.loads(sys.stdin.readlines()[-1]); target = float(sys.argv[1])
hit = next((h for h in r["history"] if h["test_accuracy"] is not None and h["test_accuracy"] >= target), None)
print("tessera  %s target %.3f: %s" % (sys.argv[2], target,
      "epoch %d, %.1f s training (%.1f s with evaluation), test accuracy %.4f" %
      (hit["epoch"], hit["train_seconds"], hit["elapsed_seconds"], hit["test_accuracy"]) if hit
      else "not reached in %d epochs (best %.4f)" % (r["epochs"], max(h["test_accuracy"] for h in r["history"]))))' "$2" "$1"
  out=$($PY bench/pytorch_reference.py --model "$1" --threads "$4" --epochs "$3" --target-accuracy "$2" --device "$DEVICE")
  echo "$out" | $PY -c '
import json, sys
r = json.loads(sys.stdin.readlines()[-1]); target = float(sys.argv[1])
hit = next((h for h in r["history"] if h["test_accuracy"] >= target), None)
print("pytorch  %s target %.3f: %s" % (sys.argv[2], target,
      "epoch %d, %.1f s training (%.1f s with evaluation), test accuracy %.4f" %
      (hit["epoch"], hit["train_seconds"], hit["elapsed_seconds"], hit["test_accuracy"]) if hit
      else "not reached in %d epochs (best %.4f)" % (r["epochs"], max(h["test_accuracy"] for h in r["history"]))))' "$2" "$1"
}

if [[ ${TTA:-0} == 1 ]]; then
  echo "# time to accuracy, 1 thread"
  tta mlp 0.883 15 1
  if [[ ${TTA_CNN:-0} == 1 ]]; then tta cnn 0.916 10 1; fi
fi
