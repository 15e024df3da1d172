#!/usr/bin/env bash
# Smoke test of the pdgate container image built from deploy/docker/Dockerfile, with Docker.
# Containers run the way the manifests run them (uid 65532, read-only root filesystem, all
# capabilities dropped, no privilege escalation) with the args taken from the manifests:
#   1. `pdgate --help` runs in the image;
#   2. static routing: prefill + decode pdsim containers on a bridge network behind a gateway
#      container; a completion sent from the host (published port on 127.0.0.1) is answered and
#      the decode pulled KV from the prefill;
#   3. in-cluster Kubernetes discovery: the gateway container with the Deployment's args and a
#      mounted service account (token, ca.crt, namespace) watches an HTTPS fake API server and
#      routes to the engines it lists;
#   4. `docker stop` (SIGTERM) ends the gateway cleanly within the pod's grace period.
# It neither builds nor pulls: it skips (exit 77, "cannot run here") when docker, its daemon or
# the image is missing; `.ci/run` accepts that skip only because its skip registry lists it.
# Needs a Linux Docker host (step 3 uses host networking and reaches the containers' bridge
# addresses; Docker Desktop's VM does not allow either), python3, curl and openssl. ~15 s.
# Usage: deploy/e2e/container_smoke.sh     (PDGATE_IMAGE, default pdgate:0.1.0)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
here="$root/deploy/e2e"
image="${PDGATE_IMAGE:-pdgate:0.1.0}"

skip() { echo "container_smoke: skipped ($1)"; exit 77; }
command -v docker >/dev/null 2>&1 || skip "no docker command"
docker info >/dev/null 2>&1 || skip "no docker daemon"
docker image inspect "$image" >/dev/null 2>&1 || skip "image $image not present; build it first"

run_id="pdgate-smoke-$$"
work="$(mktemp -d)"
containers=()
api_pid=""
cleanup() {
  if [ -n "$api_pid" ]; then kill "$api_pid" 2>/dev/null || true; wait "$api_pid" 2>/dev/null || true; fi
  for c in "${containers[@]}"; do docker rm -f "$c" >/dev/null 2>&1 || true; done
  docker network rm "$run_id" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

# The pod securityContext of deploy/kubernetes/*.yaml, as docker flags.
hardened=(--user 65532:65532 --read-only --cap-drop ALL --security-opt no-new-privileges)

# `- --flag=value` lines of one manifest's container args, with $(POD_IP) substituted.
manifest_args() { # file, pod ip
  sed -n '/^ *args:/,/^ *[a-z]*:$/p' "$1" | sed -n 's/^ *- \(--.*\)$/\1/p' |
    sed "s/\$(POD_IP)/$2/"
}
mapfile -t gw_args < <(manifest_args "$root/deploy/kubernetes/deployment.yaml" unused)
mapfile -t pf_args < <(manifest_args "$root/deploy/kubernetes/engines-demo/prefill.yaml" "$run_id-pf")
mapfile -t dc_args < <(manifest_args "$root/deploy/kubernetes/engines-demo/decode.yaml" "$run_id-dc")

passed=0; failed=0
check() { # name, command...
  local name="$1"; shift
  if "$@"; then passed=$((passed + 1)); echo "ok   $name"
  else failed=$((failed + 1)); echo "FAIL $name"; fi
}
eventually() { # up to 20 s for "$@" to succeed
  for _ in $(seq 1 100); do "$@" && return 0; sleep 0.2; done; return 1
}
host_port() { docker port "$1" "$2/tcp" | sed -n 's/^127\.0\.0\.1:\([0-9]*\)$/\1/p' | head -n 1; }
complete() { # gateway port -> http status
  curl -s -o "$work/completion.json" -w '%{http_code}' --max-time 10 \
    "http://127.0.0.1:$1/v1/completions" -H 'content-type: application/json' \
    -d '{"model":"pdsim-demo","prompt":"hello","max_tokens":8}' 2>/dev/null || true
}
routes() { [ "$(complete "$1")" = 200 ] && grep -q '"choices"' "$work/completion.json"; }
pulled() { # decode host port, at least N transfers
  curl -s --max-time 2 "http://127.0.0.1:$1/sim/stats" |
    python3 -c 'import json,sys; sys.exit(0 if json.load(sys.stdin)["transfers_pulled"] >= int(sys.argv[1]) else 1)' "$2"
}

check "pdgate --help runs in the image" \
  bash -c "docker run --rm ${hardened[*]} '$image' --help | grep -q '^Usage: pdgate'"
check "image runs as 65532:65532" \
  bash -c "[ \"\$(docker image inspect -f '{{.Config.User}}' '$image')\" = 65532:65532 ]"

# 2. Engines and a statically configured gateway on a bridge network.
docker network create "$run_id" >/dev/null
start() { # name, docker args...
  local name="$1"; shift
  docker run -d --name "$name" --network "$run_id" "${hardened[@]}" "$@" >/dev/null
  containers+=("$name")
}
start "$run_id-pf" --entrypoint /usr/local/bin/pdsim "$image" "${pf_args[@]}"
start "$run_id-dc" -p 127.0.0.1::8000 --entrypoint /usr/local/bin/pdsim "$image" "${dc_args[@]}"
start "$run_id-gw" -p 127.0.0.1::8080 "$image" --listen=0.0.0.0:8080 --log-format=json \
  --model=pdsim-demo --prefill="http://$run_id-pf:8000" --decode="http://$run_id-dc:8000"
dc_port="$(host_port "$run_id-dc" 8000)"
gw_port="$(host_port "$run_id-gw" 8080)"
check "static: completion from the host through gateway and engine containers" eventually routes "$gw_port"
check "static: the decode container pulled KV from the prefill container" pulled "$dc_port" 1
pulled_before="$(curl -s --max-time 2 "http://127.0.0.1:$dc_port/sim/stats" |
  python3 -c 'import json,sys; print(json.load(sys.stdin)["transfers_pulled"])' || echo 0)"

