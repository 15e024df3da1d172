#!/usr/bin/env bash
# pdgate against real vLLM engines on CPU (NixlConnector, KV moved in host memory).
#
# Installs vLLM (cached virtualenv), builds a tiny random-weight model (cached),
# starts a plain baseline engine, two prefill engines and one decode engine, puts
# pdgate (--kv-connector shfs) in front and runs tests/e2e/check_pd.py:
# completions and chat, streaming and not (also through `pdgate ext-proc`, Envoy played by
# pdgate's envoy_ext_proc example), KV transfer proven on the decode
# engine's /metrics, outputs equal to the baseline, /v1/responses and /v1/messages
# through PD (prefill engine's prompt tokens, NIXL pulls), /tokenize and /detokenize
# passed through, two prefills both used, a
# killed prefill and a killed decode answered cleanly; and `pdgate check` proves both
# prefill/decode pairs move their KV. Cleans up everything.
#
# Environment:
#   PDGATE_CACHE           cache root (default ~/.cache/pdgate): vllm-venv/, tiny-llama/
#   PDGATE_BIN             use this pdgate binary instead of building it
#   PDGATE_E2E_DIRECT=1    no pdgate: the checker plays the gateway (proves engines + handoff)
#   PDGATE_E2E_START_TIMEOUT  seconds to wait for all engines to be ready (default 900)
#   PDGATE_E2E_KEEP_LOGS=1 keep the work dir with all logs
# Exit: 0 all checks passed; 77 (SKIP) only where vLLM cannot run (not x86_64 Linux).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
START_TIMEOUT="${PDGATE_E2E_START_TIMEOUT:-900}"
GATEWAY_TIMEOUT=60
T0=$SECONDS

E2E_NAME=vllm_cpu
# shellcheck source-path=SCRIPTDIR
source "$HERE/lib.sh"
declare -A PG # engine name -> process group id

# ---- 1-2. engines installed (or exit 77 where vLLM cannot run), tiny model (cached): lib.sh ---------------
e2e_prepare vllm_cpu

# ---- 3. pdgate binary ---------------------------------------------------------------
DIRECT="${PDGATE_E2E_DIRECT:-0}"
PDGATE="${PDGATE_BIN:-}"
if [[ "$DIRECT" != 1 && -z "$PDGATE" ]]; then
  log "building pdgate"
  (cd "$REPO" && timeout 1800 cargo build -q -p pdgate --bin pdgate)
  PDGATE="${CARGO_TARGET_DIR:-$REPO/target}/debug/pdgate"
fi
if [[ "$DIRECT" != 1 && ! -x "$PDGATE" ]]; then
  log "pdgate binary not found at $PDGATE"
  exit 1
fi

# ---- 4. ports -----------------------------------------------------------------------
# 4 engine HTTP ports and 4 NIXL side-channel ports, all free now. Gateway ports are picked
# when each gateway starts: the engines bind ephemeral ports of their own while they load.
read -r -a PORTS < <(free_ports 8)
BASE_PORT=${PORTS[0]} P1_PORT=${PORTS[1]} P2_PORT=${PORTS[2]} D_PORT=${PORTS[3]}

# ---- 5. engines ---------------------------------------------------------------------
# start_engine NAME HTTP_PORT SIDE_CHANNEL_PORT [kv_producer|kv_consumer]
start_engine() {
  local name=$1 port=$2 side=$3 role=${4:-} kv=()
  if [[ -n "$role" ]]; then
    kv=(--kv-transfer-config "{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"$role\",\"kv_buffer_device\":\"cpu\"}")
  fi
  # pyhooks/sitecustomize.py stops NIXL's progress thread from busy-polling a core.
  env PYTHONPATH="$HERE/pyhooks" VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 \
    VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_HOST_IP=127.0.0.1 UCX_NET_DEVICES=lo \
    VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1 VLLM_NIXL_SIDE_CHANNEL_PORT="$side" \
    VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
    setsid "$PY" -m vllm.entrypoints.openai.api_server \
    --model "$MODEL_DIR" --served-model-name tiny --host 127.0.0.1 --port "$port" \
    --enforce-eager --dtype float32 --max-model-len 512 \
    --kv-cache-memory-bytes 134217728 "${kv[@]}" \
    </dev/null >"$WORK/$name.log" 2>&1 &
  local pid=$!
  disown "$pid" # no job-control notices when the checker kills it
  PGIDS+=("$pid")
  PG[$name]=$pid
}

