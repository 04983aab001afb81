#!/bin/bash
# Multi-host test (issue #5): four network namespaces act as four hosts on one bridge, and the
# daemons run as the systemd units in deploy/systemd/ would run them, with TLS and tokens on.
#
#   host1 10.213.0.1  tessera-coordinator.service + tessera-server@0.service
#   host2 10.213.0.2  tessera-server@1.service
#   host3 10.213.0.3  tessera-worker@0.service
#   host4 10.213.0.4  tessera-worker@0.service
#
# Each daemon's command line is the unit file's ExecStart= line, read from the file, with only
# %i, /usr/bin (the build's binaries), /etc/tessera and /var/lib/tessera (the host's own directory
# under the test's temporary directory) replaced. Its environment is what systemd would give it:
# the unit's Environment= and EnvironmentFile= values (files read in order, `-` ones optional), and
# NOTIFY_SOCKET pointing at a datagram socket this test reads: the test waits for READY=1 as
# systemd does for Type=notify. The configuration files are the examples in deploy/config/ with
# the same paths replaced; each host's *.env file sets its addresses. A PKI (CA, one certificate per
# host, one for the CLI) and a token are made with openssl.
#
# Then, from host1's namespace, the `tessera` CLI (mutual TLS + token) waits for 2 shards and 2
# workers, checks that calls without the token, without TLS, and with a certificate from another CA
# are refused, trains the Fashion-MNIST MLP for 1 epoch across the hosts to SUCCEEDED, and host3
# scrapes host1's metrics. Finally every daemon gets SIGTERM and must exit 0.
#
# Usage: netns_cluster_test.sh SOURCE_DIR BIN_DIR
# Exit status: 0 pass, 1 fail, 77 skipped (not root, no `ip netns`, no openssl, no dataset).
# The namespaces have a random suffix and are removed on every exit path (trap), with every process
# the test started. Nothing is added to the host's own network namespace.
set -u -o pipefail

SRC=${1:?usage: $0 SOURCE_DIR BIN_DIR}
BIN=${2:?usage: $0 SOURCE_DIR BIN_DIR}
SRC=$(cd "$SRC" && pwd) || exit 1
BIN=$(cd "$BIN" && pwd) || exit 1
UNITS=$SRC/deploy/systemd
CONFIGS=$SRC/deploy/config
DATASET=/usr/share/datasets/fashion-mnist
DEADLINE=$((SECONDS + 270))   # the whole test, below the ctest timeout of 300 s

# shellcheck source=netns_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/netns_lib.sh"
netns_require "$BIN" openssl
netns_setup tsr tessera-cluster
DAEMONS=()   # "name pid" of each daemon
remaining() { echo $((DEADLINE - SECONDS)); }

# --- Four hosts on one bridge, all inside the test's own namespaces ----------------------------
log "namespaces ${NS[*]:1} and $NS_BR"
ip netns add "$NS_BR" || fail "ip netns add $NS_BR"
ip -n "$NS_BR" link add br0 type bridge || fail "bridge"
ip -n "$NS_BR" link set br0 up || fail "bridge up"
for h in 1 2 3 4; do
  ip netns add "${NS[$h]}" || fail "ip netns add ${NS[$h]}"
  # The veth pair is made inside the bridge namespace; its peer goes straight to the host's.
  ip -n "$NS_BR" link add "h$h" type veth peer name eth0 netns "${NS[$h]}" || fail "veth h$h"
  ip -n "$NS_BR" link set "h$h" master br0 up || fail "attach h$h"
  ip -n "${NS[$h]}" addr add "10.213.0.$h/24" dev eth0 || fail "address host$h"
  ip -n "${NS[$h]}" link set eth0 up || fail "eth0 up on host$h"
  ip -n "${NS[$h]}" link set lo up || fail "lo up on host$h"
done
# Links come up asynchronously (no ping in a minimal image: the links' carrier is the check; the
# daemons' registrations below prove the hosts reach each other).
for h in 1 2 3 4; do
  ok=0
  for _ in $(seq 1 50); do
    if ip -n "${NS[$h]}" link show eth0 | grep -q 'LOWER_UP'; then ok=1; break; fi
    sleep 0.1
  done
  [[ $ok -eq 1 ]] || fail "host$h's eth0 has no carrier"
done

