#!/usr/bin/env bash
# bench/fleet.sh: routing policies on a fleet of pdsim engines replaying a production trace
# (on demand, not in CI).
#
# Builds release pdsim, pdgate and pdbench (unless BENCH_SKIP_BUILD=1), then for every rate
# factor, every arm in turn (interleaved: factor by factor, arm by arm, so slow drifts of the
# machine hit every policy alike):
#   1. starts a fresh fleet: `pdsim fleet --prefill N --decode M --connector $BENCH_CONNECTOR ...
#      --gateway-config gw.toml --ready-file ready.json` (its own process group), and waits
#      for the ready file;
#   2. starts pdgate with that config and the arm's policy flags (or a peer router on the
#      fleet's URLs), waits until it answers;
#   3. replays the trace with pdbench (open loop at the recorded times / rate factor / time
#      scale, streamed, SLOs, the fleet's engines read with their roles), JSON to the results;
#   4. stops pdgate and the fleet (TERM to each process group, then waits for every process
#      of the group to exit; KILL after 15 s), so the next arm starts on fresh engines.
# While an arm runs, the CPU time of the gateway, the fleet and pdbench and the machine's busy
# share are read from /proc (proc.tsv): the gateway must not be what limits the measurement.
# Then bench/fleet_charts.py draws SLO attainment vs request rate per policy and the TTFT CDF
# (matplotlib, installed into $PDGATE_CACHE/bench-venv), and prints the table.
#
# Arms (BENCH_ARMS):
#   round_robin         --prefill-policy round_robin   --decode-policy round_robin
#   least_request       --prefill-policy least_request --decode-policy least_request
#   ca_approx           cache_aware on both roles, approximate keys (fleet without KV events)
#   ca_precise          cache_aware on both roles, the fleet publishes KV events (`--kv-events`;
#                       the gateway config it writes subscribes to them); like every pdgate arm
#                       it scrapes the engines' /metrics at the default cache.engine_load_interval
#   ca_precise_own      ca_precise without that scrape (cache.engine_load_interval = 0s: the
#                       gateway sees only the load it sent)
#   ca_precise_affine   ca_precise with the decode of a disaggregated request weighed by the
#                       prefix it holds, as a prefill is (cache.decode_cache_weight = 1; the
#                       default 0 chooses it by its load and the KV it holds)
#   ca_precise_do       ca_precise, and a request with at most BENCH_DECODE_ONLY_BELOW uncached
#                       tokens on its decode is served there alone (--decode-only-below-tokens)
#   ca_precise_x2       ca_precise on two pdgate replicas (same config, each subscribed to every
#                       engine's events), pdbench alternating between them request by request;
#                       each replica scrapes the engines' /metrics every
#                       BENCH_ENGINE_LOAD_INTERVAL (cache.engine_load_interval) to count the
#                       other's load (0s: each sees only its own in-flight load)
#   ca_precise_scrape   ca_precise on one replica with that same interval
#   ca_shed             ca_precise_do, and admission sheds (429) a request whose prefill already
#                       has more than BENCH_SHED_TOKENS predicted tokens queued ahead of it
#                       (cache.max_queued_prefill_tokens; off by default in pdgate)
#   vllm_router         vllm-router $VLLM_ROUTER_VERSION --vllm-pd-disaggregation --kv-connector nixl,
#                       cache_aware on both roles (PyPI, into $PDGATE_CACHE/bench-venv)
#   smg                 SMG $SMG_VERSION `smg launch --pd-disaggregation --backend vllm`, cache_aware on
#                       both roles (PyPI). A decode that gets no KV-transfer parameters
#                       recomputes the prompt: pdbench reports those (pdsim's `recomputed`).
#   Every arm runs against the same kind of fleet (BENCH_CONNECTOR, shfs by default: vLLM's
#   NixlConnector wire format, which vllm-router's `--kv-connector nixl` and SMG speak; pdsim's
#   `nixl` is AWS Neuron's variant).
#   Precise matching needs the gateway to key prompts as the engines' events do (token keys):
#   the precise arms take them from an engine's /tokenize (cache.engine_tokenize, on by default
#   where endpoints publish events; docs/operations.md). Check the precise arms'
#   prefill hit share against ca_approx's: equal or lower means the keys did not match.
#
# Environment (all optional):
#   PDGATE_CACHE        cache root (bench-venv/ for matplotlib)                  [~/.cache/pdgate]
#   CARGO_TARGET_DIR    where the release binaries are built/found               [<repo>/target]
#   BENCH_SKIP_BUILD=1  use the binaries already in $CARGO_TARGET_DIR/release
#   BENCH_OUT           results dir                                  [<repo>/bench/out/fleet-<utc>]
#   BENCH_TRACE         trace file (Mooncake JSONL, gzipped or not)
#                       [crates/pdbench/tests/fixtures/mooncake-synthetic.jsonl.gz]
#   BENCH_PREFILL, BENCH_DECODE   engines per role                                   [8, 8]
#   BENCH_PROFILE       pdsim fleet --profile (empty: no step loop)     [llama-3.1-8b-h100]
#   BENCH_KV_CACHE_BLOCKS  KV-cache blocks per engine (empty: the profile's); the
#                       capacity-bounded oracle takes the fleet's either way (ready file)      []
#   BENCH_BLOCK_SIZE    the engines' block size, for the oracle                          [16]
#   BENCH_TIME_SCALE    simulated seconds per wall second (above 1 a gateway sees that many
#                       times the trace's rate in wall time: keep its CPU in view)        [1]
#   BENCH_RATE_FACTORS  replay speed-ups over the recorded times (8+8: around saturation)
#                                                                                  ["3 4 6"]
#   BENCH_REQUESTS      replay only the first N requests of the trace (empty: all)    [800]
#   BENCH_SLO_TTFT, BENCH_SLO_ITL  objectives in simulated ms                    [2000, 100]
#   BENCH_ARMS          see above                   [the six pdgate arms, vllm_router, smg]
#   BENCH_CONNECTOR     the fleet's KV connector (the peers need shfs)                      [shfs]
#   VLLM_ROUTER_VERSION, SMG_VERSION  the peers' PyPI versions                   [0.1.17, 1.13.*]
#   BENCH_DECODE_ONLY_BELOW  ca_precise_do's threshold (tokens)                          [512]
#   BENCH_ENGINE_LOAD_INTERVAL  ca_precise_x2's and ca_precise_scrape's
#                       cache.engine_load_interval                                    [500ms]
#   BENCH_SHED_TOKENS   ca_shed's bound: about the TTFT objective times one prefill's
#                       throughput (the H100 8B profile: ~20k tokens/s at long contexts)   [32768]
#   BENCH_ARM_TIMEOUT   seconds per pdbench run                                         [1800]
#   BENCH_NICE          niceness of everything started here                              [0]
#   BENCH_PDGATE_ARGS   more flags for every pdgate arm (split on spaces), e.g.
#                       "--set cache.balance_abs=8"                                      [none]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=lib.sh
source "$ROOT/bench/lib.sh"

