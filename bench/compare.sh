#!/usr/bin/env bash
# bench/compare.sh: what a PD gateway adds on top of the engines, on one machine, in one run.
#
# Builds release binaries, starts zero-delay pdsim engines (one prefill, one decode, shfs),
# then, interleaved cell by cell: pdbench's direct PD mode (the baseline), pdgate and
# vllm-router against the same engines. Each gateway's CPU time (utime+stime from
# /proc/PID/stat, all its threads and child processes) and peak RSS (VmHWM, reset per cell
# through /proc/PID/clear_refs) are sampled around every cell. Finally a soak: 5,000
# concurrent open streams against slow-streaming engines. Prints one table of ratios.
#
# Targets besides the gateways: `floor`, a reference streaming relay (pdbench's example
# `stream_floor`: the prefill leg, then the decode's body handed to hyper as it is; not a
# product), the least a PD relay on hyper can cost per event; and `pdgate-base`, a second pdgate
# binary (PDGATE_BASE_BIN) to measure a change before and after in the same run. Stream cells
# report the CPU per relayed SSE event (256 token events, the usage event and [DONE] per stream).
#
# Pinning (2 cores): every gateway runs alone on core $GATEWAY_CPU; pdbench and both engines
# share core $CLIENT_CPU. The direct baseline therefore runs with the gateway core idle.
# Cell "shared-c1" then moves each gateway onto core $CLIENT_CPU too and repeats one client:
# on this VM every wake-up across cores costs tens of microseconds, and a gateway on its own core
# takes six of them per PD request (client -> gateway -> prefill -> gateway -> decode -> gateway
# -> client) where direct takes none; on one core the added latency is the gateway's own work.
#
# Every step is bounded in time; every process started here is killed by pid on exit.
#
# Environment (all optional):
#   PDGATE_CACHE        cache dir for the vllm-router virtualenv   [~/.cache/pdgate]
#   CARGO_TARGET_DIR    cargo target dir                           [<repo>/target]
#   BENCH_OUT           where JSON results go                      [<repo>/bench/out/<utc time>]
#   BENCH_DURATION      seconds per measured cell                  [5]
#   BENCH_WARMUP        unmeasured requests before each cell       [200, at least the concurrency]
#   BENCH_CONCURRENCY   closed-loop client counts                  ["1 16 64 256"]
#   BENCH_MODES         "plain stream"                             ["plain stream"]
#   BENCH_RATES         open-loop cells: requests started per second, the same offered load
#                       for every target (cells "<mode>-r<R>"; latency then compares at equal
#                       load, which closed-loop cells cannot when targets differ in speed) [none]
#   BENCH_GATEWAYS      gateways to compare              ["pdgate vllm-router floor minproxy"]
#                       (and "pdgate-base" when PDGATE_BASE_BIN is set; "floor-drive": the
#                       reference relay with its decode connection driven by the relaying task)
#   BENCH_SOAK_STREAMS  concurrent streams in the soak (0 = skip)  [5000]
#   BENCH_SOAK_DURATION seconds of soak per target                 [40]
#   BENCH_SHARED        1 = add the one-core, one-client cell shared-c1 [1]
#   BENCH_SKIP_BUILD=1  use existing release binaries
#   VLLM_ROUTER_VERSION PyPI version of vllm-router                [0.1.17]
#   VLLM_ROUTER_VENV    a virtualenv with vllm-router installed    [$PDGATE_CACHE/bench-venv if it
#                       has one, else $PDGATE_CACHE/vllm-router-$VLLM_ROUTER_VERSION, installed]
#   PDGATE_BIN          the pdgate binary                          [$CARGO_TARGET_DIR/release/pdgate]
#   PDGATE_BASE_BIN     a second pdgate binary, target pdgate-base [none]
#   PDGATE_ARGS         more flags for target pdgate (split on spaces)      [none]
#   PDGATE_BASE_ARGS    more flags for target pdgate-base: with PDGATE_BASE_BIN the same binary,
#                       two configurations in one run, e.g. "--prefill-policy cache_aware
#                       --decode-policy cache_aware" against round robin [none]
#   FLOOR_BIN           the reference relay                        [built: example stream_floor]
#   MINPROXY_BIN        target `minproxy`: the naive two-hop PD proxy (parses, sends the prefill,
#                       copies kv_transfer_params, buffers the decode's answer; no limits, logs or
#                       error handling), the floor any PD gateway pays [built from MINPROXY_SRC]
#   MINPROXY_SRC        its sources                                [<repo>/../shared/tools/minproxy]
#   PDGATE_RUST_LOG     RUST_LOG for pdgate targets: `info` is its default, access log included
#                                                                  [info]
#   BENCH_NICE          niceness of everything the script starts   [0]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${PDGATE_CACHE:-$HOME/.cache/pdgate}"
TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
BIN="$TARGET_DIR/release"
OUT="${BENCH_OUT:-$ROOT/bench/out/$(date -u +%Y%m%dT%H%M%SZ)}"
DURATION="${BENCH_DURATION:-5}"
WARMUP="${BENCH_WARMUP:-200}"
CONCURRENCIES="${BENCH_CONCURRENCY:-1 16 64 256}"
RATES="${BENCH_RATES:-}"
MODES="${BENCH_MODES:-plain stream}"
GATEWAYS="${BENCH_GATEWAYS:-pdgate vllm-router floor minproxy}"
PDGATE="${PDGATE_BIN:-$TARGET_DIR/release/pdgate}"
FLOOR="${FLOOR_BIN:-$TARGET_DIR/release/examples/stream_floor}"
MINPROXY_SRC="${MINPROXY_SRC:-$ROOT/../shared/tools/minproxy}"
MINPROXY="${MINPROXY_BIN:-$TARGET_DIR/minproxy/release/minproxy}"
if [ -n "${PDGATE_BASE_BIN:-}" ] && [ -z "${BENCH_GATEWAYS:-}" ]; then
  GATEWAYS="pdgate pdgate-base vllm-router floor minproxy"
