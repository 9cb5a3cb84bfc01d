#!/bin/bash
# local scheduler: `launcher submit --scheduler local` runs this script as a process group here.
# miles-hpc job script for preset qwen3-0.6b-colocated (local), rendered by `launcher render`.
# Regenerate it rather than editing it: every value below comes from the resolved preset.
# shellcheck disable=SC2034,SC2317
# (SC2034: settings reach the other nodes through job.env, by name; SC2317: functions run from traps)
set -euo pipefail

# ---- settings from the resolved preset (every value shell-quoted at render time)
RUN_DIR=/scratch/runs/golden-run
PY=/opt/miles/venv/bin/python
SCHEDULER=local
PRESET_NAME=qwen3-0.6b-colocated
EXPECTED_NODES=1
TRAIN_NODES=1
GPUS_PER_NODE=8
IP_MODE=hostname
IP_INTERFACE=''
IP_PREFIX=''
# ports: empty = claimed free when the job starts, on the node that binds them (miles.job.ports)
RAY_GCS_PORT=''
RAY_CLIENT_PORT=''
RAY_NODE_PORT_BASE=''
RAY_WORKER_PORT_BASE=''
RAY_WORKER_PORT_SPAN=200
RAY_TEMP_BASE=/tmp/miles-ray
RAY_NUM_CPUS=''
NODE_CPUS=''
RAY_OBJECT_STORE_BYTES=''
RAY_START_TIMEOUT=300.0
GATEWAY_HOST=0.0.0.0
GATEWAY_PORT=''
# https with this certificate (the watchdog trusts exactly it); empty = plain http
GATEWAY_TLS_CERT=''
DEAD_PROBES=4
PROBE_INTERVAL=30.0
STARTUP_PROBE_INTERVAL=10.0
STARTUP_TIMEOUT=3600.0
# within PBS's kill_delay (10 s by default) and Slurm's KillWait (30 s): then SIGKILL what is left
TEARDOWN_WAIT_S=15
# exit codes (miles.contract.exit_codes): the scheduler's record of the job means the same as the driver's
EXIT_OK=0
EXIT_FAILED=1
EXIT_STARTUP_FAILED=2
EXIT_TRAINER_DEAD=3
EXIT_STARTUP_TIMEOUT=4
EXIT_WALLTIME=5
EXIT_SELFTEST_FAILED=6
EXIT_SIGTERM=143
EXIT_SIGINT=130
DRIVER_CMD=("$PY" -m miles.driver.serve "$RUN_DIR/preset.yaml")
SERVICES_CMD=( )
export RAY_AUTH_MODE=disabled
export RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1

JOB_ID=${MILES_JOB_ID:-local-$$}
JOB_KEY=$JOB_ID

if [[ "${MILES_JOB_CHECK_ONLY:-0}" == 1 ]]; then
  # Harmless mode for tests: show what the settings evaluate to, start nothing.
  declare -p RUN_DIR PY SCHEDULER PRESET_NAME DRIVER_CMD SERVICES_CMD
  env
  exit 0
fi

# ---- logging: everything the job prints goes to $RUN_DIR/logs/job.log
LOGS="$RUN_DIR/logs"
mkdir -p "$LOGS"
exec >>"$LOGS/job.log" 2>&1
log() { printf '%s [job] %s\n' "$(date '+%F %T')" "$*"; }
die() {
  log "ERROR: $*"
  exit "$EXIT_FAILED"
}
RAY_BIN="$(dirname "$PY")/ray"
[[ -x "$PY" ]] || die "python $PY is not executable: render the script with the python of your miles-hpc install"
[[ -x "$RAY_BIN" ]] || die "ray not found next to $PY ($RAY_BIN): install miles-hpc into that environment"

# ---- teardown: stop only the processes this job started (newest first), never a global `ray stop`
STARTED_PIDS=()
started() { STARTED_PIDS+=("$1"); }

