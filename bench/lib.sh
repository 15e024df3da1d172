# Helpers shared by bench/compare.sh and bench/profile.sh (sourced, not run).

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