# --- PKI and token -----------------------------------------------------------------------------
PKI=$T/pki
mkdir -p "$PKI" "$T/logs" "$T/notify"
log "PKI in $PKI"
make_ca() {  # make_ca NAME
  openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=$1" \
    -keyout "$PKI/$1.key" -out "$PKI/$1.crt" >/dev/null 2>&1 || fail "openssl: CA $1"
}
make_cert() {  # make_cert CA NAME SAN
  openssl req -newkey rsa:2048 -nodes -subj "/CN=$2" -keyout "$PKI/$2.key" -out "$PKI/$2.csr" \
    >/dev/null 2>&1 || fail "openssl: request $2"
  printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n' \
    "$3" >"$PKI/$2.ext"
  openssl x509 -req -in "$PKI/$2.csr" -CA "$PKI/$1.crt" -CAkey "$PKI/$1.key" -CAcreateserial \
    -days 2 -extfile "$PKI/$2.ext" -out "$PKI/$2.crt" >/dev/null 2>&1 || fail "openssl: sign $2"
}
make_ca ca
make_ca otherca
for h in 1 2 3 4; do make_cert ca "host$h" "IP:10.213.0.$h,DNS:host$h"; done
make_cert ca cli "DNS:tessera-cli"
make_cert otherca rogue "DNS:tessera-cli"
openssl rand -hex 32 >"$PKI/token" || fail "openssl rand"
openssl rand -hex 32 >"$PKI/badtoken" || fail "openssl rand"
chmod 0600 "$PKI"/*.key "$PKI/token" "$PKI/badtoken"

# --- Each host's /etc/tessera and /var/lib/tessera ---------------------------------------------
# paths H: the sed expression mapping the unit's and configs' absolute paths to host H's directory.
paths() {
  echo "s#/usr/bin/#$BIN/#g; s#/etc/tessera#$T/host$1/etc/tessera#g; s#/var/lib/tessera#$T/host$1/var/lib/tessera#g; s#/var/cache/tessera#$T/host$1/var/cache/tessera#g"
}
setup_host() {  # setup_host H DAEMON...
  local h=$1 d
  shift
  local etc=$T/host$h/etc/tessera
  mkdir -p "$etc/tls" "$T/host$h/var/lib/tessera" "$T/host$h/var/cache/tessera"
  cp "$PKI/ca.crt" "$etc/tls/ca.crt"
  cp "$PKI/token" "$etc/token"
  chmod 0600 "$etc/token"
  for d in "$@"; do
    cp "$PKI/host$h.crt" "$etc/tls/$d.crt"
    cp "$PKI/host$h.key" "$etc/tls/$d.key"
    sed "$(paths "$h")" "$CONFIGS/$d.conf" >"$etc/$d.conf" || fail "config $d for host$h"
  done
  chmod 0640 "$etc"/tls/*.key
}
setup_host 1 coordinator server
setup_host 2 server
setup_host 3 worker
setup_host 4 worker
# Only what differs per host goes into the env files, as an operator would write them.
# host1's coordinator and host2's shard expose their metrics to other hosts as deploy/README.md
# says (all addresses, `metrics_insecure` for the plain-HTTP endpoint); the others keep them on
# loopback.
cat >"$T/host1/etc/tessera/coordinator.env" <<EOF
# test: host1
TESSERA_METRICS_LISTEN=0.0.0.0:9470
TESSERA_METRICS_INSECURE=true
EOF
for h in 1 2; do
  cat >"$T/host$h/etc/tessera/server.env" <<EOF
# test: host$h
TESSERA_COORDINATOR=10.213.0.1:7070
TESSERA_ADVERTISE_ADDRESS=10.213.0.$h:7000
TESSERA_THREADS=1
EOF
done
printf 'TESSERA_METRICS_LISTEN=0.0.0.0:9471\nTESSERA_METRICS_INSECURE=true\n' >>"$T/host2/etc/tessera/server.env"
for h in 3 4; do
  cat >"$T/host$h/etc/tessera/worker.env" <<EOF
# test: host$h (no GPU here: CPU, one thread)
TESSERA_COORDINATOR=10.213.0.1:7070
TESSERA_DEVICE=cpu
TESSERA_THREADS=1
EOF
done

# --- Run a unit's ExecStart= as systemd would ----------------------------------------------------
# unit_values FILE KEY: the values of KEY= lines in the unit's [Service] section, one per line.
unit_values() {
  awk -v key="$2" '
    /^\[/ { section = $0; next }
    section == "[Service]" && index($0, key "=") == 1 { print substr($0, length(key) + 2) }
  ' "$1"
}
# load_env_file FILE: prints the VAR=value assignments of an EnvironmentFile (comments and blank
# lines dropped, surrounding quotes removed as systemd does).
load_env_file() {
  local line
  while IFS= read -r line || [[ -n $line ]]; do
    line=${line#"${line%%[![:space:]]*}"}
    [[ -z $line || $line == \#* || $line == \;* ]] && continue
    [[ $line == *=* ]] || fail "$1: not VAR=value: $line"
    local var=${line%%=*} value=${line#*=}
    if [[ $value == \"*\" || $value == \'*\' ]]; then value=${value:1:${#value}-2}; fi
    printf '%s=%s\n' "$var" "$value"
  done <"$1"
}
# start_unit H UNIT INSTANCE: starts the unit's daemon in host H's namespace.
start_unit() {
  local h=$1 unit=$2 inst=$3
  local file=$UNITS/$unit
  [[ -f $file ]] || fail "no unit file $file"
  local name=${unit/@/@$inst}
  name=${name%.service}
  local map
  map="$(paths "$h"); s#%i#$inst#g"
  # ExecStart=: exactly one line, no prefixes (-, @, +, !) and no shell syntax to interpret.
  local exec_lines
  exec_lines=$(unit_values "$file" ExecStart)
  [[ $(printf '%s\n' "$exec_lines" | grep -c .) -eq 1 ]] || fail "$unit: expected one ExecStart= line"
  local cmdline
  cmdline=$(printf '%s\n' "$exec_lines" | sed "$map")
  [[ $cmdline == /* ]] || fail "$unit: ExecStart= must start with an absolute path: $cmdline"
  [[ $cmdline != *[\$\;\|\&\<\>\"\'\`\\]* ]] || fail "$unit: ExecStart= has characters this test does not interpret: $cmdline"
  local -a argv
  read -r -a argv <<<"$cmdline"
  # The environment: systemd's own variables, then Environment=, then each EnvironmentFile=.
  local notify=$T/notify/host$h-$name.sock
  local -a envs=(PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8 HOME=/
                 "NOTIFY_SOCKET=$notify" WATCHDOG_USEC=30000000)
  local value
  while IFS= read -r value; do
    [[ -n $value ]] && envs+=("$(sed "$map" <<<"$value")")
  done < <(unit_values "$file" Environment)
  while IFS= read -r value; do
    [[ -z $value ]] && continue
    local optional=0
    if [[ $value == -* ]]; then optional=1; value=${value#-}; fi
    value=$(sed "$map" <<<"$value")
    if [[ ! -f $value ]]; then
      [[ $optional -eq 1 ]] && continue
      fail "$unit: EnvironmentFile=$value is missing"
    fi
    while IFS= read -r value; do envs+=("$value"); done < <(load_env_file "$value")
  done < <(unit_values "$file" EnvironmentFile)
  # StateDirectory= and CacheDirectory= are made by systemd before the daemon starts.
  local dir
  for dir in $(unit_values "$file" StateDirectory | sed "s#%i#$inst#g"); do
    mkdir -p "$T/host$h/var/lib/$dir"
  done
  for dir in $(unit_values "$file" CacheDirectory | sed "s#%i#$inst#g"); do
    mkdir -p "$T/host$h/var/cache/$dir"
  done
  # The notify socket: a datagram socket whose messages go to $notify.log, one per line.
  "$PYTHON" -c '
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind(sys.argv[1])
with open(sys.argv[1] + ".log", "a", buffering=1) as out:
    out.write("bound\n")
    while True:
        data = s.recv(4096).decode(errors="replace")
        for line in data.split("\n"):
            if line:
                out.write(line + "\n")
' "$notify" &
  PIDS+=("$!")
  for _ in $(seq 1 50); do grep -q bound "$notify.log" 2>/dev/null && break; sleep 0.1; done
  grep -q bound "$notify.log" 2>/dev/null || fail "notify listener for $name did not start"
  printf '%s\n' "${argv[*]}" >"$T/logs/host$h-$name.cmdline"
  printf '%s\n' "${envs[@]}" >"$T/logs/host$h-$name.env"
  log "host$h: $name: ${argv[*]}"
  ip netns exec "${NS[$h]}" env -i "${envs[@]}" "${argv[@]}" >"$T/logs/host$h-$name.log" 2>&1 &
  local pid=$!
  PIDS+=("$pid")
  DAEMONS+=("host$h-$name $pid")
  LAST_NOTIFY=$notify.log
  LAST_PID=$pid
}
# wait_ready NOTIFY_LOG PID NAME SECONDS: waits for READY=1 as systemd does for Type=notify.
wait_ready() {
  local end=$((SECONDS + $4))
  while ((SECONDS < end)); do
    grep -qx 'READY=1' "$1" 2>/dev/null && { log "$3: READY=1"; return 0; }
    kill -0 "$2" 2>/dev/null || { wait "$2"; fail "$3 exited with status $? before READY=1"; }
    sleep 0.2
  done
  fail "$3 sent no READY=1 within $4 s (notify messages: $(tr '\n' ' ' <"$1"))"
}

start_unit 1 tessera-coordinator.service ""
wait_ready "$LAST_NOTIFY" "$LAST_PID" host1-coordinator 30
start_unit 1 tessera-server@.service 0
wait_ready "$LAST_NOTIFY" "$LAST_PID" host1-server@0 30
start_unit 2 tessera-server@.service 1
wait_ready "$LAST_NOTIFY" "$LAST_PID" host2-server@1 30
start_unit 3 tessera-worker@.service 0
wait_ready "$LAST_NOTIFY" "$LAST_PID" host3-worker@0 30
start_unit 4 tessera-worker@.service 0
wait_ready "$LAST_NOTIFY" "$LAST_PID" host4-worker@0 30

# --- The CLI on host1: mutual TLS and the token --------------------------------------------------
COORD=10.213.0.1:7070
cli() {  # cli ARGS...: the tessera CLI in host1's namespace with the right credentials, bounded
  timeout "${CLI_TIMEOUT:-20}" ip netns exec "${NS[1]}" env -i PATH=/usr/bin:/bin HOME=/ TESSERA_TOKEN_FILE="$PKI/token" \
    "$BIN/tessera" --coordinator "$COORD" --tls_ca "$PKI/ca.crt" --tls_cert "$PKI/cli.crt" \
    --tls_key "$PKI/cli.key" "$@"
}
log "waiting for 2 shards and 2 workers to register"
registered=0
# Its own deadline, whatever the READY waits above took (bounded in count too).
register_end=$((SECONDS + 60))
for _ in $(seq 1 240); do
  out=$(CLI_TIMEOUT=10 cli cluster --output json 2>"$T/logs/cli-cluster.err")
  # One JSON document; count members by role and state with Python (no jq here).
  counts=$("$PYTHON" -c '
import json, sys
try:
    members = json.loads(sys.stdin.read()).get("members", [])
except (ValueError, AttributeError):
    print("unparsed"); sys.exit(0)
ready = [m for m in members if m.get("state") == "MEMBER_STATE_READY"]
shards = sorted(m.get("shardIndex", m.get("shard_index", 0)) for m in ready
                if m.get("role") == "MEMBER_ROLE_SERVER")
workers = [m for m in ready if m.get("role") == "MEMBER_ROLE_WORKER"]
print(len(shards), len(workers), ",".join(str(i) for i in shards))
' <<<"$out")
  if [[ $counts == "2 2 0,1" ]]; then registered=1; break; fi
  ((SECONDS < register_end)) || break
  sleep 0.5
done
[[ $registered -eq 1 ]] || fail "the cluster showed no 2 shards and 2 workers within 60 s (last: '$counts'; output: $out; stderr: $(tail -3 "$T/logs/cli-cluster.err"))"
log "cluster: 2 shards, 2 workers"
cli cluster || fail "tessera cluster (text) failed"

# --- Health from a worker host, the operator's way (deploy/tools/tessera-health.py) -------------
HEALTH=("$PYTHON" "$SRC/deploy/tools/tessera-health.py" --ca "$T/host3/etc/tessera/tls/ca.crt"
        --cert "$T/host3/etc/tessera/tls/worker.crt" --key "$T/host3/etc/tessera/tls/worker.key")
out=$(ip netns exec "${NS[3]}" "${HEALTH[@]}" --token_file "$T/host3/etc/tessera/token" \
      10.213.0.1:7070 10.213.0.1:7000 10.213.0.2:7000 10.213.0.3:7080 10.213.0.4:7080 2>&1) ||
  fail "tessera-health from host3: $out"
[[ $(grep -c ' SERVING$' <<<"$out") -eq 5 ]] || fail "not every daemon is SERVING: $out"
# The token is never sent in plain text: --token_file without --ca is a usage error (64, EX_USAGE).
rc=0
out=$(ip netns exec "${NS[3]}" "$PYTHON" "$SRC/deploy/tools/tessera-health.py" \
      --token_file "$T/host3/etc/tessera/token" 10.213.0.1:7070 2>&1) || rc=$?
[[ $rc -eq 64 && $out == *"--token_file needs --ca"* ]] ||
  fail "tessera-health --token_file without --ca: exit $rc, expected 64 (output: $out)"
log "health from host3: $(tr '\n' ';' <<<"$out")"
out=$(ip netns exec "${NS[3]}" "${HEALTH[@]}" 10.213.0.2:7000 2>&1) &&
  fail "a health check without the token was let through: $out"
grep -q UNAUTHENTICATED <<<"$out" || fail "a health check without the token: $out"

# --- Only the right credentials get through ----------------------------------------------------
refused() {  # refused WHAT EXPECTED-WORD ARGS...: the command must fail, naming EXPECTED-WORD
  local what=$1 word=$2 out rc
  shift 2
  out=$(timeout 20 ip netns exec "${NS[1]}" env -i PATH=/usr/bin:/bin HOME=/ "$@" 2>&1)
  rc=$?
  [[ $rc -ne 0 ]] || fail "$what was let through: $out"
  [[ $rc -ne 124 ]] || fail "$what hung (no deadline?)"
  grep -qi "$word" <<<"$out" || fail "$what failed without saying $word (exit $rc): $out"
  log "refused as expected ($what): exit $rc"
}
T_CLI=("$BIN/tessera" --coordinator "$COORD")
refused "mutual TLS without a token" UNAUTHENTICATED \
  "${T_CLI[@]}" --tls_ca "$PKI/ca.crt" --tls_cert "$PKI/cli.crt" --tls_key "$PKI/cli.key" cluster
refused "mutual TLS with a wrong token" UNAUTHENTICATED \
  "${T_CLI[@]}" --tls_ca "$PKI/ca.crt" --tls_cert "$PKI/cli.crt" --tls_key "$PKI/cli.key" \
  --auth_token_file "$PKI/badtoken" cluster
refused "plaintext" "UNAVAILABLE\|could not be reached\|unreachable" "${T_CLI[@]}" cluster
refused "a client certificate from another CA" "UNAVAILABLE\|could not be reached\|unreachable" \
  "${T_CLI[@]}" --tls_ca "$PKI/ca.crt" --tls_cert "$PKI/rogue.crt" --tls_key "$PKI/rogue.key" \
  --auth_token_file "$PKI/token" cluster
refused "TLS without a client certificate" "UNAVAILABLE\|could not be reached\|unreachable" \
  "${T_CLI[@]}" --tls_ca "$PKI/ca.crt" --auth_token_file "$PKI/token" cluster

# --- A job across the hosts ----------------------------------------------------------------------
SPEC=$T/fashion_mlp_1epoch.textproto
sed -e 's/^epochs: .*/epochs: 1/' -e 's/^name: .*/name: "netns-mlp"/' \
  "$SRC/examples/fashion_mlp.textproto" >"$SPEC" || fail "writing the spec"