# every descendant of the given pids, from one snapshot of the process table (ps per process is slow)
descendants() {
  local -A children=()
  local pid ppid child queue=("$@")
  while read -r pid ppid; do children[$ppid]+=" $pid"; done < <(ps -e -o pid=,ppid=)
  while ((${#queue[@]})); do
    pid=${queue[0]}
    queue=("${queue[@]:1}")
    for child in ${children[$pid]:-}; do
      echo "$child"
      queue+=("$child")
    done
  done
}

# whether any of the pids still runs (a zombie has exited: only its parent's wait is missing)
alive() {
  ps -o stat= -p "$(IFS=,; echo "$*")" 2>/dev/null | grep -qv '^Z'
}

stop_started() {
  local top=() all=() i
  for ((i = ${#STARTED_PIDS[@]} - 1; i >= 0; i--)); do
    top+=("${STARTED_PIDS[i]}")
  done
  ((${#top[@]})) || return 0
  mapfile -t all < <(printf '%s\n' "${top[@]}"; descendants "${top[@]}")
  # Only what we started: `ray start --block` drains and stops its own raylet/GCS on SIGTERM (signalling
  # those directly can wedge its shutdown), srun and pbs_tmrsh forward the signal to their task.
  # SIGKILL what is left, within PBS's kill_delay / Slurm's KillWait.
  kill -TERM "${top[@]}" 2>/dev/null || true
  for _ in $(seq 1 "$((TEARDOWN_WAIT_S * 2))"); do
    alive "${all[@]}" || return 0
    sleep 0.5
  done
  log "teardown: still running after $TEARDOWN_WAIT_S s, sending SIGKILL: $(ps -o pid=,args= -p "$(IFS=,; echo "${all[*]}")" | cut -c1-120 | tr '\n' ';')"
  kill -KILL "${all[@]}" 2>/dev/null || true
}

on_exit() {
  local rc=$?
  # PBS signals every process of the job, possibly more than once: a repeat must not cut the teardown
  trap - EXIT
  trap '' TERM INT USR1
  log "teardown (exit status $rc)"
  # PBS signals the driver and this shell together: whichever ends first, the job ended on SIGTERM
  [[ "$rc" != "$EXIT_SIGTERM" || -e "$RUN_DIR/end_reason" ]] || end_reason TERM "$SIGTERM_WHY"
  # recorded before stopping anything: a SIGKILL at the end of kill_delay must not lose it (the
  # scheduler's record may lack an exit status or a reason; the run dir keeps both)
  echo "$rc" >"$RUN_DIR/exit_code" 2>/dev/null || true
  stop_started
  log "job done, exit status $rc"
  exit "$rc"
}

# A signal ends the job in order: the driver gets SIGTERM and stops the gateway, engines and trainers.
# SIGTERM: qdel/scancel, PBS's walltime kill (SIGTERM, then SIGKILL after kill_delay) or a preemption;
# SIGUSR1: Slurm's advance notice before the time limit (--signal=B:USR1@SECONDS).
end_reason() { printf '%s\n' "SIG$1: $2" >"$RUN_DIR/end_reason" 2>/dev/null || true; }

on_signal() {
  local name=$1 code=$2 why=$3
  trap '' TERM INT USR1
  log "caught SIG$name ($why): shutting down in order"
  end_reason "$name" "$why"
  exit "$code"
}
SIGTERM_WHY="cancelled, walltime or preemption"
trap on_exit EXIT
trap 'on_signal TERM "$EXIT_SIGTERM" "$SIGTERM_WHY"' TERM
trap 'on_signal INT "$EXIT_SIGINT" "interrupted"' INT
trap 'on_signal USR1 "$EXIT_WALLTIME" "the scheduler gave notice before the time limit"' USR1

# ---- a requeued or rerun job: the previous attempt's run files move aside, so nothing trusts them
RUN_STATE_FILES=( healthy phase exit_code end_reason cells.json gateway_url roles.tsv nodes.txt node-ips ports job.env events.jsonl events.1.jsonl )

set_aside_previous_attempt() {
  local found=() name dest
  for name in "${RUN_STATE_FILES[@]}"; do
    [[ ! -e "$RUN_DIR/$name" ]] || found+=("$name")
  done
  ((${#found[@]})) || return 0
  dest="$RUN_DIR/attempts/$(date -u '+%Y%m%dT%H%M%SZ')-$$"
  mkdir -p "$dest"
  for name in "${found[@]}"; do
    mv -- "$RUN_DIR/$name" "$dest/"
  done
  log "a previous attempt's run files moved to $dest: ${found[*]}"
}

# ---- facts for the processes this job starts on other nodes (pbsdsh and pbs_tmrsh give them a minimal env)
write_job_env() {
  local name
  {
    echo "# written by the job script; sourced by ray-node.sh on every node"
    for name in PATH RUN_DIR PY RAY_BIN SCHEDULER JOB_ID JOB_KEY JOB_LABEL HEAD HEAD_IP GPUS_PER_NODE \
      RAY_GCS_PORT RAY_CLIENT_PORT RAY_NODE_PORT_BASE RAY_WORKER_PORT_BASE RAY_WORKER_PORT_SPAN RAY_TEMP_BASE \
      RAY_NUM_CPUS NODE_CPUS RAY_OBJECT_STORE_BYTES RAY_ADDRESS MILES_GATEWAY_URL RAY_AUTH_MODE \
      RAY_AUTH_TOKEN_PATH; do
      printf 'export %s=%q\n' "$name" "${!name}"
    done
    for name in RAY_AUTH_MODE RAY_USAGE_STATS_ENABLED PYTHONUNBUFFERED; do
      printf 'export %s=%q\n' "$name" "${!name}"
    done
  } >"$RUN_DIR/job.env"
}

# ---- the per-node Ray launcher: `ray-node.sh head|worker INDEX IP`. Its ports come from the preset's
# fixed plan (offset by INDEX) or are claimed free on the node itself; either way they are written to
# RUN_DIR/ports/node-INDEX.env. It writes its own log: under pbsdsh/pbs_tmrsh a task's output would go to
# the job's output file instead.
write_ray_node_script() {
  cat >"$RUN_DIR/ray-node.sh" <<'RAY_NODE_EOF'
#!/bin/bash
set -euo pipefail
# shellcheck source=/dev/null
source "$(dirname "$0")/job.env"
kind=$1 i=$2 ip=$3
if [[ "$kind" == head ]]; then log_file="$RUN_DIR/logs/ray-head.log"; else log_file="$RUN_DIR/logs/ray-worker-$i.log"; fi
exec >>"$log_file" 2>&1
ports_file="$RUN_DIR/ports/node-$i.env"
mkdir -p "$RUN_DIR/ports"
claim=()
if [[ -n "$RAY_NODE_PORT_BASE" ]]; then
  base=$((RAY_NODE_PORT_BASE + 10 * i))
  claim+=(--fixed "NODE_MANAGER_PORT=$base" --fixed "OBJECT_MANAGER_PORT=$((base + 1))"
    --fixed "AGENT_LISTEN_PORT=$((base + 2))" --fixed "AGENT_GRPC_PORT=$((base + 3))"
    --fixed "RUNTIME_ENV_AGENT_PORT=$((base + 4))" --fixed "METRICS_PORT=$((base + 5))")
else
  claim+=(--name NODE_MANAGER_PORT --name OBJECT_MANAGER_PORT --name AGENT_LISTEN_PORT --name AGENT_GRPC_PORT
    --name RUNTIME_ENV_AGENT_PORT --name METRICS_PORT)
fi
if [[ -n "$RAY_WORKER_PORT_BASE" ]]; then
  first=$((RAY_WORKER_PORT_BASE + RAY_WORKER_PORT_SPAN * i))
  claim+=(--fixed-range "WORKER_PORT=$first-$((first + RAY_WORKER_PORT_SPAN - 1))")
else
  claim+=(--range "WORKER_PORT:$RAY_WORKER_PORT_SPAN")
fi
# Claimed for this process, which runs `ray start` below: the claim lasts as long as Ray runs here. Ports the
# preset pins are claimed too, once checked free: a busy one stops the node now, named with its preset key.
"$PY" -m miles.job.ports --owner $$ "${claim[@]}" --out "$ports_file"
# shellcheck source=/dev/null
source "$ports_file"
# CPUs: the preset's ray.num_cpus, else the cores this process may use
cpus=${RAY_NUM_CPUS:-$(nproc)}
args=(--node-ip-address="$ip" --num-cpus="$cpus" --num-gpus="$GPUS_PER_NODE"
  --resources="{\"$JOB_LABEL\": 1}"
  --node-manager-port="$NODE_MANAGER_PORT" --object-manager-port="$OBJECT_MANAGER_PORT"
  --dashboard-agent-listen-port="$AGENT_LISTEN_PORT" --dashboard-agent-grpc-port="$AGENT_GRPC_PORT"
  --runtime-env-agent-port="$RUNTIME_ENV_AGENT_PORT" --metrics-export-port="$METRICS_PORT"
  --min-worker-port="$WORKER_PORT_MIN" --max-worker-port="$WORKER_PORT_MAX"
  --disable-usage-stats --block)
[[ -z "$RAY_OBJECT_STORE_BYTES" ]] || args+=(--object-store-memory="$RAY_OBJECT_STORE_BYTES")
echo "$(date '+%F %T') ray-node: $kind index $i ip $ip on $(hostname), $cpus CPUs, ports $(paste -sd' ' "$ports_file")"
# Ray's Prometheus endpoints answer anyone on every interface (0.0.0.0) without the job's token, and the job
# reads none of them: metrics collection off (each node's metrics export port). On the head, the
# autoscaler monitor's and the dashboard process's metrics servers (fixed ports 44217 and 44227 on
# 0.0.0.0, which Ray can neither turn off nor bind to an address) get a port that cannot bind: Ray logs
# the failure and carries on, and `ray status` still works. docs/security.md lists what stays open and why.
export RAY_enable_metrics_collection=0
if [[ "$kind" == head ]]; then
  export AUTOSCALER_METRIC_PORT=-1 DASHBOARD_METRIC_PORT=-1
  exec "$RAY_BIN" start --head --port="$RAY_GCS_PORT" --ray-client-server-port="$RAY_CLIENT_PORT" \
    --include-dashboard=false --temp-dir="$RAY_TEMP_BASE/$JOB_KEY" "${args[@]}"
fi
# A worker's raylet gets 30 s to register with the GCS (fixed in Ray's node.py); a GCS busy with a whole
# allocation joining at once can miss that, and `ray start` then exits before the node ever joined. Such
# an attempt is retried; a worker that joined and later died is not (the driver must see that node go).
# `ray start` runs as a child so this shell can retry it: a signal is passed on to it, and its --block
# drains its own raylet. A failed attempt's raylet dies with it (Ray fate-shares a blocking start's children).
ray_pid=
stop_ray() {
  [[ -z "$ray_pid" ]] || kill -TERM "$ray_pid" 2>/dev/null || true
  [[ -z "$ray_pid" ]] || wait "$ray_pid" 2>/dev/null || true
  exit 143
}
trap stop_ray TERM INT
attempts=3
for ((attempt = 1; ; attempt++)); do
  log_offset=$(($(stat -c %s "$log_file") + 1))
  "$RAY_BIN" start --address="$RAY_ADDRESS" --temp-dir="$RAY_TEMP_BASE/$JOB_KEY-w$i" "${args[@]}" &
  ray_pid=$!
  rc=0
  wait "$ray_pid" || rc=$?
  ray_pid=
  if tail -c "+$log_offset" "$log_file" | grep -q 'Ray runtime started' || ((attempt >= attempts)); then
    exit "$rc"
  fi
  echo "$(date '+%F %T') ray-node: worker index $i did not join (ray start exit status $rc), attempt $attempt of $attempts; trying again"
  sleep 2
done
RAY_NODE_EOF
  chmod +x "$RUN_DIR/ray-node.sh"
}

# ---- interface/prefix modes: each node reports its own IP into the shared run dir
probe_node_ips() {
  local probe_dir="$RUN_DIR/node-ips" node pids=() deadline
  mkdir -p "$probe_dir"
  local probe=("$PY" -m miles.job.nodes probe --mode "$IP_MODE" --out "$probe_dir")
  [[ -z "$IP_INTERFACE" ]] || probe+=(--interface "$IP_INTERFACE")
  [[ -z "$IP_PREFIX" ]] || probe+=(--prefix "$IP_PREFIX")
  for node in "${NODES[@]}"; do
    if [[ "$node" == "$HEAD" ]]; then
      "${probe[@]}" --name "$node" >>"$LOGS/job.log" 2>&1 &
    else
      on_node "$node" "${probe[@]}" --name "$node" >>"$LOGS/job.log" 2>&1 &
    fi
    pids+=("$!")
  done
  deadline=$((SECONDS + ${RAY_START_TIMEOUT%.*}))
  for node in "${NODES[@]}"; do
    until [[ -s "$probe_dir/$node" ]]; do
      ((SECONDS < deadline)) || {
        kill "${pids[@]}" 2>/dev/null
        die "node $node did not report its IP"
      }
      sleep 0.5
    done
  done
  wait "${pids[@]}" || true
  for node in "${NODES[@]}"; do cat "$probe_dir/$node"; done >"$NODE_FILE"
}

# ---- scheduler specifics: node discovery, starting a command on a node, the Ray head
discover_nodes() {
  NODES=("$(hostname -s)")
  HEAD=${NODES[0]}
}

on_node() {
  die "the local scheduler has one node; cannot start $* on $1"
}

start_ray_head() {
  exec "$RUN_DIR/ray-node.sh" head "$@"
}

# ---- 1. the allocation's nodes
((BASH_VERSINFO[0] > 5 || (BASH_VERSINFO[0] == 5 && BASH_VERSINFO[1] >= 1))) \
  || die "bash >= 5.1 is needed (wait -n -p); this is $BASH_VERSION"
log "job $JOB_ID ($SCHEDULER) preset $PRESET_NAME, run dir $RUN_DIR"
set_aside_previous_attempt
[[ -f "$RUN_DIR/preset.yaml" ]] || die "$RUN_DIR/preset.yaml is missing: submit with \`launcher submit\`"
discover_nodes
log "nodes: ${NODES[*]} (head $HEAD)"
((${#NODES[@]} == EXPECTED_NODES)) \
  || die "the allocation has ${#NODES[@]} nodes but the preset asks for $EXPECTED_NODES"

# ---- 2. node IPs, then roles from the one implementation (miles.contract.roles): head last
NODE_FILE="$RUN_DIR/nodes.txt"
if [[ "$IP_MODE" == interface || "$IP_MODE" == prefix ]]; then
  probe_node_ips
else
  printf '%s\n' "${NODES[@]}" >"$NODE_FILE"
fi
ROLES_FILE="$RUN_DIR/roles.tsv"
"$PY" -m miles.job.roles --nodefile "$NODE_FILE" --head "$HEAD" --train-nodes "$TRAIN_NODES" \
  --colocated \
  --ip-mode "$IP_MODE" --tsv "$ROLES_FILE" || die "role planning failed (see above)"
ROLE_INDEX=() ROLE_NAME=() ROLE_IP=()
while IFS=$'\t' read -r index name ip roles; do
  ROLE_INDEX+=("$index") ROLE_NAME+=("$name") ROLE_IP+=("$ip")
  [[ ",$roles," != *,head,* ]] || { HEAD_INDEX=$index; HEAD_IP=$ip; }
done < <(tail -n +2 "$ROLES_FILE")

# ---- 3. this job's ports on the head (claimed free unless the preset fixes them) and its Ray label
mkdir -p "$RUN_DIR/ports"
claim=()
for name in RAY_GCS_PORT RAY_CLIENT_PORT GATEWAY_PORT; do
  if [[ -n "${!name}" ]]; then claim+=(--fixed "$name=${!name}"); else claim+=(--name "$name"); fi
done
"$PY" -m miles.job.ports --owner $$ "${claim[@]}" --out "$RUN_DIR/ports/head.claimed" \
  || die "could not claim this job's ports on the head (see above)"
# shellcheck source=/dev/null
source "$RUN_DIR/ports/head.claimed"
printf '%s\n' "RAY_GCS_PORT=$RAY_GCS_PORT" "RAY_CLIENT_PORT=$RAY_CLIENT_PORT" "GATEWAY_PORT=$GATEWAY_PORT" \
  >"$RUN_DIR/ports/head.env"
rm -f "$RUN_DIR/ports/head.claimed"
# every Ray node of this job carries this resource: readiness counts only those, never another job's
JOB_LABEL="miles_job_${SCHEDULER}_${JOB_KEY//[^A-Za-z0-9]/_}_$(od -An -N4 -tx1 /dev/urandom | tr -d ' \n')"
# Ray's token authentication: a fresh 256-bit token per attempt, readable by the job's user only (the run
# dir is on a file system every node sees). Every `ray start`, the driver and miles.job.nodes present it, so a
# process elsewhere on the cluster network can neither join this Ray cluster nor submit work to it.
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$RUN_DIR/ray-auth-token"
rm -f "$RAY_AUTH_TOKEN_PATH"
(umask 077 && od -An -N32 -tx1 /dev/urandom | tr -d ' \n' >"$RAY_AUTH_TOKEN_PATH") \
  || die "could not write the job's Ray token $RAY_AUTH_TOKEN_PATH"

case "$GATEWAY_HOST" in
  0.0.0.0 | :: | '') GATEWAY_ADDR=$HEAD_IP ;;
  *) GATEWAY_ADDR=$GATEWAY_HOST ;;
esac
export MILES_RUN_DIR="$RUN_DIR" MILES_ROLES_FILE="$ROLES_FILE" MILES_HEAD_IP="$HEAD_IP"
export MILES_GATEWAY_PORT="$GATEWAY_PORT" MILES_RAY_JOB_LABEL="$JOB_LABEL"
GATEWAY_SCHEME=http TLS_ARGS=()
[[ -z "$GATEWAY_TLS_CERT" ]] || { GATEWAY_SCHEME=https TLS_ARGS=(--tls-cert "$GATEWAY_TLS_CERT"); }
export RAY_ADDRESS="$HEAD_IP:$RAY_GCS_PORT" MILES_GATEWAY_URL="$GATEWAY_SCHEME://$GATEWAY_ADDR:$GATEWAY_PORT"
write_job_env
write_ray_node_script

# ---- 4. Ray: the head, then one worker per other node; wait until Ray reports every node of this job
log "ray: head $HEAD at $RAY_ADDRESS, temp dir $RAY_TEMP_BASE/$JOB_KEY, label $JOB_LABEL"
start_ray_head "$HEAD_INDEX" "$HEAD_IP" &
started $!
RAY_PIDS=("$!")
for k in "${!ROLE_NAME[@]}"; do
  [[ "${ROLE_INDEX[k]}" != "$HEAD_INDEX" ]] || continue
  on_node "${ROLE_NAME[k]}" "$RUN_DIR/ray-node.sh" worker "${ROLE_INDEX[k]}" "${ROLE_IP[k]}" \
    >>"$LOGS/launch-${ROLE_INDEX[k]}.log" 2>&1 &
  started $!
  RAY_PIDS+=("$!")
done
watch=()
for pid in "${RAY_PIDS[@]}"; do watch+=(--watch-pid "$pid"); done
"$PY" -m miles.job.nodes wait-ray --address "$RAY_ADDRESS" --node-ip "$HEAD_IP" --nodes "${#NODES[@]}" \
  --job-label "$JOB_LABEL" --timeout "$RAY_START_TIMEOUT" "${watch[@]}" || {
  # what stopped a node before `ray start` (a pinned port in use, ...) is in its own log: show it here
  (cd "$LOGS" && grep -H '^Error: ' ray-*.log) >&2 || true
  die "Ray did not form with ${#NODES[@]} nodes of this job (see $LOGS/ray-*.log)"
}

# ---- 5. the driver, the watchdog, and the services once the gateway is healthy
start_services_when_healthy() {
  # The watchdog creates $RUN_DIR/healthy when healthz first answers 200.
  until [[ -e "$RUN_DIR/healthy" ]]; do sleep 1; done
  log "gateway healthy: starting services: ${SERVICES_CMD[*]}"
  cd "$RUN_DIR"
  exec "${SERVICES_CMD[@]}"
}

log "driver: ${DRIVER_CMD[*]}"
(cd "$RUN_DIR" && exec "${DRIVER_CMD[@]}") >>"$LOGS/driver.log" 2>&1 &
DRIVER_PID=$!
started "$DRIVER_PID"
log "watchdog: $MILES_GATEWAY_URL/api/v1/healthz, $DEAD_PROBES consecutive 503s end the job (0 = never)"
"$PY" -m miles.job.monitor --url "$MILES_GATEWAY_URL/api/v1/healthz" --dead-probes "$DEAD_PROBES" \
  --interval "$PROBE_INTERVAL" --startup-interval "$STARTUP_PROBE_INTERVAL" \
  --startup-timeout "$STARTUP_TIMEOUT" "${TLS_ARGS[@]}" >>"$LOGS/monitor.log" 2>&1 &
MONITOR_PID=$!
started "$MONITOR_PID"
if ((${#SERVICES_CMD[@]})); then
  start_services_when_healthy >>"$LOGS/services.log" 2>&1 &
  started $!
fi

# ---- 6. the job ends as soon as the driver or the watchdog exits (or a signal arrives: see on_signal)
rc=0
FINISHED=""
wait -n -p FINISHED "$DRIVER_PID" "$MONITOR_PID" || rc=$?
if [[ "$FINISHED" == "$DRIVER_PID" ]]; then
  log "driver exited with status $rc"
else
  case $rc in
    "$EXIT_TRAINER_DEAD") log "watchdog: the trainer is dead ($DEAD_PROBES consecutive 503s); ending the job" ;;
    "$EXIT_STARTUP_TIMEOUT") log "watchdog: the gateway never became healthy within $STARTUP_TIMEOUT s; ending the job" ;;
    *) log "watchdog exited with status $rc" ;;
  esac
fi
exit "$rc"
