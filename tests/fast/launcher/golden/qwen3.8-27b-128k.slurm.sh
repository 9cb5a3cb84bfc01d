#!/bin/bash
#SBATCH --job-name=miles-qwen3.8-27b-128k
#SBATCH --nodes=10
#SBATCH --ntasks-per-node=1
#SBATCH --time=12:00:00
#SBATCH --gpus-per-node=8
#SBATCH --output=/scratch/runs/golden-run/logs/slurm-%j.out
# miles-hpc job script for preset qwen3.8-27b-128k (slurm), rendered by `launcher render`.
# Regenerate it rather than editing it: every value below comes from the resolved preset.
set -euo pipefail

# ---- settings from the resolved preset (every value shell-quoted at render time)
RUN_DIR=/scratch/runs/golden-run
PY=/opt/miles/venv/bin/python
SCHEDULER=slurm
PRESET_NAME=qwen3.8-27b-128k
EXPECTED_NODES=10
TRAIN_NODES=5
GPUS_PER_NODE=8
IP_MODE=hostname
IP_INTERFACE=''
IP_PREFIX=''
RAY_GCS_PORT=26379
RAY_CLIENT_PORT=26001
RAY_NODE_PORT_BASE=26400
RAY_WORKER_PORT_BASE=27000
RAY_WORKER_PORT_SPAN=1000
RAY_TEMP_BASE=/tmp/miles-ray
RAY_NUM_CPUS=''
RAY_OBJECT_STORE_BYTES=''
RAY_START_TIMEOUT=300.0
GATEWAY_HOST=0.0.0.0
GATEWAY_PORT=8000
DEAD_PROBES=4
PROBE_INTERVAL=30.0
STARTUP_PROBE_INTERVAL=10.0
STARTUP_TIMEOUT=7200.0
DRIVER_CMD=("$PY" -m miles.serve "$RUN_DIR/preset.yaml")
SERVICES_CMD=( )
export RAY_AUTH_MODE=disabled
export RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1

# Slurm only: the local test cluster also sets PBS_* variables, which this script ignores.
JOB_ID=${SLURM_JOB_ID:?this script runs inside a Slurm job (sbatch)}
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
die() { log "ERROR: $*"; exit 1; }
RAY_BIN="$(dirname "$PY")/ray"
[[ -x "$PY" ]] || die "python $PY is not executable: render the script with the python of your miles-hpc install"
[[ -x "$RAY_BIN" ]] || die "ray not found next to $PY ($RAY_BIN): install miles-hpc into that environment"

# ---- teardown: stop only the processes this job started (newest first), never a global `ray stop`
STARTED_PIDS=()
started() { STARTED_PIDS+=("$1"); }

descendants() {
  local child
  for child in $(ps -o pid= --ppid "$1" 2>/dev/null); do
    descendants "$child"
    echo "$child"
  done
}

alive() {
  local pid
  for pid in "$@"; do
    # a zombie has exited: only its parent's wait is missing
    [[ "$(ps -o stat= -p "$pid" 2>/dev/null)" == Z* || -z "$(ps -o pid= -p "$pid" 2>/dev/null)" ]] || return 0
  done
  return 1
}