CACHE="${PDGATE_CACHE:-$HOME/.cache/pdgate}"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
BIN="$TARGET/release"
OUT="${BENCH_OUT:-$ROOT/bench/out/fleet-$(date -u +%Y%m%dT%H%M%SZ)}"
TRACE="${BENCH_TRACE:-$ROOT/crates/pdbench/tests/fixtures/mooncake-synthetic.jsonl.gz}"
PREFILL="${BENCH_PREFILL:-8}"
DECODE="${BENCH_DECODE:-8}"
PROFILE="${BENCH_PROFILE-llama-3.1-8b-h100}"
KV_BLOCKS="${BENCH_KV_CACHE_BLOCKS:-}"
BLOCK_SIZE="${BENCH_BLOCK_SIZE:-16}"
TIME_SCALE="${BENCH_TIME_SCALE:-1}"
RATE_FACTORS="${BENCH_RATE_FACTORS:-3 4 6}"
REQUESTS="${BENCH_REQUESTS:-800}"
SLO_TTFT="${BENCH_SLO_TTFT:-2000}"
SLO_ITL="${BENCH_SLO_ITL:-100}"
ARMS="${BENCH_ARMS:-round_robin least_request ca_approx ca_precise ca_precise_do ca_shed vllm_router smg}"
CONNECTOR="${BENCH_CONNECTOR:-shfs}"
VLLM_ROUTER_VERSION="${VLLM_ROUTER_VERSION:-0.1.17}"
SMG_VERSION="${SMG_VERSION:-1.13.*}"
DECODE_ONLY_BELOW="${BENCH_DECODE_ONLY_BELOW:-512}"
SHED_TOKENS="${BENCH_SHED_TOKENS:-32768}"
ENGINE_LOAD_INTERVAL="${BENCH_ENGINE_LOAD_INTERVAL:-500ms}"
ARM_TIMEOUT="${BENCH_ARM_TIMEOUT:-1800}"
NICE=(nice -n "${BENCH_NICE:-0}")
BENCH_VENV="$CACHE/bench-venv"
LOGS="$OUT/logs"
mkdir -p "$OUT" "$LOGS"

