#!/usr/bin/env bash
# bench/profile.sh: where pdgate's CPU and memory go, in numbers that a busy machine does not blur.
#
#   bench/profile.sh callgrind [REQUESTS]   user-space instructions for REQUESTS PD requests
#                                           (default 2000) at 4 clients, after 200 warm-up requests
#   bench/profile.sh stream [STREAMS]       the same for STREAMS (default 200) streamed PD
#                                           requests of 256 tokens at 4 clients: instructions and
#                                           heap allocations per stream and per relayed SSE event
#   bench/profile.sh syscalls [STREAMS]     system calls by kind (strace -c, every thread) and
#                                           context switches (perf stat) per relayed SSE event for
#                                           STREAMS (default 2000) such streams, not under valgrind
#   bench/profile.sh massif [STREAMS]       heap at the peak of STREAMS (default 500) concurrent
#                                           16-token streams, grouped by allocation site
#
# All run pdgate under valgrind (or strace) in front of two pdsim engines (shfs, the same wire
# format as vLLM's NixlConnector) and drive it with pdbench, all on loopback ports chosen here.
# Instruction counts are stable to well under 1% between runs even on a loaded machine, so two
# builds can be compared without an idle host (wall-clock numbers come from bench/compare.sh).
# A relayed event is one SSE event the client receives: 256 tokens, the usage event and [DONE]
# (258 per stream). Needs valgrind (`apt-get install valgrind`), strace and perf for `syscalls`;
# builds optimised binaries with symbols (`--profile profiling`) unless BENCH_SKIP_BUILD=1, and
# for massif a pdgate with the system
# allocator (feature `system-allocator`; massif cannot see jemalloc).
#
# Environment: CARGO_TARGET_DIR, PDGATE_BIN (profile another pdgate binary), PROFILE_TARGET
# (`pdgate`; `floor` for the reference relay, pdbench's example `stream_floor`; `floor-drive`
# for the same with its decode connection driven by the relaying task; `minproxy` for the naive
# two-hop proxy, MINPROXY_BIN or built as bench/compare.sh builds it),
# PROFILE_CONCURRENCY (clients, default 4), PROFILE_OUT (output directory, default
# bench/out/profile-<utc time>), PDGATE_EXTRA_ARGS (more pdgate flags, split on spaces, e.g.
# "--prefill-policy cache_aware --decode-policy cache_aware"), PROFILE_RUST_LOG (pdgate's
# RUST_LOG, default warn; `info` is the production default).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODE="${1:-}"
case "$MODE" in
  callgrind) COUNT="${2:-2000}" ;;
  stream) COUNT="${2:-200}" ;;
  syscalls) COUNT="${2:-2000}" ;;
  massif) COUNT="${2:-500}" ;;
  *)
    sed -n '2,31p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
TARGET="${PROFILE_TARGET:-pdgate}"
CLIENTS="${PROFILE_CONCURRENCY:-4}"
STREAM_TOKENS=256
# Per stream: the token events, the usage event and [DONE].
EVENTS_PER_STREAM=$((STREAM_TOKENS + 2))
if [ "$MODE" = syscalls ]; then
  for tool in strace perf; do
    command -v "$tool" >/dev/null || {
      echo "profile.sh: $tool not found" >&2
      exit 2
    }
  done
else
  command -v valgrind >/dev/null || {
    echo "profile.sh: valgrind not found (apt-get install valgrind)" >&2
    exit 2
  }
fi
# The `profiling` profile: the release build with line tables and symbols (the release binary
# itself ships without debuginfo).
BIN="${CARGO_TARGET_DIR:-$ROOT/target}/profiling"
if [ "${BENCH_SKIP_BUILD:-0}" != 1 ]; then
  cargo build --profile profiling --locked -p pdgate -p pdsim -p pdbench --manifest-path "$ROOT/Cargo.toml" >&2
  if [ "$TARGET" != pdgate ]; then
    cargo build --profile profiling --locked -p pdbench --example stream_floor \
      --manifest-path "$ROOT/Cargo.toml" >&2
  fi