fi
renice -n "${BENCH_NICE:-0}" -p $$ >/dev/null 2>&1 || true
SOAK_STREAMS="${BENCH_SOAK_STREAMS:-5000}"
SOAK_DURATION="${BENCH_SOAK_DURATION:-40}"
VLLM_ROUTER_VERSION="${VLLM_ROUTER_VERSION:-0.1.17}"
CLIENT_CPU="${CLIENT_CPU:-0}"
GATEWAY_CPU="${GATEWAY_CPU:-1}"
PROMPT_LEN=128
PLAIN_TOKENS=16
STREAM_TOKENS=256
SOAK_TOKENS=16
SOAK_ITL_MS=1000
SOAK_RAMP=5

mkdir -p "$OUT"
LOGS="$OUT/logs"
mkdir -p "$LOGS"
PROC="$OUT/proc.tsv"
printf 'cell\ttarget\tcpu_s\trss_kb\tpids\twarmup\tevents_per_stream\n' >"$PROC"

log() { printf '[compare %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

# ---- process bookkeeping: everything we start is recorded and killed by pid -------------
PIDS=()
cleanup() {
  local pid
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  sleep 0.5
  for pid in "${PIDS[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT
trap 'exit 130' INT TERM

stop_pid() {
  local pid="$1" i
  kill -TERM "$pid" 2>/dev/null || return 0
  for i in $(seq 1 50); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  kill -KILL "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}

# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"

# A pid and all its descendants.
tree_pids() {
  local pid="$1" child
  echo "$pid"
  for child in $(pgrep -P "$pid" 2>/dev/null || true); do tree_pids "$child"; done
}

# CPU ticks (utime+stime) of a process tree; fields after the ")" of /proc/PID/stat.
cpu_ticks() {
  local total=0 pid t
  for pid in $(tree_pids "$1"); do
    t=$(awk '{ sub(/^.*\) /, ""); print $12 + $13 }' "/proc/$pid/stat" 2>/dev/null || echo 0)
    total=$((total + t))
  done
  echo "$total"
}

# Peak RSS (VmHWM, kB) of a process tree, summed.
peak_rss_kb() {
  local total=0 pid v
  for pid in $(tree_pids "$1"); do
    v=$(awk '/^VmHWM:/ { print $2 }' "/proc/$pid/status" 2>/dev/null || echo 0)
    total=$((total + ${v:-0}))
  done
  echo "$total"
}

reset_peak_rss() {
  local pid
  for pid in $(tree_pids "$1"); do echo 5 >"/proc/$pid/clear_refs" 2>/dev/null || true; done
}

CLK_TCK=$(getconf CLK_TCK)

# ---- limits and build --------------------------------------------------------------------
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
if [ "$(ulimit -n)" != unlimited ] && [ "$(ulimit -n)" -lt 16384 ]; then
  log "warning: open-file limit $(ulimit -n) is low for the ${SOAK_STREAMS}-stream soak"
fi

# drop_target NAME: leaves NAME (the whole word) out of $GATEWAYS.
drop_target() {
  local t kept=()
  for t in $GATEWAYS; do [ "$t" = "$1" ] || kept+=("$t"); done
  GATEWAYS="${kept[*]}"
}
has_target() { [[ " $GATEWAYS " == *" $1 "* ]]; }
# streams TARGET MODE: whether TARGET runs MODE's cells (minproxy buffers the decode's whole
# answer, so it runs the non-streamed cells only, and no soak).
streams() { [ "$2" != stream ] || [ "$1" != minproxy ]; }

if [ "${BENCH_SKIP_BUILD:-0}" != 1 ]; then
  log "building release binaries (pdbench, pdsim)"
  (cd "$ROOT" && timeout 1800 cargo build --release -p pdbench -p pdsim) >"$LOGS/build.log" 2>&1 ||
    { log "build failed, see $LOGS/build.log"; exit 1; }
  if has_target pdgate && [ -z "${PDGATE_BIN:-}" ]; then
    log "building pdgate"
    if ! (cd "$ROOT" && timeout 1800 cargo build --release -p pdgate) >>"$LOGS/build.log" 2>&1; then
      log "pdgate does not build; leaving it out (see $LOGS/build.log)"
      drop_target pdgate
    fi
  fi
  if { has_target floor || has_target floor-drive; } && [ -z "${FLOOR_BIN:-}" ]; then
    log "building the reference relay (example stream_floor)"
    if ! (cd "$ROOT" && timeout 1800 cargo build --release -p pdbench --example stream_floor) \
      >>"$LOGS/build.log" 2>&1; then
      log "stream_floor does not build; leaving it out (see $LOGS/build.log)"
      drop_target floor
    fi
  fi
  if has_target minproxy && [ -z "${MINPROXY_BIN:-}" ]; then
    log "building minproxy from $MINPROXY_SRC"
    if ! timeout 1800 cargo build --release --manifest-path "$MINPROXY_SRC/Cargo.toml" \
      --target-dir "$TARGET_DIR/minproxy" >>"$LOGS/build.log" 2>&1; then
      log "minproxy does not build; leaving it out (see $LOGS/build.log)"
      drop_target minproxy
    fi
  fi
fi
for b in pdbench pdsim; do
  [ -x "$BIN/$b" ] || { log "missing $BIN/$b"; exit 1; }
done
if has_target pdgate && [ ! -x "$PDGATE" ]; then
  log "no $PDGATE; leaving it out"
  drop_target pdgate
fi
if has_target pdgate-base && [ ! -x "${PDGATE_BASE_BIN:-}" ]; then
  log "no PDGATE_BASE_BIN binary; leaving pdgate-base out"
  drop_target pdgate-base
fi
if [ ! -x "$FLOOR" ]; then
  drop_target floor
  drop_target floor-drive
fi
[ -x "$MINPROXY" ] || drop_target minproxy

if [ -n "${VLLM_ROUTER_VENV:-}" ]; then
  VR_VENV="$VLLM_ROUTER_VENV"
elif [ -x "$CACHE/bench-venv/bin/vllm-router" ]; then
  VR_VENV="$CACHE/bench-venv"
else
  VR_VENV="$CACHE/vllm-router-$VLLM_ROUTER_VERSION"
fi
if has_target vllm-router && [ ! -x "$VR_VENV/bin/vllm-router" ]; then
  log "installing vllm-router==$VLLM_ROUTER_VERSION into $VR_VENV"
  mkdir -p "$CACHE"
  if ! (timeout 900 python3 -m venv "$VR_VENV" &&
    timeout 900 "$VR_VENV/bin/pip" install -q "vllm-router==$VLLM_ROUTER_VERSION") >"$LOGS/pip.log" 2>&1; then
    log "vllm-router install failed; leaving it out (see $LOGS/pip.log)"
    drop_target vllm-router
  fi
fi

# ---- engines and gateways ------------------------------------------------------------------
# start_engine ROLE PORT SIDE_PORT [extra pdsim flags...]; sets LAST_PID.
start_engine() {
  local role="$1" port="$2" side="$3"
  shift 3
  taskset -c "$CLIENT_CPU" "$BIN/pdsim" --role "$role" --connector shfs \
    --listen "127.0.0.1:$port" --side-channel-listen "127.0.0.1:$side" \
    --bootstrap-listen "127.0.0.1:$(free_port)" --advertise-host 127.0.0.1 \
    --worker-threads 1 --slots 0 "$@" >"$LOGS/pdsim-$role-$port.log" 2>&1 &
  LAST_PID=$!
  PIDS+=("$LAST_PID")
  wait_http "http://127.0.0.1:$port/health" 30
}

# start_gateway NAME PORT PREFILL_URL DECODE_URL [soak]; sets LAST_PID.
# Soak only: lift pdgate's admission limit (default 1024 in flight + 1024 queued, then 429)
# so it holds all the streams; vllm-router's default limit (32768) already does.
start_gateway() {
  local name="$1" port="$2" p="$3" d="$4" soak="${5:-}"
  local extra=()
  case "$name" in
    pdgate | pdgate-base)
      local exe="$PDGATE"
      [ "$name" = pdgate-base ] && exe="$PDGATE_BASE_BIN"
      [ -n "$soak" ] && extra=(--max-in-flight 0)
      # shellcheck disable=SC2206 # word splitting is the point
      if [ "$name" = pdgate ]; then extra+=(${PDGATE_ARGS:-}); else extra+=(${PDGATE_BASE_ARGS:-}); fi
      RUST_LOG="${PDGATE_RUST_LOG:-info}" taskset -c "$GATEWAY_CPU" "$exe" --prefill "$p" --decode "$d" \
        --kv-connector shfs --listen "127.0.0.1:$port" "${extra[@]}" >"$LOGS/$name-$port.log" 2>&1 &
      ;;
    floor | floor-drive)
      local mode=()
      [ "$name" = floor-drive ] && mode=(drive)
      taskset -c "$GATEWAY_CPU" "$FLOOR" "127.0.0.1:$port" "$p" "$d" "${mode[@]}" \
        >"$LOGS/$name-$port.log" 2>&1 &
      ;;
    minproxy)
      # It answers every path by proxying it (no /health): ready once its port accepts.
      taskset -c "$GATEWAY_CPU" "$MINPROXY" "$port" "$p" "$d" >"$LOGS/$name-$port.log" 2>&1 &
      LAST_PID=$!
      PIDS+=("$LAST_PID")
      wait_tcp 127.0.0.1 "$port" 30
      return
      ;;
    vllm-router)
      taskset -c "$GATEWAY_CPU" "$VR_VENV/bin/vllm-router" --vllm-pd-disaggregation \
        --prefill "$p" --decode "$d" --kv-connector nixl --policy round_robin \
        --host 127.0.0.1 --port "$port" --prometheus-port "$(free_port)" \
        --log-level warning --worker-startup-check-interval 1 \
        >"$LOGS/vllm-router-$port.log" 2>&1 &
      ;;
    *)
      log "unknown gateway $name"
      return 1
      ;;
  esac
  LAST_PID=$!
  PIDS+=("$LAST_PID")
  wait_http "http://127.0.0.1:$port/health" 90
}