stop_started() {
  local top=() all=() pid i
  for ((i = ${#STARTED_PIDS[@]} - 1; i >= 0; i--)); do
    pid=${STARTED_PIDS[i]}
    top+=("$pid")
    all+=("$pid" $(descendants "$pid"))
  done
  ((${#top[@]})) || return 0
  # Only what we started: `ray start --block` drains and stops its own raylet/GCS on SIGTERM (signalling
  # those directly can wedge its shutdown), srun forwards the signal to its step. SIGKILL what is left.
  kill -TERM "${top[@]}" 2>/dev/null || true
  for i in $(seq 1 30); do
    alive "${all[@]}" || return 0
    sleep 0.5
  done
  log "teardown: still running after 15 s, sending SIGKILL: $(ps -o pid=,args= -p "$(IFS=,; echo "${all[*]}")" | cut -c1-120 | tr '\n' ';')"
  kill -KILL "${all[@]}" 2>/dev/null || true
}

on_exit() {
  local rc=$?
  trap - EXIT TERM INT
  log "teardown (exit status $rc)"
  stop_started
  # PBS's qstat (and the local cluster's Torque wrapper) may not report an exit status: record it here
  echo "$rc" >"$RUN_DIR/exit_code" 2>/dev/null || true
  log "job done, exit status $rc"
  exit "$rc"
}
trap on_exit EXIT
trap 'log "caught SIGTERM"; exit 143' TERM
trap 'log "caught SIGINT"; exit 130' INT

# ---- facts for the processes this job starts on other nodes (pbsdsh gives them a minimal env)
write_job_env() {
  local name
  {
    echo "# written by the job script; sourced by ray-node.sh on every node"
    for name in PATH RUN_DIR PY RAY_BIN JOB_ID JOB_KEY HEAD HEAD_IP GPUS_PER_NODE RAY_GCS_PORT \
      RAY_CLIENT_PORT RAY_NODE_PORT_BASE RAY_WORKER_PORT_BASE RAY_WORKER_PORT_SPAN RAY_TEMP_BASE \
      RAY_NUM_CPUS RAY_OBJECT_STORE_BYTES RAY_ADDRESS MILES_GATEWAY_URL; do
      printf 'export %s=%q\n' "$name" "${!name}"
    done
    for name in RAY_AUTH_MODE RAY_USAGE_STATS_ENABLED PYTHONUNBUFFERED; do
      printf 'export %s=%q\n' "$name" "${!name}"
    done
  } >"$RUN_DIR/job.env"
}

# ---- the per-node Ray launcher: `ray-node.sh head|worker INDEX IP`; ports are offset by INDEX so
# nodes sharing one host (and jobs with different port plans) never collide
write_ray_node_script() {
  cat >"$RUN_DIR/ray-node.sh" <<'RAY_NODE_EOF'
#!/bin/bash
set -euo pipefail
source "$(dirname "$0")/job.env"
kind=$1 i=$2 ip=$3
ports=$((RAY_NODE_PORT_BASE + 10 * i))
workers=$((RAY_WORKER_PORT_BASE + RAY_WORKER_PORT_SPAN * i))
# CPUs: the preset's ray.num_cpus, else what Slurm gave THIS node's step (not the head's), else its cores
args=(--node-ip-address="$ip" --num-cpus="${RAY_NUM_CPUS:-${SLURM_CPUS_ON_NODE:-$(nproc)}}"
  --num-gpus="$GPUS_PER_NODE" --node-manager-port=$((ports)) --object-manager-port=$((ports + 1))
  --dashboard-agent-listen-port=$((ports + 2)) --dashboard-agent-grpc-port=$((ports + 3))
  --runtime-env-agent-port=$((ports + 4)) --metrics-export-port=$((ports + 5))
  --min-worker-port="$workers" --max-worker-port=$((workers + RAY_WORKER_PORT_SPAN - 1))
  --disable-usage-stats --block)
[[ -z "$RAY_OBJECT_STORE_BYTES" ]] || args+=(--object-store-memory="$RAY_OBJECT_STORE_BYTES")
echo "$(date '+%F %T') ray-node: $kind index $i ip $ip on $(hostname)"
if [[ "$kind" == head ]]; then
  exec "$RAY_BIN" start --head --port="$RAY_GCS_PORT" --ray-client-server-port="$RAY_CLIENT_PORT" \
    --include-dashboard=false --temp-dir="$RAY_TEMP_BASE/$JOB_KEY" "${args[@]}"
else
  exec "$RAY_BIN" start --address="$RAY_ADDRESS" --temp-dir="$RAY_TEMP_BASE/$JOB_KEY-w$i" "${args[@]}"
fi
RAY_NODE_EOF
  chmod +x "$RUN_DIR/ray-node.sh"
}

# ---- interface/prefix modes: each node reports its own IP into the shared run dir
probe_node_ips() {
  local probe_dir="$RUN_DIR/node-ips" node pids=() deadline
  mkdir -p "$probe_dir"
  local probe=("$PY" -m launcher.nodes probe --mode "$IP_MODE" --out "$probe_dir")
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
      ((SECONDS < deadline)) || { kill "${pids[@]}" 2>/dev/null; die "node $node did not report its IP"; }
      sleep 0.5
    done
  done
  wait "${pids[@]}" || true
  for node in "${NODES[@]}"; do cat "$probe_dir/$node"; done >"$NODE_FILE"
}

start_services_when_healthy() {
  # The watchdog creates $RUN_DIR/healthy when healthz first answers 200.
  until [[ -e "$RUN_DIR/healthy" ]]; do sleep 1; done
  log "gateway healthy: starting services: ${SERVICES_CMD[*]}"
  cd "$RUN_DIR"
  exec "${SERVICES_CMD[@]}"
}

# ---- scheduler specifics: node discovery, starting a command on a node, the Ray head
discover_nodes() {
  mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
  ((${#NODES[@]})) || die "scontrol listed no nodes for SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST"
  HEAD=${SLURMD_NODENAME:-${NODES[0]}}
}

# on_node NODE CMD...: always run in the background; exec so that $! is the launcher itself
on_node() {
  local node=$1
  shift
  exec srun --nodes=1 --ntasks=1 --overlap -w "$node" "$@"
}

start_ray_head() {
  on_node "$HEAD" "$RUN_DIR/ray-node.sh" head "$@"
}

# ---- 1. the allocation's nodes
((BASH_VERSINFO[0] > 5 || (BASH_VERSINFO[0] == 5 && BASH_VERSINFO[1] >= 1))) \
  || die "bash >= 5.1 is needed (wait -n -p); this is $BASH_VERSION"
log "job $JOB_ID ($SCHEDULER) preset $PRESET_NAME, run dir $RUN_DIR"
[[ -f "$RUN_DIR/preset.yaml" ]] || die "$RUN_DIR/preset.yaml is missing: submit with \`launcher submit\`"
discover_nodes
log "nodes: ${NODES[*]} (head $HEAD)"
((${#NODES[@]} == EXPECTED_NODES)) \
  || die "the allocation has ${#NODES[@]} nodes but the preset asks for $EXPECTED_NODES"

# ---- 2. node IPs, then roles from the one implementation (launcher.roles): head last
NODE_FILE="$RUN_DIR/nodes.txt"
if [[ "$IP_MODE" == interface || "$IP_MODE" == prefix ]]; then
  probe_node_ips
else
  printf '%s\n' "${NODES[@]}" >"$NODE_FILE"
fi
ROLES_FILE="$RUN_DIR/roles.tsv"
"$PY" -c 'from launcher.cli import main; main()' roles --nodefile "$NODE_FILE" --head "$HEAD" --train-nodes "$TRAIN_NODES" \
  --ip-mode "$IP_MODE" --tsv "$ROLES_FILE" || die "role planning failed (see above)"
ROLE_INDEX=() ROLE_NAME=() ROLE_IP=()
while IFS=$'\t' read -r index name ip roles; do
  ROLE_INDEX+=("$index") ROLE_NAME+=("$name") ROLE_IP+=("$ip")
  [[ ",$roles," != *,head,* ]] || { HEAD_INDEX=$index; HEAD_IP=$ip; }
done < <(tail -n +2 "$ROLES_FILE")

case "$GATEWAY_HOST" in
  0.0.0.0 | :: | '') GATEWAY_ADDR=$HEAD_IP ;;
  *) GATEWAY_ADDR=$GATEWAY_HOST ;;
esac
export MILES_RUN_DIR="$RUN_DIR" MILES_ROLES_FILE="$ROLES_FILE" MILES_HEAD_IP="$HEAD_IP"
export RAY_ADDRESS="$HEAD_IP:$RAY_GCS_PORT" MILES_GATEWAY_URL="http://$GATEWAY_ADDR:$GATEWAY_PORT"
write_job_env
write_ray_node_script

# ---- 3. Ray: the head, then one worker per other node; wait until Ray reports every node
log "ray: head $HEAD at $RAY_ADDRESS, temp dir $RAY_TEMP_BASE/$JOB_KEY"
start_ray_head "$HEAD_INDEX" "$HEAD_IP" >>"$LOGS/ray-head.log" 2>&1 &
started $!
RAY_PIDS=("$!")
for k in "${!ROLE_NAME[@]}"; do
  [[ "${ROLE_INDEX[k]}" != "$HEAD_INDEX" ]] || continue
  on_node "${ROLE_NAME[k]}" "$RUN_DIR/ray-node.sh" worker "${ROLE_INDEX[k]}" "${ROLE_IP[k]}" \
    >>"$LOGS/ray-worker-${ROLE_INDEX[k]}.log" 2>&1 &
  started $!
  RAY_PIDS+=("$!")
done
"$PY" -m launcher.nodes wait-ray --address "$RAY_ADDRESS" --node-ip "$HEAD_IP" --nodes "${#NODES[@]}" \
  --timeout "$RAY_START_TIMEOUT" $(printf -- '--watch-pid %s ' "${RAY_PIDS[@]}") \
  || die "Ray did not form with ${#NODES[@]} nodes (see $LOGS/ray-*.log)"

# ---- 4. the driver, the watchdog, and the services once the gateway is healthy
log "driver: ${DRIVER_CMD[*]}"
(cd "$RUN_DIR" && exec "${DRIVER_CMD[@]}") >>"$LOGS/driver.log" 2>&1 &
DRIVER_PID=$!
started "$DRIVER_PID"
log "watchdog: $MILES_GATEWAY_URL/api/v1/healthz, $DEAD_PROBES consecutive 503s end the job (0 = never)"
"$PY" -m launcher.monitor --url "$MILES_GATEWAY_URL/api/v1/healthz" --dead-probes "$DEAD_PROBES" \
  --interval "$PROBE_INTERVAL" --startup-interval "$STARTUP_PROBE_INTERVAL" \
  --startup-timeout "$STARTUP_TIMEOUT" >>"$LOGS/monitor.log" 2>&1 &
MONITOR_PID=$!
started "$MONITOR_PID"
if ((${#SERVICES_CMD[@]})); then
  start_services_when_healthy >>"$LOGS/services.log" 2>&1 &
  started $!
fi

# ---- 5. the job ends as soon as the driver or the watchdog exits
rc=0
FINISHED=""
wait -n -p FINISHED "$DRIVER_PID" "$MONITOR_PID" || rc=$?
if [[ "$FINISHED" == "$DRIVER_PID" ]]; then
  log "driver exited with status $rc"
else
  case $rc in
    3) log "watchdog: the trainer is dead ($DEAD_PROBES consecutive 503s); ending the job" ;;
    4) log "watchdog: the gateway never became healthy within $STARTUP_TIMEOUT s; ending the job" ;;
    *) log "watchdog exited with status $rc" ;;
  esac
fi
exit "$rc"
