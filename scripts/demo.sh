#!/usr/bin/env bash
# The one-command demo: installs the Debian packages, builds, and trains the Fashion-MNIST MLP
# for 2 epochs on a whole Tessera cluster on this machine (`tessera local`: a coordinator,
# 2 parameter shards and 2 workers as child processes on loopback ports picked at run time),
# then exports the model to safetensors, scores it independently with numpy, and prints the
# final test accuracy. Run as root on Debian 12 (or with sudo available).
#
#   scripts/demo.sh
#   TESSERA_BUILD_DIR=build-demo scripts/demo.sh   # another build directory (default build)
#
# Exit status: tessera local's (0 when the job SUCCEEDED).
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR=${TESSERA_BUILD_DIR:-${BUILD_DIR:-build}}
JOB=examples/fashion_mlp_2epochs.textproto
MODEL="$BUILD_DIR/fashion_mlp.safetensors"
DATA=/usr/share/datasets/fashion-mnist

echo "== demo: installing dependencies (scripts/install-deps.sh)"
scripts/install-deps.sh
# The four binaries `tessera local` runs; scripts/test.sh builds the rest in the same directory.
echo "== demo: building the binaries into $BUILD_DIR (scripts/build.sh)"
BUILD_DIR="$BUILD_DIR" BUILD_TARGETS="tessera tessera-coordinator tessera-server tessera-worker" \
  scripts/build.sh
export OMP_WAIT_POLICY=passive

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

scored=$("$PY" tests/e2e/score_safetensors.py --model "$MODEL" \
  --images "$DATA/t10k-images-idx3-ubyte.gz" --labels "$DATA/t10k-labels-idx1-ubyte.gz" |
  sed -n 's/.*"accuracy": \([0-9.]*\).*/\1/p')

echo "== demo: job $(field id) SUCCEEDED in ${seconds}s: $(field steps) steps, $(field epochs) epochs," \
  "$(printf '%.0f' "$(field samples_per_second)") samples/s"
echo "== demo: model written to $MODEL (numpy reads it back and scores ${scored:-?})"
echo "== demo: final test accuracy $accuracy"