# 3. In-cluster discovery: service account files + KUBERNETES_SERVICE_HOST, HTTPS fake API.
sa="$work/serviceaccount"; mkdir -p "$sa"
# A CA (mounted as ca.crt) and a server certificate it signs (webpki refuses a CA as leaf).
openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=fake-kube-ca \
  -keyout "$work/ca.key" -out "$sa/ca.crt" 2>/dev/null
openssl req -newkey rsa:2048 -nodes -subj /CN=fake-kube-api -keyout "$work/api.key" \
  -out "$work/api.csr" 2>/dev/null
printf 'subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n' >"$work/api.ext"
openssl x509 -req -in "$work/api.csr" -CA "$sa/ca.crt" -CAkey "$work/ca.key" -CAcreateserial \
  -days 1 -extfile "$work/api.ext" -out "$work/api.crt" 2>/dev/null
printf 'smoke-token' >"$sa/token"; printf 'llm' >"$sa/namespace"
chmod 0755 "$sa"; chmod 0644 "$sa"/*
api_port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
pod() { # name, role, pod ip
  printf '{"apiVersion":"v1","kind":"Pod","metadata":{"name":"%s","namespace":"llm","labels":{"role-name":"%s","roleset-name":"pdsim-demo","model.aibrix.ai/name":"pdsim-demo","model.aibrix.ai/port":"8000","model.aibrix.ai/engine":"vllm","model.aibrix.ai/kv-connector-type":"shfs"}},"status":{"phase":"Running","podIP":"%s","conditions":[{"type":"Ready","status":"True"}]}}' "$1" "$2" "$3"
}
# Pod IPs are the engine containers' bridge addresses, which the host reaches too; port 8000
# as in the manifests.
container_ip() { docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$1"; }
echo "[$(pod pf-0 prefill "$(container_ip "$run_id-pf")"),$(pod dc-0 decode "$(container_ip "$run_id-dc")")]" >"$work/pods.json"
FAKE_KUBE_API_CERT="$work/api.crt" FAKE_KUBE_API_KEY="$work/api.key" FAKE_KUBE_API_TOKEN=smoke-token \
  python3 "$here/fake_kube_api.py" "$api_port" "$work/pods.json" 2>"$work/api.log" &
api_pid=$!
kgw_port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
# Host network: the fake API listens on the host's loopback.
docker run -d --name "$run_id-kgw" --network host "${hardened[@]}" \
  -v "$sa:/var/run/secrets/kubernetes.io/serviceaccount:ro" \
  -e KUBERNETES_SERVICE_HOST=127.0.0.1 -e KUBERNETES_SERVICE_PORT="$api_port" -e RUST_LOG=info \
  "$image" "${gw_args[@]/--listen=0.0.0.0:8080/--listen=127.0.0.1:$kgw_port}" >/dev/null
containers+=("$run_id-kgw")
check "kubernetes: completion routed to the pods listed by the in-cluster API" eventually routes "$kgw_port"
check "kubernetes: the decode pulled KV again (prefill/decode handoff via pod IPs)" \
  pulled "$dc_port" $((pulled_before + 1))
check "kubernetes: watched its own namespace (llm) with the service-account token" \
  grep -q '/api/v1/namespaces/llm/pods' "$work/api.log"

# 4. SIGTERM: drain (5 s) then exit 0, inside the Deployment's 45 s grace period.
stopped_cleanly() {
  docker stop -t 45 "$run_id-gw" >/dev/null &&
    [ "$(docker inspect -f '{{.State.ExitCode}}' "$run_id-gw")" = 0 ]
}
check "docker stop (SIGTERM): gateway exits 0 within the grace period" stopped_cleanly

if [ "$failed" -ne 0 ]; then
  for c in "${containers[@]}"; do echo "--- $c"; docker logs --tail 20 "$c" 2>&1 || true; done
  echo "--- fake API log"; tail -n 10 "$work/api.log"
fi
echo "container_smoke: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
