#!/usr/bin/env bash
# servetune's local stack on one machine: PostgreSQL, an MLflow server backed by it (with an
# artifact store directory), a Ray head and one Ray worker node per GPU type.
#
#   bash infra/local/stack.sh up       # start everything, write $SERVETUNE_STACK_DIR/stack.env
#   source servetune-stack/stack.env   # RAY_ADDRESS, MLFLOW_TRACKING_URI, OPTUNA_STORAGE
#   bash infra/local/stack.sh status
#   bash infra/local/stack.sh down     # stop exactly what `up` started (recorded process groups)
#
# Settings (environment):
#   SERVETUNE_STACK_DIR        state, logs, PostgreSQL data, MLflow artifacts (default ./servetune-stack)
#   SERVETUNE_STACK_WORKERS    Ray worker nodes as GPU_TYPE:LOGICAL_GPUS, space separated
#                              (default "H200:2 A100-40GB:1"); each node advertises servetune's
#                              accelerator resource for its type (servetune.cluster.pool.accelerator_resource)
#   SERVETUNE_STACK_NUM_CPUS   CPUs each Ray node declares (default 1)
#   SERVETUNE_STACK_DASHBOARD  1: start the Ray dashboard (and job server: `ray job submit` needs it
#                              and ray[default]); 0: not (default 1)
#   SERVETUNE_STACK_PG_PORT, SERVETUNE_STACK_MLFLOW_PORT, SERVETUNE_STACK_RAY_PORT
#                              fixed ports (default: free ones, picked at `up`)
#   SERVETUNE_STACK_PGDATA     PostgreSQL data directory (default $SERVETUNE_STACK_DIR/pgdata)
#   PYTHON                     the Python with servetune's dependencies (default: python3 on PATH)
#   PG_BIN                     PostgreSQL's bin directory (default: the newest /usr/lib/postgresql/*/bin)
#
# Everything binds 127.0.0.1. PostgreSQL trusts connections from 127.0.0.1 (as the MLflow server
# and Ray do: loopback only, no credentials to leak into spec files). Each long-running process
# starts in its own session, and `down` signals exactly those process groups, never another Ray,
# MLflow or PostgreSQL on the machine. Data (PostgreSQL, artifacts) survives `down`; delete
# $SERVETUNE_STACK_DIR to start afresh.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
STACK_DIR=${SERVETUNE_STACK_DIR:-$PWD/servetune-stack}
WORKERS=${SERVETUNE_STACK_WORKERS:-"H200:2 A100-40GB:1"}
NUM_CPUS=${SERVETUNE_STACK_NUM_CPUS:-1}
DASHBOARD=${SERVETUNE_STACK_DASHBOARD:-1}
STATE="$STACK_DIR/stack.state"   # "NAME PGID" per started process group, in start order
ENV_FILE="$STACK_DIR/stack.env"
LOGS="$STACK_DIR/logs"
DB_USER=servetune

die() { printf 'stack.sh: %s\n' "$*" >&2; exit 1; }
note() { printf 'stack.sh: %s\n' "$*"; }

python_exe() {
  local py=${PYTHON:-python3}
  command -v "$py" >/dev/null 2>&1 || die "no Python '$py': set PYTHON to the interpreter with servetune's dependencies"
  "$py" -c 'import sys; print(sys.executable)'
}