log() { printf '%s fleet.sh: %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

[[ -f "$TRACE" ]] || { log "no trace at $TRACE (set BENCH_TRACE)"; exit 2; }

# ---- processes: each in its own session, stopped by its process-group id ---------------------
PGIDS=()
stop_pg() {
  local pg=$1 i
  kill -TERM -- "-$pg" 2>/dev/null || return 0
  # Every process of the group must be gone (the fleet's engines hold ports and memory).
  for i in $(seq 1 30); do
    kill -0 -- "-$pg" 2>/dev/null || return 0
    sleep 0.5
  done
  log "process group $pg still running after 15 s: KILL"
  kill -KILL -- "-$pg" 2>/dev/null || true
  for i in $(seq 1 20); do
    kill -0 -- "-$pg" 2>/dev/null || return 0
    sleep 0.25
  done
}
cleanup() {
  local pg
  for pg in "${PGIDS[@]}"; do stop_pg "$pg"; done
  log "stopped everything; results in $OUT"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# spawn LOGNAME CMD...: runs CMD in a new session (its own process group); sets LAST_PG.
spawn() {
  local name=$1
  shift
  setsid "${NICE[@]}" "$@" </dev/null >"$LOGS/$name.log" 2>&1 &
  LAST_PG=$!
  disown "$LAST_PG"
  PGIDS+=("$LAST_PG")
}

forget_pg() {
  local pg=$1 kept=() p
  for p in "${PGIDS[@]}"; do [[ $p == "$pg" ]] || kept+=("$p"); done
  PGIDS=("${kept[@]}")
}

# cpu_ticks PGID: utime+stime (clock ticks) of every live process of a session.
cpu_ticks() {
  local pid total=0 t
  for pid in $(ps -o pid= --sid "$1" 2>/dev/null); do
    t=$(awk '{print $14 + $15}' "/proc/$pid/stat" 2>/dev/null || echo 0)
    total=$((total + t))
  done
  echo "$total"
}
# gw2_ticks PGID: cpu_ticks of a second gateway replica, 0 when there is none.
gw2_ticks() { if [[ -n $1 ]]; then cpu_ticks "$1"; else echo 0; fi; }
# machine_ticks: "busy total" clock ticks of all CPUs from /proc/stat.
machine_ticks() { awk '/^cpu / {b = $2 + $3 + $4 + $7 + $8 + $9; t = b + $5 + $6; print b, t}' /proc/stat; }
CLK_TCK=$(getconf CLK_TCK)
CORES=$(nproc)

# ---- build --------------------------------------------------------------------------------
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
if [[ "${BENCH_SKIP_BUILD:-0}" != 1 ]]; then
  log "building release pdsim, pdgate, pdbench (log: $LOGS/build.log)"
  (cd "$ROOT" && CARGO_TARGET_DIR="$TARGET" timeout 3600 "${NICE[@]}" \
    cargo build --release -p pdsim -p pdgate -p pdbench --bins) >"$LOGS/build.log" 2>&1 ||
    { log "build failed"; tail -n 30 "$LOGS/build.log" >&2; exit 1; }
fi
for b in pdsim pdgate pdbench; do
  [[ -x "$BIN/$b" ]] || { log "missing $BIN/$b"; exit 1; }
done
"$BIN/pdsim" fleet --help >/dev/null 2>&1 || { log "$BIN/pdsim has no 'fleet' subcommand"; exit 1; }

# matplotlib draws the charts; without it (no registry) the run still prints its table.
ensure_matplotlib "$BENCH_VENV" "$LOGS" || true
want_peers() { [[ " $ARMS " == *" vllm_router "* || " $ARMS " == *" smg "* ]]; }
if want_peers && ! ensure_peers "$BENCH_VENV" "$LOGS"; then
  log "leaving the vllm_router and smg arms out"
  ARMS="$(for a in $ARMS; do [[ $a == vllm_router || $a == smg ]] || echo "$a"; done | xargs)"
fi

{
  echo "# bench/fleet.sh $(date -u +%Y-%m-%dT%H:%M:%SZ) commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo "trace=$TRACE prefill=$PREFILL decode=$DECODE profile=${PROFILE:-default} kv_cache_blocks=${KV_BLOCKS:-default}"
  echo "time_scale=$TIME_SCALE rate_factors=$RATE_FACTORS requests=${REQUESTS:-all} slo_ttft=$SLO_TTFT slo_itl=$SLO_ITL"
  echo "arms=$ARMS connector=$CONNECTOR decode_only_below=$DECODE_ONLY_BELOW shed_tokens=$SHED_TOKENS engine_load_interval=$ENGINE_LOAD_INTERVAL machine: $CORES CPUs, $(uname -r)"
} >"$OUT/params.txt"
printf 'arm\trate_factor\twall_s\tgateway_cpu_s\tfleet_cpu_s\tpdbench_cpu_s\tmachine_busy\n' >"$OUT/proc.tsv"

# ---- one arm ------------------------------------------------------------------------------
# start_fleet DIR EVENTS(0|1): a fresh fleet; sets FLEET_PG.
start_fleet() {
  local dir=$1 events=$2 args=(--prefill "$PREFILL" --decode "$DECODE" --connector "$CONNECTOR"
    --time-scale "$TIME_SCALE" --gateway-config "$dir/gw.toml" --ready-file "$dir/ready.json")
  [[ -n $PROFILE ]] && args+=(--profile "$PROFILE")
  [[ -n $KV_BLOCKS ]] && args+=(--kv-cache-blocks "$KV_BLOCKS")
  ((events)) && args+=(--kv-events)
  rm -f "$dir/ready.json"
  spawn "$(basename "$dir")-fleet" env RUST_LOG=warn "$BIN/pdsim" fleet "${args[@]}"
  FLEET_PG=$LAST_PG
  local deadline=$((SECONDS + 120))
  until [[ -s "$dir/ready.json" ]]; do
    if ! kill -0 "$FLEET_PG" 2>/dev/null || ((SECONDS > deadline)); then
      log "the fleet did not become ready (see $LOGS/$(basename "$dir")-fleet.log)"
      tail -n 15 "$LOGS/$(basename "$dir")-fleet.log" >&2
      return 1
    fi
    sleep 0.2
  done
}

# json_urls FILE ROLE: the role's engine URLs from a fleet's ready file, one per line.
json_urls() { python3 -c 'import json, sys; print("\n".join(json.load(open(sys.argv[1]))[sys.argv[2]]))' "$1" "$2"; }

# Precise arms key prompts by the engines' own tokens: pdsim's word tokenizer has no
# tokenizer.json, so the gateway asks an engine's /tokenize (cache.engine_tokenize, on by default
# for endpoints with KV events). A trace prompt is up to 128k words: the bound on that round trip
# is raised from its 50 ms default so a busy machine does not fall back to approximate keys.
PRECISE_KEYS=(--set cache.engine_tokenize_timeout=500ms)

# run_arm ARM FACTOR: fleet, gateway, replay, stop; results in $OUT/ARM-rFACTOR.json.
run_arm() {
  local arm=$1 factor=$2 name="$1-r$2" dir="$OUT/$1-r$2" events=0 port policy="" flags=()
  mkdir -p "$dir"
  # shellcheck disable=SC2206 # word splitting is the point
  flags+=(${BENCH_PDGATE_ARGS:-})
  case "$arm" in
    round_robin | least_request) policy=$arm ;;
    ca_approx) policy=cache_aware ;;
    ca_precise) policy=cache_aware events=1 flags+=("${PRECISE_KEYS[@]}") ;;
    ca_precise_own)
      policy=cache_aware events=1
      flags+=("${PRECISE_KEYS[@]}" --set cache.engine_load_interval=0s)
      ;;
    ca_precise_affine)
      policy=cache_aware events=1
      flags+=("${PRECISE_KEYS[@]}" --set cache.decode_cache_weight=1)
      ;;
    ca_precise_x2 | ca_precise_scrape)
      policy=cache_aware events=1
      flags+=("${PRECISE_KEYS[@]}" --set "cache.engine_load_interval=$ENGINE_LOAD_INTERVAL")
      ;;
    ca_precise_do)
      policy=cache_aware events=1
      flags+=("${PRECISE_KEYS[@]}" --decode-only-below-tokens "$DECODE_ONLY_BELOW")
      ;;
    ca_shed)
      policy=cache_aware events=1
      flags+=("${PRECISE_KEYS[@]}" --decode-only-below-tokens "$DECODE_ONLY_BELOW"
        --set "cache.max_queued_prefill_tokens=$SHED_TOKENS")
      ;;
    vllm_router | smg) ;;
    *) log "unknown arm $arm"; return 1 ;;
  esac
  start_fleet "$dir" "$events" || return 1
  port=$(free_port)
  local ready_path=/ready peer=() urls="http://127.0.0.1:$port" gw_pg gw2_pg=""
  if [[ -n $policy ]]; then
    spawn "$name-gateway" env RUST_LOG=warn "$BIN/pdgate" --config "$dir/gw.toml" \
      --listen "127.0.0.1:$port" --prefill-policy "$policy" --decode-policy "$policy" "${flags[@]}"
    gw_pg=$LAST_PG
    if [[ $arm == *_x2 ]]; then
      local port2
      port2=$(free_port)
      spawn "$name-gateway2" env RUST_LOG=warn "$BIN/pdgate" --config "$dir/gw.toml" \
        --listen "127.0.0.1:$port2" --prefill-policy "$policy" --decode-policy "$policy" "${flags[@]}"
      gw2_pg=$LAST_PG
      urls+=",http://127.0.0.1:$port2"
      if ! wait_http "http://127.0.0.1:$port2$ready_path" 120; then
        tail -n 15 "$LOGS/$name-gateway2.log" >&2
        stop_pg "$gw2_pg"; forget_pg "$gw2_pg"; gw2_pg=""
        urls="http://127.0.0.1:$port"
        log "$name: the second replica did not become ready; one replica only"
      fi
    fi
  else
    # The peers take the fleet's URLs from its ready file.
    local u
    for u in $(json_urls "$dir/ready.json" prefill); do peer+=(--prefill "$u"); done
    for u in $(json_urls "$dir/ready.json" decode); do peer+=(--decode "$u"); done
    ready_path=/health
    if [[ $arm == vllm_router ]]; then
      spawn "$name-gateway" "$BENCH_VENV/bin/vllm-router" --vllm-pd-disaggregation "${peer[@]}" \
        --kv-connector nixl --prefill-policy cache_aware --decode-policy cache_aware \
        --host 127.0.0.1 --port "$port" --prometheus-port "$(free_port)" \
        --log-level warning --worker-startup-check-interval 1
    else
      spawn "$name-gateway" "$BENCH_VENV/bin/smg" launch --pd-disaggregation --backend vllm "${peer[@]}" \
        --prefill-policy cache_aware --decode-policy cache_aware \
        --host 127.0.0.1 --port "$port" --prometheus-port "$(free_port)" --log-level warn
    fi
    gw_pg=$LAST_PG
  fi
  if ! wait_http "http://127.0.0.1:$port$ready_path" 120; then
    tail -n 15 "$LOGS/$name-gateway.log" >&2
    stop_pg "$gw_pg"; forget_pg "$gw_pg"; stop_pg "$FLEET_PG"; forget_pg "$FLEET_PG"
    if [[ -n $gw2_pg ]]; then stop_pg "$gw2_pg"; forget_pg "$gw2_pg"; fi
    return 1
  fi
  local bench=(--url "$urls" --trace-file "$TRACE" --rate-factor "$factor"
    --time-scale "$TIME_SCALE" --stream --slo-ttft "$SLO_TTFT" --slo-itl "$SLO_ITL"
    --fleet "$dir/ready.json" --oracle-block-size "$BLOCK_SIZE" --timeout 600 --json)
  [[ -n $KV_BLOCKS ]] && bench+=(--oracle-cache-blocks "$KV_BLOCKS")
  [[ -n $REQUESTS ]] && bench+=(--requests "$REQUESTS")
  log "$name: replaying (${factor}x recorded, time scale $TIME_SCALE)"
  local g0 f0 m0 t0 g1 f1 m1 rc=0
  g0=$(($(cpu_ticks "$gw_pg") + $(gw2_ticks "$gw2_pg"))) f0=$(cpu_ticks "$FLEET_PG") m0=$(machine_ticks) t0=$(date +%s.%N)
  local b0
  b0=$(awk '{print $16 + $17}' "/proc/$$/stat")
  # pdbench runs in the foreground; its CPU is this shell's waited-for children's (cutime+cstime).
  timeout "$ARM_TIMEOUT" "${NICE[@]}" "$BIN/pdbench" "${bench[@]}" >"$OUT/$name.json" 2>"$LOGS/$name-pdbench.log" || rc=$?
  g1=$(($(cpu_ticks "$gw_pg") + $(gw2_ticks "$gw2_pg"))) f1=$(cpu_ticks "$FLEET_PG") m1=$(machine_ticks)
  local wall b1
  wall=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.3f", b - a }')
  b1=$(awk '{print $16 + $17}' "/proc/$$/stat")
  awk -v arm="$arm" -v f="$factor" -v w="$wall" -v g="$((g1 - g0))" -v fl="$((f1 - f0))" \
    -v b="$((b1 - b0))" -v h="$CLK_TCK" -v m0="$m0" -v m1="$m1" 'BEGIN {
      split(m0, a, " "); split(m1, c, " ");
      busy = (c[2] > a[2]) ? (c[1] - a[1]) / (c[2] - a[2]) : 0;
      printf "%s\t%s\t%s\t%.2f\t%.2f\t%.2f\t%.3f\n", arm, f, w, g / h, fl / h, b / h, busy }' >>"$OUT/proc.tsv"
  ((rc == 0)) || log "$name: pdbench exited $rc (see $LOGS/$name-pdbench.log)"
  stop_pg "$gw_pg"; forget_pg "$gw_pg"
  if [[ -n $gw2_pg ]]; then stop_pg "$gw2_pg"; forget_pg "$gw2_pg"; fi
  stop_pg "$FLEET_PG"; forget_pg "$FLEET_PG"
}

T0=$SECONDS
for factor in $RATE_FACTORS; do
  for arm in $ARMS; do
    run_arm "$arm" "$factor" || log "$arm at ${factor}x failed; going on"
  done
done
log "all arms done in $((SECONDS - T0)) s"

PY=python3
[[ -x "$BENCH_VENV/bin/python" ]] && PY="$BENCH_VENV/bin/python"
"$PY" "$ROOT/bench/fleet_charts.py" "$OUT" | tee "$OUT/table.md" || log "charts failed (no matplotlib?)"
