#!/usr/bin/env bash
# bench/cache.sh: routing quality on real vLLM CPU engines (on demand, not in CI).
#
# Builds (or reuses) the bench model (random Llama, hidden 768, 6 layers, ~37M parameters,
# tests/e2e/make_tiny_model.py --size bench), starts 2 prefill + 1 decode vLLM 0.32 CPU
# engines with NixlConnector, block size 32, sha256_cbor hashing, prompt-token details and
# KV events, each prefill's KV cache sized so that one cannot hold every prefix group of the
# trace but both together can. Then, interleaved (round by round, workload by workload, arm by
# arm), every arm runs the same bounded trace after every engine's prefix cache was reset; each
# engine's /metrics is read before and after each arm. Prints one table (also in $OUT, with
# results.jsonl, summary.json and the charts cache-ttft.svg and cache-hits.svg drawn by
# bench/cache_charts.py with matplotlib from the bench venv).
#
# Arms (BENCH_ARMS):
#   direct            no gateway: the driver plays the PD flow, prefills round robin (the floor)
#   pdgate-rr         pdgate --prefill-policy round_robin --decode-policy round_robin
#   vllm-router-ca    vllm-router 0.1.17 --vllm-pd-disaggregation, cache_aware on both roles
#   vllm-router-rr    the same with round_robin
#   smg-ca            SMG 1.13 `smg launch --pd-disaggregation --backend vllm`, cache_aware
#   smg-rr            the same with round_robin
#   pdgate-ca-approx  pdgate cache_aware on both roles, approximate (byte blocks, no events)
#   pdgate-ca-precise pdgate cache_aware with the model's tokenizer.json, block size 32 and
#                     every engine's KV events (precise); every request through both legs
#   pdgate-ca-precise-do  the same, and a request whose prompt is cached on the decode up to
#                     BENCH_DECODE_ONLY_BELOW uncached tokens is served there alone
# Workloads (BENCH_WORKLOADS): shared-prefix, multi-turn, random (bench/cache_trace.py).
#
# Every step is bounded; every process started here leads its own process group and is
# stopped by that id on exit. Heavy: 3 engines hold ~2.5 GB each; everything runs under nice.
#
# Environment (all optional):
#   PDGATE_CACHE       cache root: vllm-venv/, bench-llama/, bench-venv/     [~/.cache/pdgate]
#   CARGO_TARGET_DIR   where release pdgate is built/found                   [<repo>/target]
#   PDGATE_BIN         pdgate binary to use (skips the build)
#   BENCH_OUT          results dir                                 [<repo>/bench/out/cache-<utc>]
#   BENCH_ARMS         see above                                            [all of them]
#   BENCH_WORKLOADS    ["shared-prefix multi-turn random"]
#   BENCH_ROUNDS       interleaved rounds                                   [1]
#   BENCH_GROUPS, BENCH_PER_GROUP, BENCH_SYSTEM_WORDS, BENCH_QUESTION_WORDS,
#   BENCH_OUTPUT_TOKENS, BENCH_CONCURRENCY     trace shape          [6, 4, 600, 40, 8, 2]
#   BENCH_SESSIONS, BENCH_TURNS, BENCH_MT_SYSTEM_WORDS   multi-turn shape       [6, 4, 500]
#   BENCH_DECODE_ONLY_BELOW  pdgate-ca-precise-do's decode_only_below_tokens         [128]
#   BENCH_SPECULATIVE_TTL    the precise arms' cache.speculative_ttl                 [30s]
#   BENCH_PREFILL_KV_MIB  KV cache per prefill (MiB); 12 KiB per token for the bench model [32]
#                      (2,730 tokens: 4 of the 6 groups' 640-token prefixes; both prefills hold all 6)
#   BENCH_DECODE_KV_MIB   KV cache of the decode (MiB)                                   [256]
#   BENCH_ARM_TIMEOUT  seconds per arm                                      [600]
#   BENCH_NICE         niceness of the engines, gateways and driver           [10]
#                      (0 on a machine busy with other work: niced engines starve and TTFT
#                      then measures the other work, not the cache)
#   VLLM_ROUTER_VERSION [0.1.17], SMG_VERSION [1.13.*]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
E2E="$ROOT/tests/e2e"
# shellcheck source=lib.sh
source "$ROOT/bench/lib.sh"
# shellcheck source=../tests/e2e/install_vllm.sh
source "$E2E/install_vllm.sh" # sets E2E_CACHE, VENV (not run: sourced)
CACHE="$E2E_CACHE"
PY="$VENV/bin/python"
MODEL_DIR="$CACHE/bench-llama"
MODEL=bench
BLOCK=32
OUT="${BENCH_OUT:-$ROOT/bench/out/cache-$(date -u +%Y%m%dT%H%M%SZ)}"
ARMS="${BENCH_ARMS:-direct pdgate-rr pdgate-ca-approx pdgate-ca-precise pdgate-ca-precise-do vllm-router-ca vllm-router-rr smg-ca smg-rr}"
WORKLOADS="${BENCH_WORKLOADS:-shared-prefix multi-turn random}"
ROUNDS="${BENCH_ROUNDS:-1}"
GROUPS_N="${BENCH_GROUPS:-6}"
PER_GROUP="${BENCH_PER_GROUP:-4}"
SYSTEM_WORDS="${BENCH_SYSTEM_WORDS:-600}"
QUESTION_WORDS="${BENCH_QUESTION_WORDS:-40}"
OUTPUT_TOKENS="${BENCH_OUTPUT_TOKENS:-8}"
CONCURRENCY="${BENCH_CONCURRENCY:-2}"
SESSIONS="${BENCH_SESSIONS:-6}"
TURNS="${BENCH_TURNS:-4}"
MT_SYSTEM_WORDS="${BENCH_MT_SYSTEM_WORDS:-500}"
DECODE_ONLY_BELOW="${BENCH_DECODE_ONLY_BELOW:-128}"
SPECULATIVE_TTL="${BENCH_SPECULATIVE_TTL:-30s}"
PREFILL_KV_MIB="${BENCH_PREFILL_KV_MIB:-32}"
DECODE_KV_MIB="${BENCH_DECODE_KV_MIB:-256}"
ARM_TIMEOUT="${BENCH_ARM_TIMEOUT:-600}"
VLLM_ROUTER_VERSION="${VLLM_ROUTER_VERSION:-0.1.17}"
SMG_VERSION="${SMG_VERSION:-1.13.*}"
BENCH_VENV="$CACHE/bench-venv"
START_TIMEOUT=900
NICE=(nice -n "${BENCH_NICE:-10}")
T0=$SECONDS