# run_cell CELL TARGET PIDOFTARGET ARGS...: one pdbench run, sampled.
run_cell() {
  local cell="$1" target="$2" pid="$3"
  shift 3
  CELLS_DONE=$((CELLS_DONE + 1))
  log "cell ${CELLS_DONE} of ${CELLS_TOTAL:-?} ($((CELLS_TOTAL - CELLS_DONE)) left): $cell $target"
  local t0=0 t1=0 rss=0 warm=0 events=0 stream=0 tokens=0 prev=
  # The CPU sample spans the warm-up too; ratios.py counts its requests (and their events: per
  # stream the tokens, the usage event and [DONE]).
  for a in "$@"; do
    [ "$prev" = --warmup ] && warm="$a"
    [ "$prev" = --output-len ] && tokens="$a"
    [ "$a" = --stream ] && stream=1
    prev="$a"
  done
  [ "$stream" = 1 ] && events=$((tokens + 2))
  if [ "$pid" != - ]; then
    reset_peak_rss "$pid"
    t0=$(cpu_ticks "$pid")
  fi
  if ! timeout "$CELL_LIMIT" taskset -c "$CLIENT_CPU" "$BIN/pdbench" "$@" --json --threads 1 \
    >"$OUT/$cell-$target.json" 2>"$LOGS/$cell-$target.err"; then
    log "$cell $target: pdbench failed (see $LOGS/$cell-$target.err)"
  fi
  if [ "$pid" != - ]; then
    t1=$(cpu_ticks "$pid")
    rss=$(peak_rss_kb "$pid")
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$cell" "$target" \
      "$(awk -v a="$t0" -v b="$t1" -v h="$CLK_TCK" 'BEGIN { printf "%.3f", (b - a) / h }')" \
      "$rss" "$(tree_pids "$pid" | tr '\n' ',')" "$warm" "$events" >>"$PROC"
  fi
  log "$cell $target: $(python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print("%d ok, %d errors, %.0f req/s" % (r["ok"], r["errors"], r["throughput_rps"]))' "$OUT/$cell-$target.json" 2>/dev/null || echo 'no result')"
}

