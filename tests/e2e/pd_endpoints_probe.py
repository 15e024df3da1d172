"""Probes two-leg PD (NixlConnector) on vLLM's /v1/responses and /v1/messages.

Driven by tests/e2e/vllm_cache.sh with PDGATE_E2E_PD_PROBE=1. For each route (chat completions
as the known-good control, then responses and messages, non-streaming and streaming decode):
1. prefill leg on the kv_producer with ``kv_transfer_params`` = the shfs augment and one output
   token; prints status and the ``kv_transfer_params`` the answer carries (if any);
2. decode leg on the kv_consumer with those params and the same prompt; prints status, the
   output and the decode's NIXL metrics deltas (bytes, external prefix hits, local prefix hits).
Prints a JSON summary line per case (``PROBE {...}``); exits 0 (a report, not a gate), 1 only
when the control fails, because then the pair itself is broken.
"""

import argparse
import json
import sys
import urllib.error
import urllib.request

MODEL = "tiny"
TIMEOUT_S = 120
AUGMENT = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
DECODE_METRICS = (
    "vllm:nixl_bytes_transferred_sum",
    "vllm:external_prefix_cache_hits_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "vllm:nixl_num_failed_transfers_total",
)
PROMPT = "the prefill engine sends its cache block to the decode engine over the host port " * 4


def post(url: str, body: dict) -> tuple[int, bytes]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def metrics(base: str) -> dict:
    with urllib.request.urlopen(base + "/metrics", timeout=TIMEOUT_S) as r:
        text = r.read().decode()
    out = dict.fromkeys(DECODE_METRICS, 0.0)
    for line in text.splitlines():
        for name in DECODE_METRICS:
            if line.startswith(name + "{") or line.startswith(name + " "):
                out[name] += float(line.rsplit(" ", 1)[1])
    return out


def body_for(route: str, max_tokens: int, stream: bool) -> dict:
    # A distinct prompt per case: otherwise the decode's own prefix cache (it caches pulled KV)
    # serves most of the prompt and only the remainder crosses NIXL.
    prompt = f"{route} stream {stream} " + PROMPT
    if route == "/v1/chat/completions":
        return {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if route == "/v1/responses":
        return {"model": MODEL, "input": prompt, "max_output_tokens": max_tokens,
                "temperature": 0, "stream": stream}
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": stream}


def find_params(raw: bytes):
    """kv_transfer_params from a JSON body, or from any SSE event that carries them."""
    try:
        doc = json.loads(raw)
        return doc.get("kv_transfer_params") if isinstance(doc, dict) else None
    except ValueError:
        pass
    for line in raw.decode(errors="replace").splitlines():
        if line.startswith("data:"):
            try:
                ev = json.loads(line[5:])
            except ValueError:
                continue
            if isinstance(ev, dict):
                for holder in (ev, ev.get("response") or {}):
                    if isinstance(holder, dict) and holder.get("kv_transfer_params"):
                        return holder["kv_transfer_params"]
    return None


def short(raw: bytes, n: int = 400) -> str:
    s = raw.decode(errors="replace")
    return s if len(s) <= n else s[:n] + f"...({len(s)} bytes)"


def probe(prefill: str, decode: str, route: str, stream: bool) -> dict:
    case = {"route": route, "decode_stream": stream}
    pb = body_for(route, 1, False)
    pb["kv_transfer_params"] = dict(AUGMENT)
    status, raw = post(prefill + route, pb)
    params = find_params(raw)
    case.update(prefill_status=status, prefill_params=params)
    if status != 200:
        case["prefill_body"] = short(raw)
    if not params:
        case["prefill_body"] = short(raw)
        return case
    before = metrics(decode)
    db = body_for(route, 8, stream)
    db["kv_transfer_params"] = params
    status, raw = post(decode + route, db)
    after = metrics(decode)
    case.update(decode_status=status, decode_body=short(raw, 600),
                decode_delta={k.split(":")[1]: after[k] - before[k] for k in DECODE_METRICS})
    return case


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--decode", required=True)
    args = ap.parse_args()
    control_ok = False
    for route in ("/v1/chat/completions", "/v1/responses", "/v1/messages"):
        for stream in (False, True):
            case = probe(args.prefill, args.decode, route, stream)
            print("PROBE " + json.dumps(case), flush=True)
            if route == "/v1/chat/completions" and not stream:
                d = case.get("decode_delta") or {}
                control_ok = case.get("decode_status") == 200 and d.get("nixl_bytes_transferred_sum", 0) > 0
    print(f"pd_endpoints_probe: control {'ok' if control_ok else 'FAILED'}", flush=True)
    return 0 if control_ok else 1


if __name__ == "__main__":
    sys.exit(main())