mkdir -p "$OUT/logs"
LOGS="$OUT/logs"
# The engines bind their KV-event PUB on ipc:// sockets here (a short path: ipc paths are capped
# near 100 bytes); removed on exit.
SOCKS="$(mktemp -d "${TMPDIR:-/tmp}/pdgate-cache.XXXXXX")"
RESULTS="$OUT/results.jsonl"
: >"$RESULTS"
log() { printf '[cache %s +%ss] %s\n' "$(date -u +%H:%M:%S)" "$((SECONDS - T0))" "$*" >&2; }

# ---- process bookkeeping: each process leads its own group; stopped by that id only --------
PGIDS=()
stop_pg() {
  local pg=$1 i
  kill -TERM -- "-$pg" 2>/dev/null || return 0
  for i in $(seq 1 30); do
    kill -0 -- "-$pg" 2>/dev/null || return 0
    sleep 0.5
  done
  kill -KILL -- "-$pg" 2>/dev/null || true
}
cleanup() {
  local pg
  for pg in "${PGIDS[@]}"; do stop_pg "$pg"; done
  rm -rf "$SOCKS"
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

group_rss_mb() { ps -o rss= --sid "$1" 2>/dev/null | awk '{s += $1} END {printf "%d", s / 1024}'; }

# ---- 1. engines' venv, model, gateways ----------------------------------------------------
install_venv
if [[ ! -f "$MODEL_DIR/pdgate-tiny-model.json" ]]; then
  log "building the bench model in $MODEL_DIR"
  rm -rf "$MODEL_DIR.tmp"
  HF_HUB_OFFLINE=1 timeout 900 "${NICE[@]}" "$PY" "$E2E/make_tiny_model.py" "$MODEL_DIR.tmp" --size bench \
    >"$LOGS/model.log" 2>&1
  mv "$MODEL_DIR.tmp" "$MODEL_DIR"
fi

want_router() { [[ " $ARMS " == *" vllm-router-"* || " $ARMS " == *" smg-"* ]]; }
# matplotlib draws the charts; without it (no registry) the run still prints its table.
ensure_matplotlib "$BENCH_VENV" "$LOGS" || true
if want_router && ! ensure_peers "$BENCH_VENV" "$LOGS"; then
  log "leaving the vllm-router and smg arms out"
  ARMS="$(for a in $ARMS; do [[ $a == vllm-router-* || $a == smg-* ]] || echo "$a"; done | xargs)"
fi

# ---- 2. engines ---------------------------------------------------------------------------
P1=$(free_port) P2=$(free_port) D=$(free_port)
declare -A EVENTS REPLAY
# KV events: each engine binds its PUB on an ipc:// socket (vLLM binds only for `*`, `::` or
# ipc://; `*` would be every interface) and a replay ROUTER on a loopback port; a precise pdgate
# connects to both. With nobody subscribed (the other arms) ZMQ drops the events.
for e in p1 p2 d; do EVENTS[$e]="ipc://$SOCKS/kv-$e.sock" REPLAY[$e]=$(free_port); done

# start_engine NAME PORT ROLE KV_MIB
start_engine() {
  local name=$1 port=$2 role=$3 mib=$4
  local ev="{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"${EVENTS[$name]}\",\"replay_endpoint\":\"tcp://127.0.0.1:${REPLAY[$name]}\",\"topic\":\"kv\"}"
  spawn "engine-$name" env PYTHONPATH="$E2E/pyhooks" VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 \
    VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_HOST_IP=127.0.0.1 UCX_NET_DEVICES=lo \
    VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1 VLLM_NIXL_SIDE_CHANNEL_PORT="$(free_port)" \
    VLLM_SERVER_DEV_MODE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
    "$PY" -m vllm.entrypoints.openai.api_server \
    --model "$MODEL_DIR" --served-model-name "$MODEL" --host 127.0.0.1 --port "$port" \
    --enforce-eager --dtype float32 --max-model-len 2048 \
    --kv-cache-memory-bytes $((mib * 1024 * 1024)) --block-size "$BLOCK" \
    --prefix-caching-hash-algo sha256_cbor --enable-prompt-tokens-details \
    --kv-events-config "$ev" \
    --kv-transfer-config "{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"$role\",\"kv_buffer_device\":\"cpu\"}"
  PG[$name]=$LAST_PG
}
declare -A PG
log "starting engines: prefill :$P1 :$P2 (${PREFILL_KV_MIB} MiB KV each), decode :$D (${DECODE_KV_MIB} MiB)"
t_eng=$SECONDS
start_engine p1 "$P1" kv_producer "$PREFILL_KV_MIB"
start_engine p2 "$P2" kv_producer "$PREFILL_KV_MIB"
start_engine d "$D" kv_consumer "$DECODE_KV_MIB"
# pdgate builds while the engines load.
PDGATE="${PDGATE_BIN:-}"
if [[ " $ARMS " == *" pdgate-"* && -z "$PDGATE" ]]; then
  log "building release pdgate (while the engines start)"
  (cd "$ROOT" && timeout 1800 "${NICE[@]}" cargo build -q --release -p pdgate) >"$LOGS/build.log" 2>&1 ||
    { log "pdgate build failed (see $LOGS/build.log)"; exit 1; }
  PDGATE="${CARGO_TARGET_DIR:-$ROOT/target}/release/pdgate"
fi
for e in p1:$P1 p2:$P2 d:$D; do
  name=${e%%:*} port=${e#*:}
  deadline=$((SECONDS + START_TIMEOUT))
  until curl -fsS -m 5 "http://127.0.0.1:$port/v1/models" 2>/dev/null | grep -q "\"id\":\"$MODEL\""; do
    if ! kill -0 "${PG[$name]}" 2>/dev/null || ((SECONDS > deadline)); then
      log "engine $name did not start (see $LOGS/engine-$name.log)"
      tail -n 20 "$LOGS/engine-$name.log" >&2
      exit 1
    fi
    sleep 2
  done
done
RSS="p1 $(group_rss_mb "${PG[p1]}") MB, p2 $(group_rss_mb "${PG[p2]}") MB, d $(group_rss_mb "${PG[d]}") MB"
log "engines ready after $((SECONDS - t_eng))s; RSS $RSS"
grep -h "KV cache size\|Maximum concurrency" "$LOGS"/engine-*.log >&2 || true
PURL1="http://127.0.0.1:$P1" PURL2="http://127.0.0.1:$P2" DURL="http://127.0.0.1:$D"

snap() { "$PY" "$ROOT/bench/cache_metrics.py" snap "p1=$PURL1" "p2=$PURL2" "d=$DURL" >"$1"; }
reset_caches() {
  local u
  for u in "$PURL1" "$PURL2" "$DURL"; do
    curl -fsS -m 30 -X POST "$u/reset_prefix_cache" -o /dev/null || log "reset_prefix_cache failed on $u"
  done
}

# ---- 3. arms ------------------------------------------------------------------------------
# pdgate_config ARM PORT FILE: pdgate's config per arm (sectioned keys, docs/operations.md).
pdgate_config() {
  local arm=$1 port=$2 file=$3 e url role
  {
    echo "listen = \"127.0.0.1:$port\""
    echo 'kv_connector = "shfs"'
    if [[ $arm == pdgate-rr ]]; then
      echo 'prefill_policy = "round_robin"'
      echo 'decode_policy = "round_robin"'
    else
      echo 'prefill_policy = "cache_aware"'
      echo 'decode_policy = "cache_aware"'
    fi
    if [[ $arm == pdgate-ca-precise* ]]; then
      echo '[cache]'
      echo "block_size = $BLOCK"
      echo "tokenizer = \"$MODEL_DIR/tokenizer.json\""
      # A CPU prefill of 600+ tokens takes seconds (more on a busy machine) and the engine
      # publishes BlockStored only once it ran: a decision's entry must outlive that.
      echo "speculative_ttl = \"$SPECULATIVE_TTL\""
      if [[ $arm == pdgate-ca-precise-do ]]; then echo "decode_only_below_tokens = $DECODE_ONLY_BELOW"; fi
    fi
    for e in p1:$PURL1 p2:$PURL2 d:$DURL; do
      url=${e#*:} e=${e%%:*}
      role=prefill
      [[ $e == d ]] && role=decode
      echo "[[$role]]"
      echo "url = \"$url\""
      echo "name = \"$e\""
      echo "model = \"$MODEL\""
      if [[ $arm == pdgate-ca-precise* ]]; then
        echo "kv_events = \"${EVENTS[$e]}\""
        echo "kv_events_replay = \"tcp://127.0.0.1:${REPLAY[$e]}\""
      fi
    done
  } >"$file"
}

# start_arm ARM PORT: starts the arm's gateway (none for direct); sets ARM_PG (or empty).
start_arm() {
  local arm=$1 port=$2 policy
  ARM_PG=""
  case "$arm" in
    direct) return 0 ;;
    pdgate-*)
      pdgate_config "$arm" "$port" "$OUT/$arm.toml"
      spawn "$arm-$port" env RUST_LOG=warn "$PDGATE" --config "$OUT/$arm.toml"
      ;;
    vllm-router-*)
      [[ $arm == *-ca ]] && policy=cache_aware || policy=round_robin
      spawn "$arm-$port" "$BENCH_VENV/bin/vllm-router" --vllm-pd-disaggregation \
        --prefill "$PURL1" --prefill "$PURL2" --decode "$DURL" --kv-connector nixl \
        --prefill-policy "$policy" --decode-policy "$policy" \
        --host 127.0.0.1 --port "$port" --prometheus-port "$(free_port)" \
        --log-level warning --worker-startup-check-interval 1
      ;;
    smg-*)
      [[ $arm == *-ca ]] && policy=cache_aware || policy=round_robin
      spawn "$arm-$port" "$BENCH_VENV/bin/smg" launch --pd-disaggregation --backend vllm \
        --prefill "$PURL1" --prefill "$PURL2" --decode "$DURL" \
        --prefill-policy "$policy" --decode-policy "$policy" \
        --host 127.0.0.1 --port "$port" --prometheus-port "$(free_port)" --log-level warn
      ;;
    *)
      log "unknown arm $arm"
      return 1
      ;;
  esac
  ARM_PG=$LAST_PG
  local deadline=$((SECONDS + 120))
  until curl -fsS -m 2 -o /dev/null "http://127.0.0.1:$port/health" 2>/dev/null ||
    curl -fsS -m 2 -o /dev/null "http://127.0.0.1:$port/ready" 2>/dev/null; do
    if ! kill -0 "$ARM_PG" 2>/dev/null || ((SECONDS > deadline)); then
      log "$arm did not become ready (see $LOGS/$arm-$port.log)"
      tail -n 15 "$LOGS/$arm-$port.log" >&2
      stop_pg "$ARM_PG"
      return 1
    fi
    sleep 0.5
  done
}