# run_matrix PREFIX PREFILL_URL DECODE_URL: every target at every cell, interleaved.
declare -A GW_PORT GW_PID
run_target() {
  local cell="$1" target="$2" p="$3" d="$4"
  shift 4
  if [ "$target" = direct ]; then
    run_cell "$cell" direct - direct --prefill "$p" --decode "$d" --connector shfs "$@"
  else
    run_cell "$cell" "$target" "${GW_PID[$target]}" --url "http://127.0.0.1:${GW_PORT[$target]}" "$@"
  fi
}

# ---- phase 1: zero-delay engines, concurrency sweep ----------------------------------------
CELL_LIMIT=$((DURATION * 3 + 120))
P_PORT=$(free_port)
D_PORT=$(free_port)
log "starting zero-delay pdsim prefill :$P_PORT and decode :$D_PORT (core $CLIENT_CPU)"
start_engine prefill "$P_PORT" "$(free_port)" --zero-delay
start_engine decode "$D_PORT" "$(free_port)" --zero-delay
PREFILL="http://127.0.0.1:$P_PORT"
DECODE="http://127.0.0.1:$D_PORT"

for gw in $GATEWAYS; do
  GW_PORT[$gw]=$(free_port)
  log "starting $gw on :${GW_PORT[$gw]} (core $GATEWAY_CPU)"
  if start_gateway "$gw" "${GW_PORT[$gw]}" "$PREFILL" "$DECODE"; then
    GW_PID[$gw]=$LAST_PID
  else
    log "$gw did not become healthy; leaving it out"
    stop_pid "$LAST_PID"
    drop_target "$gw"
  fi