pg_bin() {
  if [[ -n ${PG_BIN:-} ]]; then
    [[ -x $PG_BIN/postgres ]] || die "PG_BIN=$PG_BIN has no postgres binary"
    printf '%s\n' "$PG_BIN"; return
  fi
  local dir best="" best_v=-1 v
  for dir in /usr/lib/postgresql/*/bin; do
    v=$(basename "$(dirname "$dir")")
    [[ -x $dir/postgres && $v =~ ^[0-9]+$ ]] || continue
    if (( v > best_v )); then best=$dir; best_v=$v; fi
  done
  if [[ -z $best ]] && command -v postgres >/dev/null 2>&1; then best=$(dirname "$(command -v postgres)"); fi
  [[ -n $best ]] || die "PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/postgres): apt-get install postgresql, or set PG_BIN"
  printf '%s\n' "$best"
}

# Run a PostgreSQL server binary: postgres refuses to run as root, so as root it runs as the
# `postgres` system user (which the Debian package creates).
as_pg_user() {
  if (( EUID == 0 )); then runuser -u postgres -- "$@"; else "$@"; fi
}

free_ports() {  # N -> N distinct free TCP ports on 127.0.0.1, held open together while picked
  "$PY" - "$1" <<'EOF'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}

group_alive() { kill -0 -- "-$1" 2>/dev/null; }

# start_group NAME LOG CMD... : CMD in a new session (its pid is its process group id), recorded.
start_group() {
  local name=$1 log=$2 pid pgid; shift 2
  setsid "$@" >"$log" 2>&1 </dev/null &
  pid=$!
  pgid=$(ps -o pgid= -p "$pid" | tr -d ' ') || pgid=""
  # setsid execs in place when its caller is not a group leader (always so here); check, so that
  # `down` never signals a group it did not create.
  if [[ $pgid != "$pid" ]]; then
    sleep 0.2; pgid=$(ps -o pgid= -p "$pid" | tr -d ' ') || pgid=""
  fi
  [[ $pgid == "$pid" ]] || die "$name did not start in its own process group (pid $pid, pgid ${pgid:-gone}); see $log"
  printf '%s %s\n' "$name" "$pid" >>"$STATE"
}

wait_port() {  # NAME PORT PGID SECONDS LOG
  local name=$1 port=$2 pgid=$3 deadline=$((SECONDS + $4)) log=$5
  until (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; do
    group_alive "$pgid" || die "$name exited; last lines of $log:$(printf '\n'; tail -n 20 "$log")"
    (( SECONDS < deadline )) || die "$name did not listen on 127.0.0.1:$port within $4 s; see $log"
    sleep 0.2
  done
}

wait_ray_node() {  # NAME PGID LOG: `ray start --block` logs this line once its node has registered
  local name=$1 pgid=$2 log=$3 deadline=$((SECONDS + 90))
  until grep -q 'Ray runtime started' "$log" 2>/dev/null; do
    group_alive "$pgid" || die "$name exited; last lines of $log:$(printf '\n'; tail -n 20 "$log")"
    (( SECONDS < deadline )) || die "$name did not start within 90 s; see $log"
    sleep 0.3
  done
}

last_pgid() { tail -n 1 "$STATE" | cut -d' ' -f2; }

cmd_up() {
  if [[ -s $STATE ]]; then
    local name pgid
    while read -r name pgid; do
      group_alive "$pgid" && die "the stack in $STACK_DIR is running ($name, process group $pgid): run 'stack.sh down' first"
    done <"$STATE"
    rm -f "$STATE"
  fi
  # Parse the worker list before starting anything: a bad entry fails here.
  local -a gpu_types=() gpu_counts=()
  local entry
  local -a entries
  read -r -a entries <<<"$WORKERS"   # split on blanks, no globbing
  for entry in "${entries[@]}"; do
    [[ $entry =~ ^([A-Za-z0-9._-]+):([0-9]+)$ ]] || die "SERVETUNE_STACK_WORKERS entry '$entry': expected GPU_TYPE:COUNT, e.g. H200:2"
    gpu_types+=("${BASH_REMATCH[1]}"); gpu_counts+=("${BASH_REMATCH[2]}")
  done
  [[ $NUM_CPUS =~ ^[0-9]+$ ]] || die "SERVETUNE_STACK_NUM_CPUS must be a whole number, got '$NUM_CPUS'"
  PY=$(python_exe)
  local bin; bin=$(dirname "$PY")
  local ray_cli=$bin/ray
  [[ -x $ray_cli ]] || die "no ray CLI beside $PY: install servetune's dependencies into that environment"
  local pgbin; pgbin=$(pg_bin)
  local pgdata=${SERVETUNE_STACK_PGDATA:-$STACK_DIR/pgdata}

  # Each node's --resources: servetune's own spelling of its accelerator (one call for all types).
  local -a gpu_resources
  mapfile -t gpu_resources < <(PYTHONPATH="$REPO/platform" "$PY" -c '
import json, sys
from servetune.cluster.pool import accelerator_resource
for gpu_type in sys.argv[1:]:
    print(json.dumps({accelerator_resource(gpu_type): 1}))' "${gpu_types[@]}")
  (( ${#gpu_resources[@]} == ${#gpu_types[@]} )) || die "could not import servetune.cluster.pool with $PY"

  mkdir -p "$STACK_DIR" "$LOGS" "$STACK_DIR/mlartifacts"
  : >"$STATE"
  # Any failure from here on (a `die` included) stops what was started, so nothing is left behind.
  trap 'rc=$?; if (( rc != 0 )); then note "start-up failed: stopping what was started"; cmd_down >/dev/null 2>&1 || true; fi' EXIT
  local n_nodes=$((1 + ${#gpu_types[@]}))
  local -a ports
  read -r -a ports <<<"$(free_ports $((4 + 7 * n_nodes)))"
  local pg_port=${SERVETUNE_STACK_PG_PORT:-${ports[0]}}
  local mlflow_port=${SERVETUNE_STACK_MLFLOW_PORT:-${ports[1]}}
  local ray_port=${SERVETUNE_STACK_RAY_PORT:-${ports[2]}}
  local next_port=3
  local port
  for port in "$pg_port" "$mlflow_port" "$ray_port"; do
    ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null || die "port $port on 127.0.0.1 is in use: choose another"
  done

  # --- PostgreSQL: one cluster, databases `mlflow` and `optuna`, TCP on 127.0.0.1 only.
  if [[ ! -s $pgdata/PG_VERSION ]]; then
    mkdir -p "$pgdata"
    if (( EUID == 0 )); then
      chown postgres: "$pgdata"
      runuser -u postgres -- test -w "$pgdata" \
        || die "the postgres user cannot reach $pgdata: set SERVETUNE_STACK_PGDATA to a directory it can (e.g. under /tmp)"
    fi
    chmod 700 "$pgdata"
    as_pg_user "$pgbin/initdb" -D "$pgdata" -U "$DB_USER" --auth-host=trust --auth-local=peer \
      --encoding=UTF8 >"$LOGS/initdb.log" 2>&1 || die "initdb failed; see $LOGS/initdb.log"
  fi
  # -k '': no Unix socket (its path could exceed the limit, and TCP on loopback is all we need).
  if (( EUID == 0 )); then
    start_group postgres "$LOGS/postgres.log" runuser -u postgres -- "$pgbin/postgres" -D "$pgdata" \
      -h 127.0.0.1 -p "$pg_port" -k ''
  else
    start_group postgres "$LOGS/postgres.log" "$pgbin/postgres" -D "$pgdata" -h 127.0.0.1 -p "$pg_port" -k ''
  fi
  wait_port PostgreSQL "$pg_port" "$(last_pgid)" 30 "$LOGS/postgres.log"
  local deadline=$((SECONDS + 30))
  until "$pgbin/pg_isready" -q -h 127.0.0.1 -p "$pg_port"; do
    (( SECONDS < deadline )) || die "PostgreSQL did not accept connections; see $LOGS/postgres.log"
    sleep 0.2
  done
  local db
  for db in mlflow optuna; do
    if [[ $("$pgbin/psql" -h 127.0.0.1 -p "$pg_port" -U "$DB_USER" -d postgres -tAc \
            "SELECT 1 FROM pg_database WHERE datname = '$db'") != 1 ]]; then
      "$pgbin/psql" -q -h 127.0.0.1 -p "$pg_port" -U "$DB_USER" -d postgres -c "CREATE DATABASE $db" \
        || die "could not create database $db"
    fi
  done

  # --- MLflow on PostgreSQL, artifacts proxied by the server into $STACK_DIR/mlartifacts.
  PATH="$bin:$PATH" MLFLOW_BACKEND_STORE_URI="postgresql+psycopg://$DB_USER@127.0.0.1:$pg_port/mlflow" \
    MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false MLFLOW_DISABLE_TELEMETRY=true \
    start_group mlflow "$LOGS/mlflow.log" bash "$REPO/infra/local/mlflow-server.sh" "$STACK_DIR" "$mlflow_port"

  # --- Ray: a head without GPUs, then one node per GPU type with logical GPUs and its resource.
  local ray_temp; ray_temp=$(mktemp -d /tmp/st-ray.XXXXXX)  # short: Ray's socket paths have a limit
  printf '%s\n' "$ray_temp" >"$STACK_DIR/ray_temp_dir"
  export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
  local -a node_ports
  node_flags() {  # every port a node binds must be its own: several nodes share this host
    node_ports=()
    local flag
    for flag in --node-manager-port --object-manager-port --metrics-export-port \
                --dashboard-agent-listen-port --dashboard-agent-grpc-port --runtime-env-agent-port; do
      node_ports+=("$flag" "${ports[next_port]}"); next_port=$((next_port + 1))
    done
  }
  node_flags
  local -a head=("$ray_cli" start --head --block --port "$ray_port"
                 --temp-dir "$ray_temp" --num-cpus "$NUM_CPUS" --num-gpus 0 --disable-usage-stats
                 --ray-client-server-port "${ports[next_port]}" "${node_ports[@]}")
  next_port=$((next_port + 1))
  # Even without the dashboard Ray starts its head process on the dashboard port: always our own.
  local dashboard_port=${ports[next_port]}
  next_port=$((next_port + 1))
  head+=(--dashboard-host 127.0.0.1 --dashboard-port "$dashboard_port")
  if [[ $DASHBOARD == 1 ]]; then head+=(--include-dashboard=true); else head+=(--include-dashboard=false); fi
  start_group ray-head "$LOGS/ray-head.log" "${head[@]}"
  wait_ray_node "Ray head" "$(last_pgid)" "$LOGS/ray-head.log"
  local i
  for i in "${!gpu_types[@]}"; do
    node_flags
    start_group "ray-worker-${gpu_types[i]}" "$LOGS/ray-worker-$i.log" "$ray_cli" start --block \
      --address "127.0.0.1:$ray_port" --num-cpus "$NUM_CPUS" \
      --num-gpus "${gpu_counts[i]}" --resources "${gpu_resources[i]}" --disable-usage-stats "${node_ports[@]}"
    # One node at a time: nodes starting together on a small machine time out registering.
    wait_ray_node "Ray worker ${gpu_types[i]}" "$(last_pgid)" "$LOGS/ray-worker-$i.log"
  done

  # --- Wait until MLflow answers /health and every Ray node has joined with its resources.
  PYTHONPATH="$REPO/platform" "$PY" - "$mlflow_port" "127.0.0.1:$ray_port" "$n_nodes" <<'EOF' \
    || die "the stack did not come up; logs in $LOGS"
import sys, time, urllib.request
import ray
port, address, n_nodes = sys.argv[1], sys.argv[2], int(sys.argv[3])
deadline = time.monotonic() + 120
while True:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            if r.status == 200:
                break
    except OSError:
        pass
    if time.monotonic() > deadline:
        sys.exit("MLflow did not answer /health")
    time.sleep(0.5)
ray.init(address=address, log_to_driver=False, configure_logging=False)
while len([n for n in ray.nodes() if n["Alive"]]) < n_nodes:
    if time.monotonic() > deadline:
        sys.exit(f"Ray: {len([n for n in ray.nodes() if n['Alive']])} of {n_nodes} nodes joined")
    time.sleep(0.5)
EOF
  trap - EXIT

  umask 077
  {
    printf '# servetune local stack (%s); `source` it. Stop with: bash infra/local/stack.sh down\n' "$STACK_DIR"
    printf 'export RAY_ADDRESS=127.0.0.1:%s\n' "$ray_port"
    printf 'export RAY_AUTH_MODE=disabled\n'
    printf 'export MLFLOW_TRACKING_URI=http://127.0.0.1:%s\n' "$mlflow_port"
    printf '# For a study spec: storage: {optuna_url: $OPTUNA_STORAGE}, tracking: {mlflow_uri: $MLFLOW_TRACKING_URI}\n'
    printf 'export OPTUNA_STORAGE=postgresql+psycopg://%s@127.0.0.1:%s/optuna\n' "$DB_USER" "$pg_port"
    if [[ $DASHBOARD == 1 ]]; then printf 'export RAY_API_SERVER_ADDRESS=http://127.0.0.1:%s   # ray job submit\n' "$dashboard_port"; fi
  } >"$ENV_FILE"
  note "up: PostgreSQL 127.0.0.1:$pg_port, MLflow http://127.0.0.1:$mlflow_port, Ray 127.0.0.1:$ray_port" \
       "(head + ${#gpu_types[@]} worker nodes: $WORKERS)"
  note "environment: source $ENV_FILE"
}

# stop_groups SIGNAL GRACE_S INDEX...: signal the recorded groups names[i]/pgids[i], SIGKILL what
# is still there after GRACE_S seconds.
stop_groups() {
  local sig=$1 grace=$2 i alive; shift 2
  for i in "$@"; do group_alive "${pgids[i]}" && kill "-$sig" -- "-${pgids[i]}" 2>/dev/null; done
  local deadline=$((SECONDS + grace))
  while (( SECONDS < deadline )); do
    alive=0
    for i in "$@"; do group_alive "${pgids[i]}" && alive=1; done
    (( alive )) || return 0
    sleep 0.2
  done
  for i in "$@"; do
    if group_alive "${pgids[i]}"; then
      note "${names[i]} (process group ${pgids[i]}) still running after ${grace} s: SIGKILL"
      kill -KILL -- "-${pgids[i]}" 2>/dev/null || true
    fi
  done
  sleep 0.2
}

cmd_down() {
  [[ -s $STATE ]] || { note "nothing recorded in $STATE: nothing to stop"; return 0; }
  local -a names=() pgids=()
  local name pgid i
  while read -r name pgid; do
    [[ $pgid =~ ^[0-9]+$ ]] || continue
    names+=("$name"); pgids+=("$pgid")
  done <"$STATE"
  # Ray nodes together (their state is this session's only: the temp dir goes below, so a head
  # that shrugs SIGTERM off, as its GCS does for 15 s and more, gets 3 s); then MLflow; then
  # PostgreSQL, once its clients are gone, with SIGINT (its fast shutdown; SIGTERM waits for clients).
  local ray_idx=() other
  for i in "${!names[@]}"; do [[ ${names[i]} == ray-* ]] && ray_idx+=("$i"); done
  stop_groups TERM 3 "${ray_idx[@]}"
  for other in mlflow postgres; do
    for i in "${!names[@]}"; do
      [[ ${names[i]} == "$other" ]] || continue
      if [[ $other == postgres ]]; then stop_groups INT 15 "$i"; else stop_groups TERM 15 "$i"; fi
    done
  done
  local left=()
  for i in "${!pgids[@]}"; do group_alive "${pgids[i]}" && left+=("${names[i]}:${pgids[i]}"); done
  (( ${#left[@]} == 0 )) || die "still running: ${left[*]}"
  if [[ -s $STACK_DIR/ray_temp_dir ]]; then
    local ray_temp; ray_temp=$(<"$STACK_DIR/ray_temp_dir")
    [[ $ray_temp == /tmp/st-ray.* ]] && rm -rf -- "$ray_temp"
    rm -f "$STACK_DIR/ray_temp_dir"
  fi
  rm -f "$STATE" "$ENV_FILE"
  note "down: stopped ${#pgids[@]} process groups (data kept in $STACK_DIR)"
}

cmd_status() {
  [[ -s $STATE ]] || { note "not running (no $STATE)"; return 1; }
  local name pgid rc=0
  while read -r name pgid; do
    if group_alive "$pgid"; then note "$name: running (process group $pgid)"
    else note "$name: NOT running (process group $pgid)"; rc=1; fi
  done <"$STATE"
  [[ -s $ENV_FILE ]] && cat "$ENV_FILE"
  return "$rc"
}

case ${1:-} in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  *) printf 'usage: %s up|down|status   (settings: see the comment at the top of this file)\n' "$0" >&2; exit 2 ;;
esac