grep -qx 'epochs: 1' "$SPEC" || fail "the spec has no epochs line to set"
grep -qx 'num_workers: 2' "$SPEC" || fail "the example spec no longer asks for 2 workers"
budget=$(( $(remaining) - 20 ))
(( budget > 30 )) || fail "no time left for the job"
log "submitting $SPEC (watch for at most $budget s)"
# In the background, so that a SIGTERM or SIGINT to this script runs its trap at once (bash defers
# traps while a foreground child runs).
CLI_TIMEOUT=$budget cli submit "$SPEC" --watch --output json >"$T/logs/job.json" 2>"$T/logs/job.err" &
submit_pid=$!
PIDS+=("$submit_pid")
wait "$submit_pid"
rc=$?
[[ $rc -ne 124 ]] || fail "the job did not finish within $budget s"
result=$(tail -n 1 "$T/logs/job.json")
[[ $rc -eq 0 ]] || fail "tessera submit --watch exited $rc: $result $(tail -5 "$T/logs/job.err")"
summary=$("$PYTHON" -c '
import json, sys
job = json.loads(sys.argv[1])
state = job.get("state_name") or job.get("state")
acc = float(job.get("test_accuracy", 0))
workers = job.get("workers", [])
print(state, acc, len(workers), job.get("steps", 0))
' "$result") || fail "the last line is not the job record: $result"
read -r state acc nworkers steps <<<"$summary"
log "job: state $state, test accuracy $acc, $nworkers workers, $steps steps"
[[ $state == SUCCEEDED || $state == JOB_STATE_SUCCEEDED ]] || fail "job ended $state: $result"
"$PYTHON" -c "import sys; sys.exit(0 if float('$acc') >= 0.75 else 1)" ||
  fail "test accuracy $acc after 1 epoch is below 0.75"
(( steps > 0 )) || fail "the job record shows no steps"

# --- Metrics: across hosts where exposed, on loopback elsewhere --------------------------------
scrape() {  # scrape H URL: GET from host H's namespace (curl, else python3)
  if command -v curl >/dev/null; then
    ip netns exec "${NS[$1]}" curl -sS --fail --max-time 10 "$2"
  else
    ip netns exec "${NS[$1]}" "$PYTHON" -c \
      'import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())' "$2"
  fi
}
metrics=$(scrape 3 http://10.213.0.1:9470/metrics) ||
  fail "host3 could not scrape the coordinator's metrics at 10.213.0.1:9470"
grep -q '^tessera_build_info{.*daemon="coordinator"' <<<"$metrics" ||
  fail "the coordinator's metrics lack tessera_build_info{daemon=\"coordinator\"}"
metrics=$(scrape 3 http://10.213.0.2:9471/metrics) ||
  fail "host3 could not scrape shard 1's metrics at 10.213.0.2:9471"
grep -q '^tessera_rpc_calls_total{' <<<"$metrics" || fail "shard 1's metrics count no RPCs"
metrics=$(scrape 1 http://127.0.0.1:9471/metrics) || fail "host1 could not scrape shard 0 on loopback"
grep -q '^tessera_build_info{.*daemon="server"' <<<"$metrics" || fail "shard 0's metrics lack tessera_build_info"
metrics=$(scrape 4 http://127.0.0.1:9480/metrics) || fail "host4 could not scrape its worker on loopback"
grep -q '^tessera_build_info{.*daemon="worker"' <<<"$metrics" || fail "the worker's metrics lack tessera_build_info"
scrape 3 http://10.213.0.1:9471/metrics >/dev/null 2>&1 &&
  fail "shard 0's loopback-only metrics endpoint was reachable from host3"
log "metrics: coordinator and shard 1 from host3, shard 0 and a worker on loopback"

# --- systemctl reload: the unit's ExecReload= line, $MAINPID replaced -----------------------------
reload_line=$(unit_values "$UNITS/tessera-server@.service" ExecReload)
[[ $reload_line == '/bin/kill -HUP $MAINPID' ]] || fail "unexpected ExecReload= line: $reload_line"
for entry in "${DAEMONS[@]}"; do
  read -r name pid <<<"$entry"
  [[ $name == host2-tessera-server@1 ]] || continue
  read -r -a reload_argv <<<"${reload_line//\$MAINPID/$pid}"
  "${reload_argv[@]}" || fail "ExecReload= for $name failed"
  reloaded=0
  for _ in $(seq 1 50); do
    grep -q SIGHUP "$T/logs/$name.log" && { reloaded=1; break; }
    sleep 0.1
  done
  [[ $reloaded -eq 1 ]] || fail "$name logged nothing about SIGHUP after ExecReload="
  out=$(ip netns exec "${NS[3]}" "${HEALTH[@]}" --token_file "$T/host3/etc/tessera/token" \
        10.213.0.2:7000 2>&1) || fail "$name is not SERVING after a reload: $out"
  log "reload: $name re-read its configuration and still serves"
done

# --- SIGTERM: every daemon drains and exits 0 ----------------------------------------------------
for entry in "${DAEMONS[@]}"; do
  read -r name pid <<<"$entry"
  kill -TERM "$pid" 2>/dev/null || fail "$name (pid $pid) was already gone"
done
for entry in "${DAEMONS[@]}"; do
  read -r name pid <<<"$entry"
  ended=0
  for _ in $(seq 1 300); do
    kill -0 "$pid" 2>/dev/null || { ended=1; break; }
    sleep 0.1
  done
  [[ $ended -eq 1 ]] || fail "$name did not exit within 30 s of SIGTERM"
  wait "$pid"
  status=$?
  [[ $status -eq 0 ]] || fail "$name exited $status after SIGTERM"
  grep -qx 'STOPPING=1' "$T/notify/$name.sock.log" ||
    fail "$name sent no STOPPING=1 while draining"
done
log "every daemon exited 0 after SIGTERM"
echo "PASS: a job trained to SUCCEEDED across 4 namespaced hosts with TLS and tokens (accuracy $acc)"