done

# Cells in the whole run, for the progress lines (a target dropped later makes it an upper bound).
n_targets=$((1 + $(wc -w <<<"$GATEWAYS")))
CELLS_TOTAL=$(($(wc -w <<<"$MODES") * ($(wc -w <<<"$CONCURRENCIES") + $(wc -w <<<"$RATES")) * n_targets))
[ "${BENCH_SHARED:-1}" = 1 ] && CELLS_TOTAL=$((CELLS_TOTAL + n_targets))
[ "$SOAK_STREAMS" -gt 0 ] && CELLS_TOTAL=$((CELLS_TOTAL + n_targets))
CELLS_DONE=0
for mode in $MODES; do
  for c in $CONCURRENCIES; do
    cell="$mode-c$c"
    warm=$((c > WARMUP ? c : WARMUP))
    args=(--concurrency "$c" --duration "$DURATION" --warmup "$warm" --timeout 30
      --prompt-len "$PROMPT_LEN")
    if [ "$mode" = stream ]; then
      args+=(--stream --output-len "$STREAM_TOKENS")
    else
      args+=(--output-len "$PLAIN_TOKENS")
    fi
    for target in direct $GATEWAYS; do
      streams "$target" "$mode" || continue
      run_target "$cell" "$target" "$PREFILL" "$DECODE" "${args[@]}"
    done
  done
  for r in $RATES; do
    cell="$mode-r$r"
    args=(--rate "$r" --max-in-flight 4096 --duration "$DURATION" --warmup "$WARMUP" --timeout 30
      --prompt-len "$PROMPT_LEN")
    if [ "$mode" = stream ]; then
      args+=(--stream --output-len "$STREAM_TOKENS")
    else
      args+=(--output-len "$PLAIN_TOKENS")
    fi
    for target in direct $GATEWAYS; do
      streams "$target" "$mode" || continue
      run_target "$cell" "$target" "$PREFILL" "$DECODE" "${args[@]}"
    done
  done
