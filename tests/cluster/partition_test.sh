#!/bin/bash
# Network partition between the workers and the shards (issue #6, test 6), in network namespaces
# made by this test. Four hosts, two bridges: a control network (10.214.0.0/24: the coordinator,
# registrations, heartbeats, tasks and progress) and a data network (10.215.0.0/24: the workers'
# PushPull to the shards, and the coordinator's checkpoint calls to the shards).
#
#   host1  coordinator            ctl 10.214.0.1  data 10.215.0.1
#   host2  tessera-server 0       ctl 10.214.0.2  data 10.215.0.2
#   host3  tessera-server 1       ctl 10.214.0.3  data 10.215.0.3
#   host4  tessera-worker x 2     ctl 10.214.0.4  data 10.215.0.4
#
# A 2-worker BSP job (Fashion-MNIST MLP, seed 1, checkpoints every 50 steps) starts; once it is
# past step 100, host4's data link is taken down for PARTITION_SECONDS (default 30): the workers
# cannot reach either shard, while the coordinator still sees every daemon. Then the link comes
# back. The job must end SUCCEEDED with every step done; the test prints the step at the cut, the
# seconds from the heal to the next step, how the job got through (client retries alone, or a
# rewind to a checkpoint), and the shards' count of duplicate pushes they acknowledged without
# applying (exactly-once; the exact weight arithmetic under faults is tests/faults/).
#
# Usage: partition_test.sh SOURCE_DIR BIN_DIR
# Exit status: 0 pass, 1 fail, 77 skipped (not root, no `ip netns`, no dataset).
# The namespaces have a random suffix and are removed on every exit path, with every process the
# test started. Nothing is added to the host's own network namespace.
set -u -o pipefail

SRC=${1:?usage: $0 SOURCE_DIR BIN_DIR}
BIN=${2:?usage: $0 SOURCE_DIR BIN_DIR}
SRC=$(cd "$SRC" && pwd) || exit 1
BIN=$(cd "$BIN" && pwd) || exit 1
# shellcheck disable=SC2034  # DATASET and LOG_TAIL are read by netns_lib.sh
DATASET=/usr/share/datasets/fashion-mnist
PARTITION_SECONDS=${PARTITION_SECONDS:-30}
DEADLINE=$((SECONDS + 280))   # the whole test, below the ctest timeout of 300 s

# shellcheck source=netns_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/netns_lib.sh"
netns_require "$BIN"
# shellcheck disable=SC2034
LOG_TAIL=30
netns_setup tsp tessera-partition

# --- Two bridges, four hosts -------------------------------------------------------------------
log "namespaces ${NS[*]:1} and $NS_BR"
ip netns add "$NS_BR" || fail "ip netns add $NS_BR"
for br in ctl data; do
  ip -n "$NS_BR" link add "$br" type bridge || fail "bridge $br"
  ip -n "$NS_BR" link set "$br" up || fail "bridge $br up"
done
for h in 1 2 3 4; do
  ip netns add "${NS[$h]}" || fail "ip netns add ${NS[$h]}"
  ip -n "${NS[$h]}" link set lo up || fail "lo up on host$h"
  ip -n "$NS_BR" link add "c$h" type veth peer name ctl0 netns "${NS[$h]}" || fail "veth c$h"
  ip -n "$NS_BR" link set "c$h" master ctl up || fail "attach c$h"
  ip -n "${NS[$h]}" addr add "10.214.0.$h/24" dev ctl0 || fail "ctl address host$h"
  ip -n "${NS[$h]}" link set ctl0 up || fail "ctl0 up on host$h"
  ip -n "$NS_BR" link add "d$h" type veth peer name data0 netns "${NS[$h]}" || fail "veth d$h"
  ip -n "$NS_BR" link set "d$h" master data up || fail "attach d$h"
  ip -n "${NS[$h]}" addr add "10.215.0.$h/24" dev data0 || fail "data address host$h"
  ip -n "${NS[$h]}" link set data0 up || fail "data0 up on host$h"
done
carrier() {  # carrier H DEV
  for _ in $(seq 1 50); do
    ip -n "${NS[$1]}" link show "$2" | grep -q 'LOWER_UP' && return 0
    sleep 0.1
  done
  return 1
}
for h in 1 2 3 4; do
  carrier "$h" ctl0 || fail "host$h's ctl0 has no carrier"
  carrier "$h" data0 || fail "host$h's data0 has no carrier"
done

# --- Daemons (plaintext: these are the test's own private networks, hence --insecure) ----------
start() {  # start H NAME CMD...
  local h=$1 name=$2
  shift 2
  in_ns "$h" "$@" >"$T/logs/$name.log" 2>&1 &
  PIDS+=($!)
}
wait_file() {  # wait_file PATH SECONDS
  for _ in $(seq 1 $(($2 * 10))); do [[ -s $1 ]] && return 0; sleep 0.1; done
  return 1
}
COORD=10.214.0.1:7070
mkdir -p "$T/coordinator" "$T/shard0" "$T/shard1"
start 1 coordinator "$BIN/tessera-coordinator" --listen "$COORD" --port_file "$T/coordinator.port" \
  --data_dir "$T/coordinator" --num_shards 2 --lease_seconds 10 --heartbeat_seconds 2 --insecure
