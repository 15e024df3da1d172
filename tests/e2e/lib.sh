# Shared by the real-engine stages (vllm_cpu.sh, vllm_cache.sh); sourced, not run.
#
#   E2E_NAME=vllm_x; source "$HERE/lib.sh"
#
# Gives: the cached vLLM virtualenv ($VENV, $PY, via install_vllm.sh) and tiny model ($MODEL_DIR),
# a work dir ($WORK, kept on failure or with PDGATE_E2E_KEEP_LOGS=1), log(), the process-group
# list PGIDS (every process a stage starts leads its own group; stop_all ends those groups only,
# TERM then KILL after STOP_GRACE seconds), an EXIT trap that stops everything and prints the
# last log lines on failure, and e2e_prepare (install or SKIP, then build the model if needed).

STOP_GRACE="${STOP_GRACE:-15}"
# shellcheck source-path=SCRIPTDIR
source "$HERE/install_vllm.sh"
MODEL_DIR="$E2E_CACHE/tiny-llama"
PY="$VENV/bin/python"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/pdgate-$E2E_NAME.XXXXXX")"
PGIDS=()

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
  if ((rc != 0)); then
    for f in "$WORK"/*.log; do
      [[ -f "$f" ]] || continue
      echo "----- last lines of $(basename "$f") -----"
      tail -n 25 "$f"
    done
  fi
  if [[ "${PDGATE_E2E_KEEP_LOGS:-0}" == 1 || $rc -ne 0 ]]; then
    echo "logs kept in $WORK"
  else
    rm -rf "$WORK"
  fi
  log "done in $((SECONDS - T0))s (exit $rc)"
  exit "$rc"
}
trap on_exit EXIT
trap 'exit 130' INT TERM

# vLLM installed (or SKIP: exits 0 with a summary line naming `summary`), then the tiny model.
e2e_prepare() {
  local summary="$1" rc=0
  bash "$HERE/install_vllm.sh" || rc=$?
  if ((rc == 77)); then
    echo "SKIP: $E2E_NAME e2e: the package registry cannot be reached, so vLLM cannot be installed"
    echo "$summary: 0 passed, 0 failed, 1 skipped"
    exit 0
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