# run_trace ARM WORKLOAD PORT OUT_JSON SENT_JSONL: the arm's load (bench/cache_trace.py).
run_trace() {
  local arm=$1 wl=$2 port=$3 out=$4 sent=$5 target sys=$SYSTEM_WORDS
  if [[ $arm == direct ]]; then target=(--direct "$PURL1,$PURL2" --decode "$DURL"); else target=(--url "http://127.0.0.1:$port"); fi
  [[ $wl == multi-turn ]] && sys=$MT_SYSTEM_WORDS
  timeout "$ARM_TIMEOUT" "${NICE[@]}" python3 "$ROOT/bench/cache_trace.py" "${target[@]}" --model "$MODEL" \
    --workload "$wl" --groups "$GROUPS_N" --per-group "$PER_GROUP" --sessions "$SESSIONS" --turns "$TURNS" \
    --system-words "$sys" --question-words "$QUESTION_WORDS" --output-tokens "$OUTPUT_TOKENS" \
    --concurrency "$CONCURRENCY" --sent "$sent" >"$out" 2>"$LOGS/trace-$arm-$wl.err"
}

CELLS_TOTAL=$((ROUNDS * $(wc -w <<<"$WORKLOADS") * $(wc -w <<<"$ARMS")))
CELLS_DONE=0
LOADS=()
for round in $(seq 1 "$ROUNDS"); do
  for wl in $WORKLOADS; do
    for arm in $ARMS; do
      CELLS_DONE=$((CELLS_DONE + 1))
      log "cell $CELLS_DONE of $CELLS_TOTAL ($((CELLS_TOTAL - CELLS_DONE)) left): round $round, $wl, $arm"
      port=$(free_port)
      reset_caches
      rc=0
      start_arm "$arm" "$port" || rc=$?
      if ((rc != 0)); then
        echo "{\"arm\":\"$arm\",\"workload\":\"$wl\",\"failed\":\"gateway did not start\"}" >>"$OUT/failures.jsonl"
        continue
      fi
      tag="r$round-$wl-$arm"
      snap "$OUT/$tag.before.json"
      t_arm=$SECONDS
      if ! run_trace "$arm" "$wl" "$port" "$OUT/$tag.trace.json" "$OUT/$tag.sent.jsonl"; then
        log "$tag: trace failed (see $LOGS/trace-$arm-$wl.err)"
        echo '{}' >"$OUT/$tag.trace.json"
      fi
      snap "$OUT/$tag.after.json"
      LOADS+=("$(cut -d' ' -f1 /proc/loadavg)")
      "$PY" "$ROOT/bench/cache_metrics.py" gw "http://127.0.0.1:$port" >"$OUT/$tag.gw.json"
      if [[ $arm == pdgate-* ]]; then curl -fsS -m 10 "http://127.0.0.1:$port/metrics" -o "$OUT/$tag.gw.prom" || true; fi
      if [[ -n "$ARM_PG" ]]; then stop_pg "$ARM_PG"; fi
      # The oracle of what this arm sent (multi-turn histories hold each arm's own answers).
      "$PY" "$ROOT/bench/cache_metrics.py" oracle "$PURL1" "$MODEL" "$BLOCK" "$OUT/$tag.sent.jsonl" \
        >"$OUT/$tag.oracle.json" || echo '{}' >"$OUT/$tag.oracle.json"
      "$PY" "$ROOT/bench/cache_metrics.py" row "$arm" "$wl" "$OUT/$tag.before.json" "$OUT/$tag.after.json" \
        "$OUT/$tag.trace.json" "$OUT/$tag.oracle.json" "$OUT/$tag.gw.json" >>"$RESULTS"
      log "$tag: $((SECONDS - t_arm))s $(tail -n 1 "$RESULTS" | cut -c1-200)"
    done
  done
