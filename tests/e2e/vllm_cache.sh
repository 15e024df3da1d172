#!/usr/bin/env bash
# Real-engine facts behind pdgate's cache-aware routing (vLLM 0.32 CPU, tiny model).
#
# Starts ONE vLLM engine with --block-size 32, sha256_cbor hashing, prompt-token details and
# KV events to a SUB bound by tests/e2e/kv_events_check.py, and runs that check: events decode,
# BlockStored tokens == /tokenize, hashes reproducible, prefix-hit deltas and usage.cached_tokens
# == the "longest stored prefix, capped at floor((n-1)/bs)*bs" prediction, replay over DEALER.
#
# With PDGATE_E2E_PD_PROBE=1 it also starts a NixlConnector prefill/decode pair and runs
# tests/e2e/pd_endpoints_probe.py (two-leg PD on /v1/responses and /v1/messages; reports, does
# not fail the stage).
#
# Environment:
#   PDGATE_CACHE             cache root (default ~/.cache/pdgate): vllm-venv/, tiny-llama/
#   PDCACHE_TOKENS_BIN       pdcache's `tokens` example: also check pdcache's tokenizer + hash
#   PDGATE_E2E_PD_PROBE=1    also probe PD on /v1/responses and /v1/messages
#   PDGATE_E2E_START_TIMEOUT seconds to wait for the engines (default 600)
#   PDGATE_E2E_KEEP_LOGS=1   keep the work dir with all logs
# Exit: 0 all checks passed; 77 (SKIP) only where vLLM cannot run (not x86_64 Linux).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
START_TIMEOUT="${PDGATE_E2E_START_TIMEOUT:-600}"
BLOCK=32
T0=$SECONDS

E2E_NAME=vllm_cache
# shellcheck source-path=SCRIPTDIR
source "$HERE/lib.sh"

e2e_prepare kv_events

read -r -a PORTS < <(free_ports 8)
ENG_PORT=${PORTS[0]} SUB_PORT=${PORTS[1]} REPLAY_PORT=${PORTS[2]}
P_PORT=${PORTS[3]} D_PORT=${PORTS[4]}

# start_engine NAME HTTP_PORT SIDE_CHANNEL_PORT EXTRA_ARGS...; sets LAST_PG.
start_engine() {
  local name=$1 port=$2 side=$3
  shift 3
  env PYTHONPATH="$HERE/pyhooks" VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 \
    VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_HOST_IP=127.0.0.1 UCX_NET_DEVICES=lo \
    VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1 VLLM_NIXL_SIDE_CHANNEL_PORT="$side" \
    VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
    setsid nice -n 10 "$PY" -m vllm.entrypoints.openai.api_server \
    --model "$MODEL_DIR" --served-model-name tiny --host 127.0.0.1 --port "$port" \
    --enforce-eager --dtype float32 --max-model-len 512 \
    --kv-cache-memory-bytes 134217728 "$@" \
    </dev/null >"$WORK/$name.log" 2>&1 &
  LAST_PG=$!
  disown "$LAST_PG"
  PGIDS+=("$LAST_PG")
}

EVENTS_CFG="{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://127.0.0.1:$SUB_PORT\",\"replay_endpoint\":\"tcp://127.0.0.1:$REPLAY_PORT\",\"topic\":\"kv\"}"
CACHE_ARGS=(--block-size "$BLOCK" --prefix-caching-hash-algo sha256_cbor --enable-prompt-tokens-details)
log "starting engine :$ENG_PORT (events to SUB :$SUB_PORT, replay :$REPLAY_PORT)"
start_engine events "$ENG_PORT" "${PORTS[5]}" "${CACHE_ARGS[@]}" --kv-events-config "$EVENTS_CFG"
EV_PG=$LAST_PG
PROBE="${PDGATE_E2E_PD_PROBE:-0}"
if [[ "$PROBE" == 1 ]]; then
  log "starting P/D pair: prefill :$P_PORT decode :$D_PORT"
  start_engine prefill "$P_PORT" "${PORTS[6]}" "${CACHE_ARGS[@]}" \
    --kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_buffer_device":"cpu"}'
  P_PG=$LAST_PG
  start_engine decode "$D_PORT" "${PORTS[7]}" "${CACHE_ARGS[@]}" \
    --kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_buffer_device":"cpu"}'
  D_PG=$LAST_PG
fi
t_eng=$SECONDS
ENGINE_DEADLINE=$((SECONDS + START_TIMEOUT))
wait_engine events "$ENG_PORT" "$EV_PG"
if [[ "$PROBE" == 1 ]]; then
  wait_engine prefill "$P_PORT" "$P_PG"
  wait_engine decode "$D_PORT" "$D_PG"
fi
log "engines ready after $((SECONDS - t_eng))s; RSS MB: events $(group_rss_mb "$EV_PG")$([[ "$PROBE" == 1 ]] && echo " prefill $(group_rss_mb "$P_PG") decode $(group_rss_mb "$D_PG")")"
grep -h "KV cache size\|Maximum concurrency" "$WORK/events.log" | head -2 || true

CHECK=(--engine "http://127.0.0.1:$ENG_PORT" --sub-port "$SUB_PORT" --replay-port "$REPLAY_PORT" --block-size "$BLOCK")
if [[ -n "${PDCACHE_TOKENS_BIN:-}" && ! -x "${PDCACHE_TOKENS_BIN}" ]]; then
  log "PDCACHE_TOKENS_BIN=$PDCACHE_TOKENS_BIN is not an executable: pdcache not checked"
elif [[ -n "${PDCACHE_TOKENS_BIN:-}" ]]; then
  CHECK+=(--pdcache-tokens "$PDCACHE_TOKENS_BIN" --tokenizer "$MODEL_DIR/tokenizer.json")
fi
t_chk=$SECONDS
rc=0
timeout 300 "$PY" "$HERE/kv_events_check.py" "${CHECK[@]}" || rc=$?
log "kv_events check took $((SECONDS - t_chk))s (exit $rc)"
if [[ "$PROBE" == 1 ]]; then
  timeout 300 "$PY" "$HERE/pd_endpoints_probe.py" --prefill "http://127.0.0.1:$P_PORT" \
    --decode "http://127.0.0.1:$D_PORT" || log "pd_endpoints_probe exited $?"
fi
exit "$rc"