done

# ---- phase 1b: everything on one core, one client --------------------------------------------
if [ "${BENCH_SHARED:-1}" = 1 ]; then
  # pin_tree PID CPU: every thread of a process tree onto one core.
  pin_tree() {
    local pid
    for pid in $(tree_pids "$1"); do
      taskset -a -p -c "$2" "$pid" >/dev/null 2>&1 || log "could not pin pid $pid to core $2"
    done
  }
  args=(--concurrency 1 --duration "$DURATION" --warmup "$WARMUP" --timeout 30
    --prompt-len "$PROMPT_LEN" --output-len "$PLAIN_TOKENS")
  # Only the measured gateway joins core $CLIENT_CPU; the others stay idle on their own core.
  for target in direct $GATEWAYS; do
    if [ "$target" != direct ]; then pin_tree "${GW_PID[$target]}" "$CLIENT_CPU"; fi
    run_target shared-c1 "$target" "$PREFILL" "$DECODE" "${args[@]}"
    if [ "$target" != direct ]; then pin_tree "${GW_PID[$target]}" "$GATEWAY_CPU"; fi
  done
fi

for gw in $GATEWAYS; do stop_pid "${GW_PID[$gw]}"; done

# Engine counters: every decode should have pulled its KV (transfers_pulled), none recomputed.
dump_stats() {
  curl -fsS --max-time 5 "$2/sim/stats" 2>/dev/null |
    python3 -c 'import json,sys; d=json.load(sys.stdin); d.pop("recent_requests",None); print(json.dumps(d))' \
      >"$OUT/engine-$1.json" 2>/dev/null || log "could not read $2/sim/stats"
  log "engine $1: $(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print("ok=%s pulled=%s served=%s recomputed=%s failed=%s" % (d.get("responses_ok"), d.get("transfers_pulled"), d.get("transfers_served"), d.get("recomputed"), d.get("transfers_failed")))' "$OUT/engine-$1.json" 2>/dev/null)"
}
dump_stats prefill "$PREFILL"
dump_stats decode "$DECODE"