fi
GATEWAY="${PDGATE_BIN:-$BIN/pdgate}"
if [ "$MODE" = massif ] && [ -z "${PDGATE_BIN:-}" ]; then
  # massif sees only the system allocator's heap: a pdgate without jemalloc, in its own target
  # dir so the regular release binary stays as it is (a cold build there takes minutes).
  cargo build --profile profiling --locked -p pdgate --features system-allocator \
    --manifest-path "$ROOT/Cargo.toml" --target-dir "${CARGO_TARGET_DIR:-$ROOT/target}/system-allocator" >&2
  GATEWAY="${CARGO_TARGET_DIR:-$ROOT/target}/system-allocator/profiling/pdgate"
fi
OUT="${PROFILE_OUT:-$ROOT/bench/out/profile-$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$OUT"

PIDS=()
cleanup() {
  local pid
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT

# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"

engine_flags=(--zero-delay --slots 0)
if [ "$MODE" = massif ]; then
  # Streams that stay open: one token per second, 16 tokens.
  engine_flags=(--slots 0 --ttft-ms 0 --prefill-ms-per-token 0 --itl-ms 1000)
fi
P_PORT=$(free_port)
D_PORT=$(free_port)
G_PORT=$(free_port)
for role in prefill decode; do
  port=$P_PORT
  [ "$role" = decode ] && port=$D_PORT
  "$BIN/pdsim" --role "$role" --connector shfs --listen "127.0.0.1:$port" \
    --side-channel-listen "127.0.0.1:$(free_port)" --model m "${engine_flags[@]}" \
    >"$OUT/pdsim-$role.log" 2>&1 &
  PIDS+=($!)
  wait_http "http://127.0.0.1:$port/health" 30
done

case "$TARGET" in
  pdgate)
    gateway=("$GATEWAY" --prefill "http://127.0.0.1:$P_PORT" --decode "http://127.0.0.1:$D_PORT"
      --kv-connector shfs --listen "127.0.0.1:$G_PORT" --max-in-flight 0)
    # shellcheck disable=SC2206 # word splitting is the point
    gateway+=(${PDGATE_EXTRA_ARGS:-})
    READY=/ready
    ;;
  floor | floor-drive)
    gateway=("${FLOOR_BIN:-$BIN/examples/stream_floor}" "127.0.0.1:$G_PORT"
      "http://127.0.0.1:$P_PORT" "http://127.0.0.1:$D_PORT")
    [ "$TARGET" = floor-drive ] && gateway+=(drive)
    READY=/health
    ;;
  minproxy)
    # The naive two-hop proxy (bench/compare.sh's `minproxy`): no /health, ready once its
    # port accepts.
    gateway=("${MINPROXY_BIN:-${CARGO_TARGET_DIR:-$ROOT/target}/minproxy/release/minproxy}" "$G_PORT"
      "http://127.0.0.1:$P_PORT" "http://127.0.0.1:$D_PORT")
    READY=
    ;;
  *)
    echo "profile.sh: PROFILE_TARGET is pdgate, floor, floor-drive or minproxy" >&2
    exit 2
    ;;
esac
URL="http://127.0.0.1:$G_PORT"
# wait_ready SECONDS: until the gateway answers its readiness path (or, with none, accepts).
wait_ready() {
  if [ -n "$READY" ]; then wait_http "$URL$READY" "$1"; else wait_tcp 127.0.0.1 "$G_PORT" "$1"; fi
}
load=(--url "$URL" --model m --concurrency "$CLIENTS" --timeout 60)
if [ "$MODE" != callgrind ]; then
  load+=(--stream --prompt-len 128 --output-len "$STREAM_TOKENS")
fi