done

LOAD_RANGE="$(printf '%s\n' "${LOADS[@]:-0}" | sort -n | sed -n '1p;$p' | xargs | tr ' ' '-')"
{
  echo "bench/cache.sh: $(date -u +%Y-%m-%dT%H:%MZ), HEAD $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)," \
    "$(nproc) CPUs ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)), $(free -g | awk '/Mem:/ {print $2}') GiB," \
    "1-min load average at the end of each cell $LOAD_RANGE; $((SECONDS - T0))s in all"
  echo "vLLM 0.32.0 CPU, model $MODEL (hidden 768, 6 layers), block $BLOCK, prefill KV ${PREFILL_KV_MIB} MiB each," \
    "decode KV ${DECODE_KV_MIB} MiB; shared-prefix/random ${GROUPS_N}x${PER_GROUP}, system ${SYSTEM_WORDS} words;" \
    "multi-turn ${SESSIONS}x${TURNS}, system ${MT_SYSTEM_WORDS} words; question ${QUESTION_WORDS} words, output ${OUTPUT_TOKENS}," \
    "concurrency $CONCURRENCY, $ROUNDS round(s); engine RSS $RSS"
  echo "hit = prefill prefix hits / prefill tokens queried (engine counters); oracle = one infinite cache over what was sent;"
  echo "P/D comp = prompt tokens computed on the prefills / on the decode; D ext = tokens the decode pulled over NIXL;"
  echo "D local = decode prefix-cache hits; D-only = pdgate's decode-only decisions; rounds pooled (sums, percentiles of all requests)"
  "$PY" "$ROOT/bench/cache_metrics.py" table "$RESULTS" "$OUT/summary.json"
  if [[ -f "$OUT/failures.jsonl" ]]; then cat "$OUT/failures.jsonl"; fi
} | tee "$OUT/table.txt"
if [[ -x "$BENCH_VENV/bin/python" ]]; then
  "$BENCH_VENV/bin/python" "$ROOT/bench/cache_charts.py" "$OUT/summary.json" "$OUT" ||
    log "charts failed (no matplotlib?)"
fi