# ---- phase 2: soak, N concurrent open streams against slow-streaming engines ---------------
if [ "$SOAK_STREAMS" -gt 0 ]; then
  SP_PORT=$(free_port)
  SD_PORT=$(free_port)
  log "soak: pdsim engines streaming one token per ${SOAK_ITL_MS} ms, $SOAK_STREAMS streams"
  start_engine prefill "$SP_PORT" "$(free_port)" --ttft-ms 0 --prefill-ms-per-token 0 --itl-ms "$SOAK_ITL_MS"
  start_engine decode "$SD_PORT" "$(free_port)" --ttft-ms 0 --prefill-ms-per-token 0 --itl-ms "$SOAK_ITL_MS"
  SPREFILL="http://127.0.0.1:$SP_PORT"
  SDECODE="http://127.0.0.1:$SD_PORT"
  soak_args=(--concurrency "$SOAK_STREAMS" --duration "$SOAK_DURATION" --warmup 0 --timeout 60
    --ramp "$SOAK_RAMP"
    --stream --prompt-len "$PROMPT_LEN" --output-len "$SOAK_TOKENS")
  CELL_LIMIT=$((SOAK_DURATION * 3 + 180))
  run_target soak direct "$SPREFILL" "$SDECODE" "${soak_args[@]}"
  for gw in $GATEWAYS; do
    streams "$gw" stream || continue
    GW_PORT[$gw]=$(free_port)
    if start_gateway "$gw" "${GW_PORT[$gw]}" "$SPREFILL" "$SDECODE" soak; then
      GW_PID[$gw]=$LAST_PID
      run_target soak "$gw" "$SPREFILL" "$SDECODE" "${soak_args[@]}"
    else
      log "$gw did not become healthy for the soak"
    fi
    stop_pid "$LAST_PID"
  done
  dump_stats soak-prefill "$SPREFILL"
  dump_stats soak-decode "$SDECODE"
fi

# ---- the table -------------------------------------------------------------------------------
{
  echo "machine: $(nproc) cores, $(awk '/MemTotal/ { printf "%.0f GiB", $2/1048576 }' /proc/meminfo), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(uname -sr)"
  echo "run: $(date -u +%Y-%m-%dT%H:%MZ), HEAD $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)$([ "${BENCH_SKIP_BUILD:-0}" = 1 ] && echo ' (prebuilt binaries)'), vllm-router $VLLM_ROUTER_VERSION, load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "pinning: gateway on core $GATEWAY_CPU; pdbench + engines on core $CLIENT_CPU (shared-c1: all on core $CLIENT_CPU); ${DURATION}s cells; soak ${SOAK_STREAMS} streams x ${SOAK_TOKENS} tokens at ${SOAK_ITL_MS} ms/token, ${SOAK_RAMP}s ramp, ${SOAK_DURATION}s"
  python3 "$ROOT/bench/ratios.py" "$OUT"
} | tee "$OUT/table.txt"
python3 "$ROOT/bench/ratios.py" "$OUT" --markdown >"$OUT/table.md"
# The chart (docs/benchmarks.md shows the one of its current run): matplotlib from the bench venv.
CHART_VENV="$CACHE/bench-venv"
if ! "$CHART_VENV/bin/python" -c 'import matplotlib' 2>/dev/null; then
  (timeout 900 python3 -m venv "$CHART_VENV" && timeout 900 "$CHART_VENV/bin/pip" install -q matplotlib) \
    >"$OUT/pip-matplotlib.log" 2>&1 || log "matplotlib install failed: no chart (see $OUT/pip-matplotlib.log)"
fi
"$CHART_VENV/bin/python" "$ROOT/bench/compare_charts.py" "$OUT" || log "no chart drawn"
log "results in $OUT"