log "starting 4 engines: baseline :$BASE_PORT, prefill :$P1_PORT :$P2_PORT, decode :$D_PORT"
start_engine baseline "$BASE_PORT" "${PORTS[4]}"
start_engine prefill1 "$P1_PORT" "${PORTS[5]}" kv_producer
start_engine prefill2 "$P2_PORT" "${PORTS[6]}" kv_producer
start_engine decode "$D_PORT" "${PORTS[7]}" kv_consumer
t_engines=$SECONDS
ENGINE_DEADLINE=$((SECONDS + START_TIMEOUT)) # one bound for all four (they start together)
wait_engine baseline "$BASE_PORT" "${PG[baseline]}"
wait_engine prefill1 "$P1_PORT" "${PG[prefill1]}"
wait_engine prefill2 "$P2_PORT" "${PG[prefill2]}"
wait_engine decode "$D_PORT" "${PG[decode]}"
log "engines ready after $((SECONDS - t_engines))s; RSS MB: baseline $(group_rss_mb "${PG[baseline]}")" \
  "prefill1 $(group_rss_mb "${PG[prefill1]}") prefill2 $(group_rss_mb "${PG[prefill2]}") decode $(group_rss_mb "${PG[decode]}")"

# ---- 6. gateways --------------------------------------------------------------------
# cpu_gateway_args NAME PORT PREFILL_ARGS...: the flags of one gateway (start_gateway, lib.sh).
cpu_gateway_args() {
  local port=$2
  shift 2
  GATEWAY_ARGS=("$@" --decode "http://127.0.0.1:$D_PORT" --kv-connector shfs --expose-target-headers true
    --listen "127.0.0.1:$port")
}

CHECK_ARGS=(
  --baseline "http://127.0.0.1:$BASE_PORT"
  --prefill "http://127.0.0.1:$P1_PORT" --prefill-pgid "${PG[prefill1]}"
  --prefill "http://127.0.0.1:$P2_PORT" --prefill-pgid "${PG[prefill2]}"
  --decode "http://127.0.0.1:$D_PORT" --decode-pgid "${PG[decode]}"
)
if [[ "$DIRECT" == 1 ]]; then
  log "PDGATE_E2E_DIRECT=1: the checker plays the gateway"
  CHECK_ARGS+=(--direct)
else
  start_gateway gateway-1p GW1_PORT cpu_gateway_args --prefill "http://127.0.0.1:$P1_PORT"
  start_gateway gateway-2p GW2_PORT cpu_gateway_args --prefill "http://127.0.0.1:$P1_PORT" --prefill "http://127.0.0.1:$P2_PORT"
  log "pdgate ready on :$GW1_PORT (1 prefill) and :$GW2_PORT (2 prefills)"
  CHECK_ARGS+=(--gateway-one "http://127.0.0.1:$GW1_PORT" --gateway-two "http://127.0.0.1:$GW2_PORT")
  # ext-proc mode with the first prefill, Envoy played by pdgate's example client (built by
  # `cargo test --workspace` beside the binaries; no Envoy can be installed here).
  ENVOY="${PDGATE_ENVOY_BIN:-$(dirname "$PDGATE")/examples/envoy_ext_proc}"
  if [[ ! -x "$ENVOY" ]]; then
    log "building the envoy_ext_proc example"
    (cd "$REPO" && timeout 1800 cargo build -q -p pdgate --example envoy_ext_proc)
    ENVOY="${CARGO_TARGET_DIR:-$REPO/target}/debug/examples/envoy_ext_proc"
  fi
  cpu_ext_proc_args() {
    cpu_gateway_args "$@"
    GATEWAY_ARGS=(ext-proc "${GATEWAY_ARGS[@]}")
  }
  start_gateway ext-proc EXT_PORT cpu_ext_proc_args --prefill "http://127.0.0.1:$P1_PORT"
  log "pdgate ext-proc ready on :$EXT_PORT"
  CHECK_ARGS+=(--ext-proc "127.0.0.1:$EXT_PORT" --envoy "$ENVOY")
fi

# ---- 7. pdgate check: both pairs move their KV (before check_pd.py kills engines) ------
if [[ "$DIRECT" != 1 ]]; then
  t_check=$SECONDS
  if ! timeout 600 "$PDGATE" check --prefill "http://127.0.0.1:$P1_PORT" --prefill "http://127.0.0.1:$P2_PORT" \
    --decode "http://127.0.0.1:$D_PORT" --kv-connector shfs --timeout 180s --require-evidence \
    >"$WORK/check.txt" 2>"$WORK/check.log"; then
    cat "$WORK/check.txt" "$WORK/check.log" >&2
    log "FAIL pdgate check: a pair did not move its KV"
    exit 1
  fi
  cat "$WORK/check.txt"
  if ! grep -q "^2 pairs: 2 received the KV" "$WORK/check.txt"; then
    log "FAIL pdgate check: expected both pairs to receive the KV"
    exit 1
  fi
  log "PASS pdgate check: both pairs moved their KV ($((SECONDS - t_check))s)"
fi

# ---- 8. checks ----------------------------------------------------------------------
t_checks=$SECONDS
timeout 1200 "$PY" "$HERE/check_pd.py" "${CHECK_ARGS[@]}"
log "checks took $((SECONDS - t_checks))s"
