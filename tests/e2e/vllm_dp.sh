#!/usr/bin/env bash
# pdgate routing to the data-parallel ranks of a real vLLM engine on CPU (tiny model).
#
# Starts a prefill engine with `--data-parallel-size 2` (two engine cores behind one URL, vLLM's
# internal load balancing, `X-data-parallel-rank` honoured) and a decode engine, and pdgate in
# front with `data_parallel_size = 2` on the prefill and cache-aware routing (approximate keys
# from the model's tokenizer: vLLM refuses ipc:// KV-event endpoints with more than one rank and
# its tcp:// publisher binds only on every interface, which a test on loopback does not do).
# No KV moves here: the engines run without a KV connector, so the decode recomputes the prompt
# (with NixlConnector, vLLM 0.32 on CPU hung the decode's first pull from a 2-rank producer; KV
# transfer itself is vllm_cpu.sh's). tests/e2e/check_dp.py then checks, per request, that
# pdgate's predicted cached tokens equal the prefix-cache hits of the rank it chose (the
# engine's per-rank /metrics) and the answer's usage, that a group's questions stay on the rank
# holding its prefix, and that both ranks are used. Cleans up everything.
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
RANKS=2
T0=$SECONDS

E2E_NAME=vllm_dp
# shellcheck source-path=SCRIPTDIR
source "$HERE/lib.sh"
declare -A PG PORT

e2e_prepare vllm_dp

pdgate_binary

read -r -a PORTS < <(free_ports 2)
PORT[prefill]=${PORTS[0]} PORT[decode]=${PORTS[1]}

# start_engine NAME [vLLM args...]: in its own session (process group), under nice; sets PG[NAME].
start_engine() {
  local name=$1
  shift
  env VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 VLLM_HOST_IP=127.0.0.1 \
    VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
    setsid nice -n 10 "$PY" -m vllm.entrypoints.openai.api_server \
    --model "$MODEL_DIR" --served-model-name tiny --host 127.0.0.1 --port "${PORT[$name]}" \
    --enforce-eager --dtype float32 --max-model-len 512 --kv-cache-memory-bytes 33554432 \
    --block-size "$BLOCK" --enable-prompt-tokens-details \
    "$@" </dev/null >>"$WORK/$name.log" 2>&1 &
  local pid=$!
  disown "$pid"
  PGIDS+=("$pid")
  PG[$name]=$pid
}

log "starting engines: prefill :${PORT[prefill]} ($RANKS data-parallel ranks), decode :${PORT[decode]}"
start_engine prefill --data-parallel-size "$RANKS"
start_engine decode
t_eng=$SECONDS
ENGINE_DEADLINE=$((SECONDS + START_TIMEOUT))
wait_engine prefill "${PORT[prefill]}" "${PG[prefill]}"
wait_engine decode "${PORT[decode]}" "${PG[decode]}"
log "engines ready after $((SECONDS - t_eng))s; RSS MB: prefill $(group_rss_mb "${PG[prefill]}") decode $(group_rss_mb "${PG[decode]}")"

dp_gateway_args() {
  local file="$WORK/$1.toml"
  {
    echo "listen = \"127.0.0.1:$2\""
    echo 'kv_connector = "shfs"'
    echo 'prefill_policy = "cache_aware"'
    echo 'decode_policy = "cache_aware"'
    echo 'health_check_interval = "1s"'
    echo '[security]'
    echo 'expose_target_headers = true'
    echo '[cache]'
    echo "block_size = $BLOCK"
    echo "tokenizer = \"$MODEL_DIR/tokenizer.json\""
    echo 'decode_only_below_tokens = 0'
    echo '[[prefill]]'
    echo "url = \"http://127.0.0.1:${PORT[prefill]}\""
    echo 'name = "prefill"'
    echo 'model = "tiny"'
    echo "data_parallel_size = $RANKS"
    echo '[[decode]]'
    echo "url = \"http://127.0.0.1:${PORT[decode]}\""
    echo 'name = "decode"'
    echo 'model = "tiny"'
  } >"$file"
  GATEWAY_ARGS=(--config "$file" --log-format json)
}
start_gateway gateway GW_PORT dp_gateway_args
log "pdgate ready on :$GW_PORT"

t_chk=$SECONDS
rc=0
timeout 300 "$PY" "$HERE/check_dp.py" --gateway "http://127.0.0.1:$GW_PORT" \
  --prefill "http://127.0.0.1:${PORT[prefill]}" --ranks "$RANKS" --block-size "$BLOCK" || rc=1
log "checks took $((SECONDS - t_chk))s"
exit "$rc"
