#!/usr/bin/env bash
# bench/profile.sh: where pdgate's CPU and memory go, in numbers that a busy machine does not blur.
#
#   bench/profile.sh callgrind [REQUESTS]   user-space instructions for REQUESTS PD requests
#                                           (default 2000) at 4 clients, after 200 warm-up requests
#   bench/profile.sh massif [STREAMS]       heap at the peak of STREAMS (default 500) concurrent
#                                           16-token streams, grouped by allocation site
#
# Both run pdgate under valgrind in front of two pdsim engines (shfs, the same wire format as
# vLLM's NixlConnector) and drive it with pdbench, all on loopback ports chosen here. Instruction
# counts are stable to well under 1% between runs even on a loaded machine, so two builds can be
# compared without an idle host (wall-clock numbers come from bench/compare.sh). Needs valgrind
# (`apt-get install valgrind`); builds release binaries unless BENCH_SKIP_BUILD=1, and for massif
# a pdgate with the system allocator (feature `system-allocator`; massif cannot see jemalloc).
#
# Environment: CARGO_TARGET_DIR, PDGATE_BIN (profile another pdgate binary), PROFILE_OUT
# (output directory, default bench/out/profile-<utc time>), PDGATE_EXTRA_ARGS (more pdgate
# flags, split on spaces, e.g. "--prefill-policy cache_aware --decode-policy cache_aware"),
# PROFILE_RUST_LOG (pdgate's RUST_LOG, default warn; `info` is the production default).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODE="${1:-}"
case "$MODE" in
  callgrind) COUNT="${2:-2000}" ;;
  massif) COUNT="${2:-500}" ;;
  *)
    sed -n '2,19p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
command -v valgrind >/dev/null || {
  echo "profile.sh: valgrind not found (apt-get install valgrind)" >&2
  exit 2
}
BIN="${CARGO_TARGET_DIR:-$ROOT/target}/release"
if [ "${BENCH_SKIP_BUILD:-0}" != 1 ]; then
  cargo build --release --locked -p pdgate -p pdsim -p pdbench --manifest-path "$ROOT/Cargo.toml" >&2
fi
GATEWAY="${PDGATE_BIN:-$BIN/pdgate}"
if [ "$MODE" = massif ] && [ -z "${PDGATE_BIN:-}" ]; then
  # massif sees only the system allocator's heap: a pdgate without jemalloc, in its own target
  # dir so the regular release binary stays as it is (a cold build there takes minutes).
  cargo build --release --locked -p pdgate --features system-allocator \
    --manifest-path "$ROOT/Cargo.toml" --target-dir "${CARGO_TARGET_DIR:-$ROOT/target}/system-allocator" >&2
  GATEWAY="${CARGO_TARGET_DIR:-$ROOT/target}/system-allocator/release/pdgate"
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

gateway=("$GATEWAY" --prefill "http://127.0.0.1:$P_PORT" --decode "http://127.0.0.1:$D_PORT"
  --kv-connector shfs --listen "127.0.0.1:$G_PORT" --max-in-flight 0)
# shellcheck disable=SC2206 # word splitting is the point
gateway+=(${PDGATE_EXTRA_ARGS:-})
URL="http://127.0.0.1:$G_PORT"
if [ "$MODE" = callgrind ]; then
  RUST_LOG="${PROFILE_RUST_LOG:-warn}" valgrind --tool=callgrind --instr-atstart=no \
    --callgrind-out-file="$OUT/callgrind.out" "${gateway[@]}" >"$OUT/pdgate.log" 2>&1 &
  GW=$!
  PIDS+=("$GW")
  wait_http "$URL/ready" 120
  "$BIN/pdbench" --url "$URL" --model m --concurrency 4 --requests 200 --timeout 60 >/dev/null
  callgrind_control -i on "$GW" >/dev/null
  "$BIN/pdbench" --url "$URL" --model m --concurrency 4 --requests "$COUNT" --timeout 60 |
    grep -E '^result' >&2
  callgrind_control -i off "$GW" >/dev/null
  callgrind_control -d "$GW" >/dev/null
  sleep 1
  total=$(callgrind_annotate "$OUT"/callgrind.out.* 2>/dev/null | awk '/PROGRAM TOTALS/ { gsub(",", "", $1); print $1 }')
  echo "pdgate user-space instructions: $total for $COUNT PD requests ($((total / COUNT)) per request)"
  echo "profile: callgrind_annotate --inclusive=yes $OUT/callgrind.out.1 | less"
else
  RUST_LOG=warn valgrind --tool=massif --depth=40 --massif-out-file="$OUT/massif.out" \
    "${gateway[@]}" >"$OUT/pdgate.log" 2>&1 &
  GW=$!
  PIDS+=("$GW")
  wait_http "$URL/ready" 120
  "$BIN/pdbench" --url "$URL" --model m --concurrency "$COUNT" --duration 20 --warmup 0 \
    --timeout 60 --ramp 5 --stream --prompt-len 128 --output-len 16 | grep -E '^result' >&2
  kill "$GW"
  wait "$GW" 2>/dev/null || true
  python3 "$ROOT/bench/massif_sites.py" "$OUT/massif.out"
fi
echo "output: $OUT"