if [ "$MODE" = callgrind ] || [ "$MODE" = stream ]; then
  RUST_LOG="${PROFILE_RUST_LOG:-warn}" valgrind --tool=callgrind --instr-atstart=no \
    --callgrind-out-file="$OUT/callgrind.out" "${gateway[@]}" >"$OUT/gateway.log" 2>&1 &
  GW=$!
  PIDS+=("$GW")
  wait_ready 120
  warm=200
  [ "$MODE" = stream ] && warm=40
  "$BIN/pdbench" "${load[@]}" --requests "$warm" >/dev/null
  callgrind_control -i on "$GW" >/dev/null
  "$BIN/pdbench" "${load[@]}" --requests "$COUNT" | grep -E '^result' >&2
  callgrind_control -i off "$GW" >/dev/null
  callgrind_control -d "$GW" >/dev/null
  sleep 1
  total=$(callgrind_annotate "$OUT"/callgrind.out.* 2>/dev/null | awk '/PROGRAM TOTALS/ { gsub(",", "", $1); print $1 }')
  if [ "$MODE" = callgrind ]; then
    echo "$TARGET user-space instructions: $total for $COUNT PD requests ($((total / COUNT)) per request)"
  else
    events=$((COUNT * EVENTS_PER_STREAM))
    echo "$TARGET user-space instructions: $total for $COUNT streams of $STREAM_TOKENS tokens ($((total / COUNT)) per stream, $((total / events)) per relayed event)"
    python3 "$ROOT/bench/callgrind_calls.py" "$OUT"/callgrind.out.* --per "$events" "relayed event"
  fi
  echo "profile: callgrind_annotate --inclusive=yes $OUT/callgrind.out.1 | less"
elif [ "$MODE" = syscalls ]; then
  RUST_LOG=warn "${gateway[@]}" >"$OUT/gateway.log" 2>&1 &
  GW=$!
  PIDS+=("$GW")
  wait_ready 60
  "$BIN/pdbench" "${load[@]}" --requests 200 >/dev/null
  # observed TOOL...: COUNT streams with TOOL watching the gateway from the background, then
  # stopped with SIGINT (strace and perf stat print their summaries then).
  observed() {
    "$@" 2>>"$OUT/tools.log" &
    local tool=$!
    PIDS+=("$tool")
    sleep 1
    "$BIN/pdbench" "${load[@]}" --requests "$COUNT" | grep -E '^result' >&2
    kill -INT "$tool"
    wait "$tool" 2>/dev/null || true
  }
  # Every thread of the gateway, traced from here on.
  attach=()
  for task in /proc/"$GW"/task/*; do attach+=(-p "${task##*/}"); done
  observed strace -f -c -S calls -o "$OUT/strace.txt" "${attach[@]}"
  # Context switches and CPU time, without strace's own cost in them.
  observed perf stat -e task-clock,context-switches,cpu-migrations -p "$GW" -o "$OUT/perf-stat.txt"
  events=$((COUNT * EVENTS_PER_STREAM))
  echo "$TARGET system calls for $COUNT streams ($events relayed events), strace -c:"
  awk -v e="$events" -v s="$COUNT" '
    $1 ~ /^[0-9.]+$/ && NF >= 5 {
      printf "  %-16s %10d calls  %7.3f per event  %7.2f per stream\n", $NF, $4, $4 / e, $4 / s
    }
  ' "$OUT/strace.txt"
  awk -v e="$events" '
    /task-clock/ { gsub(",", "", $1); printf "  task-clock %.3f us per event (a second run, no strace)\n", $1 * 1000 / e }
    /context-switches/ { gsub(",", "", $1); printf "  context switches %.3f per event\n", $1 / e }
  ' "$OUT/perf-stat.txt"
else
  RUST_LOG=warn valgrind --tool=massif --depth=40 --massif-out-file="$OUT/massif.out" \
    "${gateway[@]}" >"$OUT/gateway.log" 2>&1 &
  GW=$!
  PIDS+=("$GW")
  wait_ready 120
  "$BIN/pdbench" --url "$URL" --model m --concurrency "$COUNT" --duration 20 --warmup 0 \
    --timeout 60 --ramp 5 --stream --prompt-len 128 --output-len 16 | grep -E '^result' >&2
  kill "$GW"
  wait "$GW" 2>/dev/null || true
  python3 "$ROOT/bench/massif_sites.py" "$OUT/massif.out"
fi
echo "output: $OUT"
