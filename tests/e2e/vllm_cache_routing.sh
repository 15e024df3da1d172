#!/usr/bin/env bash
# pdgate's cache-aware routing against real vLLM engines on CPU (tiny model, NixlConnector).
#
# Starts two prefill engines (kv_producer) and one decode engine (kv_consumer), each with
# --block-size 32, sha256_cbor hashing, prompt-token details and KV events on its own ipc://
# PUB (the engine binds it; a replay ROUTER on a loopback TCP port), and two pdgate instances
# from a config file with `kv_events` per endpoint, `--prefill-policy cache_aware
# --decode-policy cache_aware`, the model's tokenizer.json and block size 32: one running every
# request through both legs, one that serves a request on the decode alone when the decode holds
# its prefix. tests/e2e/check_cache_routing.py then checks, per request, pdgate's predicted cached
# tokens against the engines' /metrics and usage, that shared prefixes land where they are
# cached, that a follow-up turn is served decode-only from the decode's cache, that a restarted
# prefill engine is purged from the index and routing recovers, and that outputs equal a plain
# engine's. The engines also serve LoRA adapters (random weights, tests/e2e/make_lora.py): adapter
# requests reach only prefills serving them, predictions equal the engines' hits per adapter,
# and adapters loaded or unloaded at run time are learned (phase `lora`). Cleans up everything.
#
# Environment:
#   PDGATE_CACHE             cache root (default ~/.cache/pdgate): vllm-venv/, tiny-llama/
#   PDGATE_BIN               the pdgate binary (default: the debug build, built when missing)
#   PDGATE_E2E_START_TIMEOUT seconds to wait for the engines (default 900)
#   PDGATE_E2E_KEEP_LOGS=1   keep the work dir with all logs
# Exit: 0 all checks passed; 77 (SKIP) only where vLLM cannot run (not x86_64 Linux).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
START_TIMEOUT="${PDGATE_E2E_START_TIMEOUT:-900}"
GATEWAY_TIMEOUT=60
BLOCK=32
T0=$SECONDS

E2E_NAME=vllm_cache_routing
# shellcheck source-path=SCRIPTDIR
source "$HERE/lib.sh"
declare -A PG    # engine name -> process group id
declare -A PORT  # engine name -> HTTP port
declare -A SIDE  # engine name -> NIXL side-channel port
declare -A ROLE  # engine name -> kv_producer | kv_consumer

e2e_prepare vllm_cache_routing

pdgate_binary

# Per engine: HTTP, NIXL side channel, KV-event replay.
read -r -a PORTS < <(free_ports 9)
ENGINES=(prefill1 prefill2 decode)
for i in 0 1 2; do
  e=${ENGINES[$i]}
  PORT[$e]=${PORTS[$i]}
  SIDE[$e]=${PORTS[$((i + 3))]}
  REPLAY[$i]=${PORTS[$((i + 6))]}
done
ROLE[prefill1]=kv_producer ROLE[prefill2]=kv_producer ROLE[decode]=kv_consumer
declare -A REPLAY_PORT=([prefill1]=${REPLAY[0]} [prefill2]=${REPLAY[1]} [decode]=${REPLAY[2]})
# The engine's PUB binds an ipc:// endpoint (it binds only for `*`, `::` or ipc://, and `*` would
# mean every interface); pdgate's SUB connects to it. The replay ROUTER always binds.
events_pub() { echo "ipc://$WORK/kv-$1.sock"; }

# LoRA adapters (random weights, made here in seconds): prefill1 serves `a` and `b`, prefill2 `b`,
# the decode both. `c` is loaded and unloaded at run time by the checker (lora phase).
declare -A LORAS=([prefill1]="a b" [prefill2]="b" [decode]="a b")
for adapter in a b c; do
  "$PY" "$HERE/make_lora.py" "$MODEL_DIR" "$WORK/lora-$adapter" "$(printf '%d' "'$adapter")"
done
lora_modules() {
  local adapter out=()
  for adapter in ${LORAS[$1]}; do out+=("$adapter=$WORK/lora-$adapter"); done
  echo "${out[@]}"
}

# start_engine NAME: in its own session (process group), under nice; sets PG[NAME].
start_engine() {
  local name=$1
  local -a loras
  read -r -a loras < <(lora_modules "$name")
  local events="{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"$(events_pub "$name")\",\"replay_endpoint\":\"tcp://127.0.0.1:${REPLAY_PORT[$name]}\",\"topic\":\"kv\"}"
  # pyhooks/sitecustomize.py stops NIXL's progress thread from busy-polling a core.
  env PYTHONPATH="$HERE/pyhooks" VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 \
    VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_HOST_IP=127.0.0.1 UCX_NET_DEVICES=lo \
    VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1 VLLM_NIXL_SIDE_CHANNEL_PORT="${SIDE[$name]}" \
    VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_ALLOW_RUNTIME_LORA_UPDATING=True \
    setsid nice -n 10 "$PY" -m vllm.entrypoints.openai.api_server \
    --model "$MODEL_DIR" --served-model-name tiny --host 127.0.0.1 --port "${PORT[$name]}" \
    --enforce-eager --dtype float32 --max-model-len 512 --kv-cache-memory-bytes 33554432 \
    --block-size "$BLOCK" --prefix-caching-hash-algo sha256_cbor --enable-prompt-tokens-details \
    --kv-events-config "$events" \
    --enable-lora --max-lora-rank 8 --max-loras 2 --lora-modules "${loras[@]}" \
    --kv-transfer-config "{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"${ROLE[$name]}\",\"kv_buffer_device\":\"cpu\"}" \
    </dev/null >>"$WORK/$name.log" 2>&1 &
  local pid=$!
  disown "$pid"
  PGIDS+=("$pid")
  PG[$name]=$pid
}

