# Shared by the real-engine stages (vllm_cpu.sh, vllm_cache.sh); sourced, not run.
#
#   E2E_NAME=vllm_x; source "$HERE/lib.sh"
#
# Gives: the cached vLLM virtualenv ($VENV, $PY, via install_vllm.sh) and tiny model ($MODEL_DIR),
# free_ports N, group_rss_mb PGID, pdgate_binary, wait_engine NAME PORT PGID, start_gateway
# (pdgate on a free port, ready within GATEWAY_TIMEOUT seconds),
# a work dir ($WORK, kept on failure or with PDGATE_E2E_KEEP_LOGS=1), log(), the process-group
# list PGIDS (every process a stage starts leads its own group; stop_all ends those groups only,
# TERM then KILL after STOP_GRACE seconds), an EXIT trap that stops everything and prints the
# last log lines on failure, and e2e_prepare (install, or exit 77 where vLLM cannot run at all; then build the model).

STOP_GRACE="${STOP_GRACE:-15}"
# shellcheck source-path=SCRIPTDIR
source "$HERE/install_vllm.sh"
MODEL_DIR="$E2E_CACHE/tiny-llama"
PY="$VENV/bin/python"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/pdgate-$E2E_NAME.XXXXXX")"
PGIDS=()

free_ports() {
  "$PY" - "$1" <<'PY'
import random, socket, sys
n = int(sys.argv[1])
try:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = map(int, f.read().split())
except OSError:
    low, high = 32768, 60999
# Outside the kernel's ephemeral range: such a port is never handed to another bind(0) (the
# engines bind many while they load; one took a NIXL side-channel port picked here before the
# engine that was to use it bound it), so it stays free until its user binds it.
lo, hi = (10000, low - 1) if low > 11000 else (high + 1, 65535)
socks, ports = [], []
for _ in range(10000):
    if len(ports) == n:
        break
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", random.randint(lo, hi)))
    except OSError:
        s.close()
        continue
    socks.append(s)
    ports.append(s.getsockname()[1])
if len(ports) < n:
    sys.exit(f"free_ports: found {len(ports)} of {n} free ports in {lo}-{hi}")
print(" ".join(map(str, ports)))
PY
}

# Resident memory of a process group's session, in MB.
group_rss_mb() {
  ps -o rss= --sid "$1" 2>/dev/null | awk '{s += $1} END {printf "%d", s / 1024}'
}

# start_gateway NAME PORT_VAR ARGS_FN [ARGS...]: starts $PDGATE on a free port with the arguments
# `ARGS_FN NAME PORT ARGS...` leaves in GATEWAY_ARGS (they must make it listen on
# 127.0.0.1:PORT), in its own session, logging to $WORK/NAME.log; ready means /ready is 200.
# A port taken between picking and binding (engines open ports of their own) gets another try.
# The port goes to PORT_VAR.
start_gateway() {
  local name=$1 port_var=$2 args_fn=$3
  shift 3
  local attempt port pid deadline
  for attempt in 1 2 3; do
    port=$(free_ports 1)
    "$args_fn" "$name" "$port" "$@"
    setsid "$PDGATE" "${GATEWAY_ARGS[@]}" </dev/null >"$WORK/$name.log" 2>&1 &
    pid=$!
    disown "$pid"
    PGIDS+=("$pid")
    deadline=$((SECONDS + ${GATEWAY_TIMEOUT:-60}))
    until curl -fsS -m 2 -o /dev/null "http://127.0.0.1:$port/ready" 2>/dev/null; do
      if ! kill -0 "$pid" 2>/dev/null || ((SECONDS >= deadline)); then
        break
      fi
      sleep 0.5
    done
    if kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); then
      printf -v "$port_var" '%s' "$port"
      return 0
    fi
    if ! grep -q "Address already in use" "$WORK/$name.log"; then
      break
    fi
    log "gateway $name: port $port was taken meanwhile; trying another (attempt $attempt)"
  done
  log "gateway $name not ready (see $WORK/$name.log)"
  return 1
}

