#!/usr/bin/env bash
# End-to-end check of `pdgate --discovery kubernetes`: a fake Kubernetes API (python3, loopback)
# lists two AIBrix-labelled pdsim engines; pdgate must find them through pdkube, follow a
# readiness flip, route prefill/decode with a real KV handoff, and keep routing after the API
# server goes away.
# Usage: deploy/e2e/kube_discovery.sh   (builds pdgate and pdsim unless PDGATE_BIN_DIR is set)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
here="$root/deploy/e2e"
if [ -z "${PDGATE_BIN_DIR:-}" ]; then
  (cd "$root" && cargo build -q -p pdgate -p pdsim)
  PDGATE_BIN_DIR="${CARGO_TARGET_DIR:-$root/target}/debug"
fi
bin="$PDGATE_BIN_DIR"

work="$(mktemp -d)"
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
api_port=$(free_port); pf_port=$(free_port); dc_port=$(free_port)
pf_side=$(free_port); dc_side=$(free_port); gw_port=$(free_port)

pods() { # $1 = decode readiness (True/False)
  cat >"$work/pods.json.tmp" <<JSON
[
 {"apiVersion":"v1","kind":"Pod","metadata":{"name":"pf-0","namespace":"llm","labels":{
   "role-name":"prefill","model.aibrix.ai/name":"pdsim-demo","model.aibrix.ai/port":"$pf_port",
   "model.aibrix.ai/kv-connector-type":"shfs"}},
  "status":{"phase":"Running","podIP":"127.0.0.1","conditions":[{"type":"Ready","status":"True"}]}},
 {"apiVersion":"v1","kind":"Pod","metadata":{"name":"dc-0","namespace":"llm","labels":{
   "role-name":"decode","model.aibrix.ai/name":"pdsim-demo","model.aibrix.ai/port":"$dc_port",
   "model.aibrix.ai/kv-connector-type":"shfs"}},
  "status":{"phase":"Running","podIP":"127.0.0.1","conditions":[{"type":"Ready","status":"$1"}]}},
 {"apiVersion":"v1","kind":"Pod","metadata":{"name":"other","namespace":"llm","labels":{
   "role-name":"decode","model.aibrix.ai/name":"elsewhere"}},
  "status":{"phase":"Running","podIP":"127.0.0.1","conditions":[{"type":"Ready","status":"True"}]}}
]
JSON
  mv "$work/pods.json.tmp" "$work/pods.json"
}
pods False

cat >"$work/kubeconfig" <<YAML
apiVersion: v1
kind: Config
current-context: fake
clusters: [{name: fake, cluster: {server: "http://127.0.0.1:$api_port"}}]
contexts: [{name: fake, context: {cluster: fake, user: dev, namespace: llm}}]
users: [{name: dev, user: {token: unused}}]
YAML

python3 "$here/fake_kube_api.py" "$api_port" "$work/pods.json" 2>"$work/api.log" &
api_pid=$!; pids+=("$api_pid")
"$bin/pdsim" --role prefill --connector shfs --model pdsim-demo --listen "127.0.0.1:$pf_port" \
  --side-channel-listen "127.0.0.1:$pf_side" --advertise-host 127.0.0.1 >"$work/pf.log" 2>&1 &
pids+=($!)
"$bin/pdsim" --role decode --connector shfs --model pdsim-demo --listen "127.0.0.1:$dc_port" \
  --side-channel-listen "127.0.0.1:$dc_side" --advertise-host 127.0.0.1 >"$work/dc.log" 2>&1 &
pids+=($!)
sleep 0.5
KUBECONFIG="$work/kubeconfig" "$bin/pdgate" --listen "127.0.0.1:$gw_port" --discovery kubernetes \
  --selector model.aibrix.ai/name=pdsim-demo >"$work/gw.log" 2>&1 &
pids+=($!)

passed=0; failed=0
check() { # name, command...
  local name="$1"; shift
  if "$@"; then passed=$((passed + 1)); echo "ok   $name"
  else failed=$((failed + 1)); echo "FAIL $name"; fi
}
complete() {
  curl -s -o /dev/null -w '%{http_code}' --max-time 10 "http://127.0.0.1:$gw_port/v1/completions" \
    -H 'content-type: application/json' -d '{"model":"pdsim-demo","prompt":"hello","max_tokens":8}' || true
}
eventually() { # up to 20 s for "$@" to succeed
  for _ in $(seq 1 100); do "$@" && return 0; sleep 0.2; done; return 1
}
is_up() { curl -s -o /dev/null --max-time 1 "http://127.0.0.1:$gw_port/health"; }
routes() { [ "$(complete)" = 200 ]; }
refuses() { local c; c="$(complete)"; [ -n "$c" ] && [ "$c" != 200 ] && [ "$c" != 000 ]; }
pulled() {
  curl -s --max-time 2 "http://127.0.0.1:$dc_port/sim/stats" |
    python3 -c 'import json,sys; sys.exit(0 if json.load(sys.stdin)["transfers_pulled"] >= 3 else 1)'
}

check "gateway starts" eventually is_up
check "no routable decode yet: request refused" eventually refuses
pods True
check "decode turns Ready: prefill/decode routed" eventually routes
kill "$api_pid"; wait "$api_pid" 2>/dev/null || true
sleep 1
check "API server gone: still routed (1)" routes
check "API server gone: still routed (2)" routes
check "decode pulled KV from the discovered prefill" pulled

if [ "$failed" -ne 0 ]; then
  echo "--- pdgate log"; tail -n 30 "$work/gw.log"
  echo "--- fake API log"; tail -n 10 "$work/api.log"
fi
echo "kube_discovery: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