# stop_engine NAME: TERM its group, KILL after STOP_GRACE seconds.
stop_engine() {
  local pg=${PG[$1]} deadline=$((SECONDS + STOP_GRACE))
  kill -TERM -- "-$pg" 2>/dev/null || true
  while kill -0 -- "-$pg" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.5; done
  kill -KILL -- "-$pg" 2>/dev/null || true
}

rss_all() {
  local e out=""
  for e in "${ENGINES[@]}"; do out+="$e $(group_rss_mb "${PG[$e]}") "; done
  echo "$out"
}

log "starting engines: prefill1 :${PORT[prefill1]} prefill2 :${PORT[prefill2]} decode :${PORT[decode]}"
for e in "${ENGINES[@]}"; do start_engine "$e"; done
t_eng=$SECONDS
ENGINE_DEADLINE=$((SECONDS + START_TIMEOUT))
for e in "${ENGINES[@]}"; do wait_engine "$e" "${PORT[$e]}" "${PG[$e]}"; done
log "engines ready after $((SECONDS - t_eng))s; RSS MB: $(rss_all)"
grep -h "KV cache size" "$WORK/decode.log" | head -1 || true

# ---- gateways: one config file each ---------------------------------------------------------
# write_config FILE LISTEN_PORT DECODE_ONLY_BELOW HEALTH_CHECKS
write_config() {
  local file=$1 port=$2 below=$3 health=$4 e role
  {
    echo "listen = \"127.0.0.1:$port\""
    echo 'kv_connector = "shfs"'
    echo 'prefill_policy = "cache_aware"'
    echo 'decode_policy = "cache_aware"'
    echo "health_checks = $health"
    echo 'health_check_interval = "1s"'
    echo 'unhealthy_threshold = 2'
    echo '[security]'
    echo 'expose_target_headers = true'
    echo '[cache]'
    echo "block_size = $BLOCK"
    echo "tokenizer = \"$MODEL_DIR/tokenizer.json\""
    echo "decode_only_below_tokens = $below"
    for e in "${ENGINES[@]}"; do
      role=prefill
      [[ ${ROLE[$e]} == kv_consumer ]] && role=decode
      echo "[[$role]]"
      echo "url = \"http://127.0.0.1:${PORT[$e]}\""
      echo "name = \"$e\""
      echo 'model = "tiny"'
      echo "kv_events = \"$(events_pub "$e")\""
      echo "kv_events_replay = \"tcp://127.0.0.1:${REPLAY_PORT[$e]}\""
    done
  } >"$file"
}

# routing_gateway_args NAME PORT DECODE_ONLY_BELOW [HEALTH_CHECKS]: a config file and the flags
# of one gateway (start_gateway, lib.sh), with the JSON access log.
routing_gateway_args() {
  write_config "$WORK/$1.toml" "$2" "$3" "${4:-true}"
  GATEWAY_ARGS=(--config "$WORK/$1.toml" --log-format json)
}

start_gateway gateway-pd GW_PORT routing_gateway_args 0
start_gateway gateway-decode-only GWDO_PORT routing_gateway_args 100000
# Without health checks the restarted engine never leaves the routable set: its subscription
# stays, and pdgate sees the engine's sequence start again.
start_gateway gateway-no-health GWNH_PORT routing_gateway_args 0 false
log "pdgate ready on :$GW_PORT (both legs), :$GWDO_PORT (decode-only below 100000 tokens)," \
  ":$GWNH_PORT (no health checks)"

CHECK=(
  "$PY" "$HERE/check_cache_routing.py" --state "$WORK/state.json" --block-size "$BLOCK"
  --gateway "http://127.0.0.1:$GW_PORT" --gateway-decode-only "http://127.0.0.1:$GWDO_PORT"
  --gateway-no-health "http://127.0.0.1:$GWNH_PORT"
)
for e in "${ENGINES[@]}"; do CHECK+=(--engine "$e=http://127.0.0.1:${PORT[$e]}"); done

t_chk=$SECONDS
rc=0
timeout 300 "${CHECK[@]}" --phase before || rc=1
timeout 180 "${CHECK[@]}" --phase lora --lora-dir "$WORK" || rc=1
VICTIM=$(cat "$WORK/state.json.victim" 2>/dev/null || echo prefill2)
log "restarting $VICTIM (RSS MB before: $(rss_all))"
stop_engine "$VICTIM"
timeout 120 "${CHECK[@]}" --phase down --victim "$VICTIM" || rc=1
t_restart=$SECONDS
start_engine "$VICTIM"
ENGINE_DEADLINE=$((SECONDS + START_TIMEOUT))
wait_engine "$VICTIM" "${PORT[$VICTIM]}" "${PG[$VICTIM]}"
log "$VICTIM back after $((SECONDS - t_restart))s"
timeout 300 "${CHECK[@]}" --phase after --victim "$VICTIM" || rc=1
log "checks took $((SECONDS - t_chk))s (restart included); RSS MB: $(rss_all)"
exit "$rc"