# pdgate_binary: sets PDGATE to $PDGATE_BIN, or to the debug build (built when missing); exits
# when there is none.
pdgate_binary() {
  PDGATE="${PDGATE_BIN:-}"
  if [[ -z "$PDGATE" ]]; then
    PDGATE="${CARGO_TARGET_DIR:-$REPO/target}/debug/pdgate"
    if [[ ! -x "$PDGATE" ]]; then
      log "building pdgate"
      (cd "$REPO" && timeout 1800 cargo build -q -p pdgate --bin pdgate)
    fi
  fi
  if [[ ! -x "$PDGATE" ]]; then
    log "pdgate binary not found at $PDGATE"
    exit 1
  fi
}

# wait_engine NAME PORT PGID: until the engine on PORT serves the tiny model (a busy port may
# answer /health for something else), its process group PGID alive, by ENGINE_DEADLINE (SECONDS).
wait_engine() {
  local name=$1 port=$2 pg=$3
  while ((SECONDS < ENGINE_DEADLINE)); do
    if ! kill -0 "$pg" 2>/dev/null; then
      log "engine $name exited during start-up"
      return 1
    fi
    if curl -fsS -m 5 "http://127.0.0.1:$port/v1/models" 2>/dev/null | grep -q '"id":"tiny"'; then
      return 0
    fi
    sleep 2
  done
  log "engine $name not ready ${START_TIMEOUT}s after start"
  return 1
}

log() { printf '[%s %(%H:%M:%S)T +%ss] %s\n' "$E2E_NAME" -1 "$((SECONDS - T0))" "$*"; }

stop_all() {
  local pg live=()
  for pg in "${PGIDS[@]}"; do
    if kill -0 -- "-$pg" 2>/dev/null; then
      kill -TERM -- "-$pg" 2>/dev/null || true
      live+=("$pg")
    fi
  done
  local deadline=$((SECONDS + STOP_GRACE))
  for pg in "${live[@]}"; do
    while kill -0 -- "-$pg" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.5; done
    kill -KILL -- "-$pg" 2>/dev/null || true
  done
}

on_exit() {
  local rc=$?
  trap - EXIT INT TERM
  stop_all
  # 77 is a skip (nothing ran): no logs to show or keep.
  if ((rc != 0 && rc != 77)); then
    for f in "$WORK"/*.log; do
      [[ -f "$f" ]] || continue
      echo "----- last lines of $(basename "$f") -----"
      tail -n 25 "$f"
    done
  fi
  if [[ "${PDGATE_E2E_KEEP_LOGS:-0}" == 1 || ($rc -ne 0 && $rc -ne 77) ]]; then
    echo "logs kept in $WORK"
  else
    rm -rf "$WORK"
  fi
  log "done in $((SECONDS - T0))s (exit $rc)"
  exit "$rc"
}
trap on_exit EXIT
trap 'exit 130' INT TERM

# vLLM installed, then the tiny model. When vLLM cannot run on this machine at all (install exit
# 77: no wheel for the platform) the stage exits 77 with a summary line naming `summary`: a skip
# that `.ci/run` accepts only because its skip registry lists that reason. Every other failure
# (registry, apt-get, pip, the model build, an engine that does not start) fails the stage.
e2e_prepare() {
  local summary="$1" rc=0
  bash "$HERE/install_vllm.sh" || rc=$?
  if ((rc == 77)); then
    echo "SKIP: $E2E_NAME e2e: vLLM cannot run on this machine (see the install log above)"
    echo "$summary: 0 passed, 0 failed, 1 skipped"
    exit 77
  elif ((rc != 0)); then
    log "vLLM install failed (exit $rc)"
    exit "$rc"
  fi
  if [[ ! -f "$MODEL_DIR/pdgate-tiny-model.json" ]]; then
    log "building tiny model in $MODEL_DIR"
    # No marker file: whatever is there is a build that did not finish.
    rm -rf "$MODEL_DIR" "$MODEL_DIR.tmp"
    HF_HUB_OFFLINE=1 timeout 300 "$PY" "$HERE/make_tiny_model.py" "$MODEL_DIR.tmp" >"$WORK/model.log" 2>&1
    mv "$MODEL_DIR.tmp" "$MODEL_DIR"
  fi
}
