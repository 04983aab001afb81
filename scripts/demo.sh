#!/usr/bin/env bash
# The one-command demo: installs the Debian packages, builds, and trains the Fashion-MNIST MLP
# for 2 epochs on a whole Tessera cluster on this machine (`tessera local`: a coordinator,
# 2 parameter shards and 2 workers as child processes on loopback ports picked at run time),
# then exports the model to safetensors, scores it independently with numpy, and prints the
# final test accuracy. Run as root on Debian 12 (or with sudo available).
#
# `scripts/demo.sh criteo` is the sparse demo instead: it generates 10^6 Criteo-format click-log
# rows from a planted model (`tessera datagen criteo`, into /var/tmp/tessera-criteo), trains
# examples/criteo_hashed.textproto (a hashed embedding table on the shards) the same way, scores
# the export with numpy, and prints the test AUC and log loss beside the planted model's best.
# `scripts/demo.sh dlrm` does the same with examples/criteo_dlrm.textproto (DLRM: a bottom MLP on
# the 13 counts, an embedding per categorical field, their pairwise dot products, a top MLP).
#
#   scripts/demo.sh
#   scripts/demo.sh criteo
#   scripts/demo.sh dlrm
#   TESSERA_BUILD_DIR=build-demo scripts/demo.sh   # another build directory (default build)
#
# Exit status: tessera local's (0 when the job SUCCEEDED).
set -euo pipefail
cd "$(dirname "$0")/.."

MODE=${1:-fashion}
case "$MODE" in
  fashion | criteo | dlrm) ;;
  *)
    echo "usage: scripts/demo.sh [criteo | dlrm]" >&2
    exit 64
    ;;
esac
BUILD_DIR=${TESSERA_BUILD_DIR:-${BUILD_DIR:-build}}
JOB=examples/fashion_mlp_2epochs.textproto
MODEL="$BUILD_DIR/fashion_mlp.safetensors"
DATA=/usr/share/datasets/fashion-mnist
if [ "$MODE" = criteo ]; then
  JOB=examples/criteo_hashed.textproto
  MODEL="$BUILD_DIR/criteo_hashed.safetensors"
elif [ "$MODE" = dlrm ]; then
  JOB=examples/criteo_dlrm.textproto
  MODEL="$BUILD_DIR/criteo_dlrm.safetensors"
fi
CTR=false
if [ "$MODE" != fashion ]; then
  CTR=true
  DATA=/var/tmp/tessera-criteo  # the examples' dataset paths
fi

echo "== demo: installing dependencies (scripts/install-deps.sh)"
scripts/install-deps.sh
# The four binaries `tessera local` runs; scripts/test.sh builds the rest in the same directory.
echo "== demo: building the binaries into $BUILD_DIR (scripts/build.sh)"
BUILD_DIR="$BUILD_DIR" BUILD_TARGETS="tessera tessera-coordinator tessera-server tessera-worker" \
  scripts/build.sh
export OMP_WAIT_POLICY=passive

if $CTR; then
  echo "== demo: $BUILD_DIR/bin/tessera datagen criteo --rows 1000000 --out $DATA"
  "$BUILD_DIR/bin/tessera" datagen criteo --rows 1000000 --out "$DATA"
fi

echo "== demo: $BUILD_DIR/bin/tessera local --job $JOB --shards 2 --workers 2 --out $MODEL"
start=$(date +%s)
set +e
# Progress goes to stderr (a bar on a terminal); stdout ends with the job record as JSON.
record=$("$BUILD_DIR/bin/tessera" local --job "$JOB" --shards 2 --workers 2 --out "$MODEL" \
  --output json | tail -n 1)
status=$?
set -e
seconds=$(($(date +%s) - start))

PY=python3
[ -x /usr/bin/python3 ] && PY=/usr/bin/python3
field() { "$PY" -c 'import json, sys; print(json.loads(sys.argv[1]).get(sys.argv[2], ""))' "$record" "$1" 2>/dev/null || true; }
state=$(field state_name)
accuracy=$(field test_accuracy)
if [ "$status" -ne 0 ] || [ "$state" != SUCCEEDED ]; then
  echo "== demo: the job did not succeed (state ${state:-unknown}, exit status $status)" >&2
  [ "$status" -ne 0 ] || status=1
  exit "$status"
fi

if $CTR; then
  scored=$("$PY" tests/e2e/score_criteo.py --model "$MODEL" --data "$DATA/test.tsv" |
    sed -n 's/.*"auc": \([0-9.]*\).*/\1/p')
  planted() { "$PY" -c 'import json, sys; print(round(json.load(open(sys.argv[1]))[sys.argv[2]], 4))' "$DATA/planted.json" "$1"; }
  echo "== demo: job $(field id) SUCCEEDED in ${seconds}s: $(field steps) steps," \
    "$(printf '%.0f' "$(field samples_per_second)") samples/s"
  echo "== demo: model written to $MODEL (numpy reads it back: test AUC ${scored:-?})"
  echo "== demo: test AUC $(printf '%.4f' "$(field test_auc)"), log loss $(printf '%.4f' "$(field test_loss)");" \
    "the planted model's best: AUC $(planted best_test_auc), log loss $(planted best_test_log_loss)"
  exit 0
fi

scored=$("$PY" tests/e2e/score_safetensors.py --model "$MODEL" \
  --images "$DATA/t10k-images-idx3-ubyte.gz" --labels "$DATA/t10k-labels-idx1-ubyte.gz" |
  sed -n 's/.*"accuracy": \([0-9.]*\).*/\1/p')

echo "== demo: job $(field id) SUCCEEDED in ${seconds}s: $(field steps) steps, $(field epochs) epochs," \
  "$(printf '%.0f' "$(field samples_per_second)") samples/s"
echo "== demo: model written to $MODEL (numpy reads it back and scores ${scored:-?})"
echo "== demo: final test accuracy $accuracy"
