# shellcheck shell=bash
# Shared by the network-namespace tests (netns_cluster_test.sh, partition_test.sh): the checks
# that decide between running and skipping, the test's own namespace names, and a cleanup that
# removes them with every process the test started, on every exit path. Source it after setting
# DATASET; then call netns_require, netns_setup and install nothing else on EXIT.
#
#   netns_require BIN_DIR TOOL...   skip (exit 77) unless root, `ip`, TOOL..., the dataset; fail
#                                   unless the four binaries are built; sets PYTHON
#   netns_setup PREFIX TMP_NAME     checks that a namespace can be made (skip otherwise), sets
#                                   SUFFIX, NS_BR, NS[1..4] (PREFIX + SUFFIX + br/h1..h4), T (a new
#                                   temporary directory with logs/), PIDS=(), KEEP, and the traps
#   in_ns H CMD...                  runs CMD in host H's namespace
# The cleanup prints the last LOG_TAIL lines (default 25) of every $T/logs/*.log on a failure and
# keeps $T when TESSERA_CLUSTER_KEEP=1.

skip() { echo "SKIP: $*"; exit 77; }
log() { echo "[$(date -u +%H:%M:%S)] $*"; }
fail() { echo "FAIL: $*"; exit 1; }
in_ns() { local h=$1; shift; ip netns exec "${NS[$h]}" "$@"; }

netns_require() {
  local bin=$1 tool f b
  shift
  [[ $(id -u) -eq 0 ]] || skip "needs root to create network namespaces (ip netns)"
  command -v ip >/dev/null || skip "no 'ip' command (Debian: apt-get install iproute2)"
  for tool in "$@"; do
    command -v "$tool" >/dev/null || skip "no $tool (Debian: apt-get install $tool)"
  done
  # shellcheck disable=SC2034  # used by the tests that source this
  PYTHON=$(command -v /usr/bin/python3 || command -v python3) || skip "no python3"
  for f in train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz \
           t10k-labels-idx1-ubyte.gz; do
    [[ -r $DATASET/$f ]] || skip "$DATASET/$f missing (Debian: apt-get install dataset-fashion-mnist)"
  done
  for b in tessera-coordinator tessera-server tessera-worker tessera; do
    [[ -x $bin/$b ]] || fail "$bin/$b is not built"
  done
}

netns_cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  local pid ns f
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  for _ in $(seq 1 50); do
    local alive=0
    for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [[ $alive -eq 0 ]] && break
    sleep 0.1
  done
  for pid in "${PIDS[@]}"; do kill -KILL "$pid" 2>/dev/null; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null; done
  for ns in "${NS[@]:1}" "$NS_BR"; do
    if ip netns list | grep -qw "$ns"; then
      # Anything still inside was started by this test (the namespaces are its own).
      for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null; done
      ip netns del "$ns" 2>/dev/null || echo "warning: could not delete namespace $ns"
    fi
  done
  if [[ $rc -ne 0 && $rc -ne 77 ]]; then
    for f in "$T"/logs/*.log; do
      [[ -f $f ]] || continue
      echo "----- last lines of $(basename "$f") -----"
      tail -n "${LOG_TAIL:-25}" "$f"
    done
  fi
  if [[ $KEEP == 1 ]]; then echo "kept $T"; else rm -rf "$T"; fi
  exit $rc
}

netns_setup() {
  local prefix=$1 tmp_name=$2 probe
  SUFFIX=$(od -An -N3 -tx1 /dev/urandom | tr -d ' \n')
  probe=${prefix}probe$SUFFIX
  if ! ip netns add "$probe" 2>/dev/null; then
    skip "cannot create a network namespace here ('ip netns add' failed: not permitted in this container?)"
  fi
  ip netns del "$probe"
  NS_BR=${prefix}${SUFFIX}br
  NS=(unused "${prefix}${SUFFIX}h1" "${prefix}${SUFFIX}h2" "${prefix}${SUFFIX}h3" "${prefix}${SUFFIX}h4")
  T=$(mktemp -d "/tmp/$tmp_name.XXXXXX") || exit 1
  mkdir -p "$T/logs"
  PIDS=()
  KEEP=${TESSERA_CLUSTER_KEEP:-0}
  trap netns_cleanup EXIT
  trap 'exit 1' INT TERM
}