wait_file "$T/coordinator.port" 30 || fail "the coordinator did not start"
for i in 0 1; do
  h=$((i + 2))
  start "$h" "shard$i" "$BIN/tessera-server" --listen 0.0.0.0:7000 --port_file "$T/shard$i.port" \
    --advertise_address "10.215.0.$h:7000" --shard_index "$i" --coordinator "$COORD" \
    --data_dir "$T/shard$i" --metrics_listen 0.0.0.0:9471 --metrics_insecure --insecure
  wait_file "$T/shard$i.port" 30 || fail "shard $i did not start"
done
for i in 0 1; do
  start 4 "worker$i" "$BIN/tessera-worker" --coordinator "$COORD" --threads 1 --insecure
done

tessera() { local sub=$1; shift; in_ns 1 "$BIN/tessera" "$sub" --coordinator "$COORD" "$@"; }
# job FIELD: one field of the job's JSON record (`tessera get --output json`).
job_field() {
  tessera get "$JOB" --output json 2>/dev/null | "$PYTHON" -c "
import json, sys
j = json.loads(sys.stdin.read().strip().splitlines()[-1])
print(j.get('$1', 0))" 2>/dev/null
}

ok=0
for _ in $(seq 1 300); do
  if tessera cluster 2>/dev/null | grep -c 'READY' | grep -q '^4$'; then ok=1; break; fi
  sleep 0.2
done
[[ $ok -eq 1 ]] || { tessera cluster; fail "2 shards and 2 workers did not become READY"; }

# --- The job -----------------------------------------------------------------------------------
sed -e 's/^name: .*/name: "partition"/' "$SRC/examples/fashion_mlp_2epochs.textproto" >"$T/job.textproto"
echo "checkpoint_every_steps: 50" >>"$T/job.textproto"
JOB=$(tessera submit "$T/job.textproto") || fail "submit"
JOB=$(echo "$JOB" | tail -n 1 | tr -d '[:space:]')
log "job $JOB submitted"
step=0
for _ in $(seq 1 600); do
  step=$(job_field step)
  [[ ${step:-0} -ge 100 ]] && break
  state=$(job_field state)
  [[ $state == JOB_STATE_RUNNING || $state == JOB_STATE_PENDING ]] || fail "job is $state before the cut"
  sleep 0.1
done
[[ ${step:-0} -ge 100 ]] || fail "the job did not reach step 100"

# --- The partition -----------------------------------------------------------------------------
ip -n "${NS[4]}" link set data0 down || fail "link down"
cut_step=$(job_field step)
log "host4's data link DOWN at step $cut_step for $PARTITION_SECONDS s"
sleep "$PARTITION_SECONDS"
stalled_step=$(job_field step)
ip -n "${NS[4]}" link set data0 up || fail "link up"
heal=$SECONDS
heal_ns=$(date +%s%N)
log "link UP again (step $stalled_step)"
carrier 4 data0 || fail "data0 has no carrier after the heal"

resumed_ms=-1
for _ in $(seq 1 1200); do
  now_step=$(job_field step)
  if [[ $resumed_ms -lt 0 && ${now_step:-0} -gt ${stalled_step:-0} ]]; then
    resumed_ms=$((($(date +%s%N) - heal_ns) / 1000000))
  fi
  state=$(job_field state)
  [[ $state == JOB_STATE_SUCCEEDED || $state == JOB_STATE_FAILED || $state == JOB_STATE_CANCELLED ]] && break
  [[ $SECONDS -lt $DEADLINE ]] || break
  sleep 0.1
done
tessera get "$JOB" >"$T/logs/job.txt" 2>&1
[[ $state == JOB_STATE_SUCCEEDED ]] || { cat "$T/logs/job.txt"; fail "job ended $state"; }
total=$(job_field total_steps)
final=$(job_field step)
recoveries=$(job_field recoveries)
accuracy=$(job_field test_accuracy)
[[ $final -eq $total ]] || fail "job ended at step $final of $total"
# The shards' exactly-once counter, scraped across the data network from host1.
dups=0
for h in 2 3; do
  n=$(in_ns 1 "$PYTHON" -c "
import urllib.request
text = urllib.request.urlopen('http://10.215.0.$h:9471/metrics', timeout=5).read().decode()
print(int(sum(float(l.split()[-1]) for l in text.splitlines()
              if l.startswith('tessera_shard_duplicate_pushes_total'))))" 2>/dev/null) || n=0
  dups=$((dups + ${n:-0}))
done
echo "partition: data link down ${PARTITION_SECONDS} s at step $cut_step (step $stalled_step when it healed); next step $((resumed_ms)) ms after the heal (progress reports every 0.5 s); ${recoveries:-0} rewinds to a checkpoint; $dups duplicate pushes acknowledged without applying; SUCCEEDED at step $final of $total, test accuracy $accuracy"
[[ $resumed_ms -ge 0 ]] || fail "training did not resume after the heal"
"$PYTHON" -c "import sys; sys.exit(0 if float('$accuracy') > 0.8 else 1)" || fail "accuracy $accuracy"
log "PASS"
