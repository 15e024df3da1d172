# Helpers shared by the bench scripts (sourced, not run).

# A free TCP port on 127.0.0.1.
free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}

# wait_http URL [SECONDS]: waits (bounded, default 60 s) until URL answers 2xx.
wait_http() {
  local url="$1" secs="${2:-60}" i
  for i in $(seq 1 $((secs * 10))); do
    if curl -fsS -o /dev/null --max-time 1 "$url" 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  echo "$(basename "$0"): timed out waiting for $url" >&2
  return 1
}

# wait_tcp HOST PORT [SECONDS]: until HOST:PORT accepts a connection.
wait_tcp() {
  local host="$1" port="$2" secs="${3:-60}" i
  for i in $(seq 1 $((secs * 10))); do
    if (exec 3<>"/dev/tcp/$host/$port") 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  echo "$(basename "$0"): timed out waiting for $host:$port" >&2
  return 1
}

# ensure_matplotlib VENV LOGDIR: matplotlib in VENV, for the charts (bounded installs). Without
# it (no registry) a run still prints its tables; returns non-zero then.
ensure_matplotlib() {
  local venv="$1" logs="$2"
  [[ -x "$venv/bin/python" ]] && "$venv/bin/python" -c 'import matplotlib' 2>/dev/null && return 0
  echo "$(basename "$0"): installing matplotlib into $venv (charts)" >&2
  (timeout 900 python3 -m venv "$venv" && timeout 900 "$venv/bin/pip" install -q matplotlib) \
    >"$logs/pip-matplotlib.log" 2>&1 && return 0
  echo "$(basename "$0"): matplotlib install failed: no charts (see $logs/pip-matplotlib.log)" >&2
  return 1
}

# ensure_peers VENV LOGDIR: the peer routers (vllm-router $VLLM_ROUTER_VERSION, SMG
# $SMG_VERSION) in VENV (bounded installs); non-zero when they cannot be installed.
ensure_peers() {
  local venv="$1" logs="$2"
  [[ -x "$venv/bin/vllm-router" && -x "$venv/bin/smg" ]] && return 0
  echo "$(basename "$0"): installing vllm-router==$VLLM_ROUTER_VERSION smg==$SMG_VERSION into $venv" >&2
  (timeout 900 python3 -m venv "$venv" &&
    timeout 900 "$venv/bin/pip" install -q "vllm-router==$VLLM_ROUTER_VERSION" "smg==$SMG_VERSION") \
    >"$logs/pip-peers.log" 2>&1 && return 0
  echo "$(basename "$0"): peer install failed (see $logs/pip-peers.log)" >&2
  return 1
}
