"""Checks pdgate against real vLLM engines (driven by tests/e2e/vllm_cpu.sh).

Standard library only. Every HTTP call has a timeout; every check prints one
``PASS``/``FAIL`` line and the run ends with ``vllm_cpu: N passed, M failed``.

Two modes:
- ``--gateway URL``: requests go through pdgate; its headers are checked too.
- ``--direct``: this script plays the gateway itself (prefill leg per
  contracts.md sections 2-3, then decode with the returned kv_transfer_params).
  Used to prove the engines and the handoff without pdgate.

With ``--ext-proc ADDR --envoy BIN`` it also sends the single-pair cases through
``pdgate ext-proc`` at ADDR, Envoy's part played by BIN (pdgate's
``envoy_ext_proc`` example: no Envoy can be installed here), with the same
output and KV checks.
"""

import argparse
import subprocess
import http.client
import json
import os
import signal
import sys
import time
import urllib.parse
import uuid

MODEL = "tiny"
GEN_TOKENS = 12
REQUEST_TIMEOUT_S = 120.0
# A request that should fail fast (dead engine) must still answer within this.
FAILURE_TIMEOUT_S = 90.0

SHFS_AUGMENT = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

DECODE_METRICS = (
    "vllm:nixl_bytes_transferred_sum",
    "vllm:nixl_xfer_time_seconds_count",
    "vllm:nixl_num_failed_transfers_total",
    "vllm:external_prefix_cache_hits_total",
    "vllm:external_prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
)


class Result:
    """Counts checks and prints one line per check."""

    def __init__(self) -> None:
        self.passed = 0
        self.failed = 0

    def check(self, ok: bool, name: str, detail: str = "") -> bool:
        if ok:
            self.passed += 1
            print(f"PASS {name}", flush=True)
        else:
            self.failed += 1
            print(f"FAIL {name}: {detail}", flush=True)
        return ok


class Reply:
    """One HTTP answer: status, lower-cased headers, raw body, elapsed seconds."""

    def __init__(self, status: int, headers: dict, body: bytes, elapsed: float) -> None:
        self.status = status
        self.headers = headers
        self.body = body
        self.elapsed = elapsed

    def json(self):
        return json.loads(self.body)


def request(method: str, url: str, body=None, headers=None, timeout=REQUEST_TIMEOUT_S) -> Reply:
    """One HTTP/1.1 request; the whole body is read (SSE streams until the server ends them)."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    hdrs = {"Content-Type": "application/json"} if data is not None else {}
    hdrs.update(headers or {})
    start = time.monotonic()
    try:
        conn.request(method, u.path + (f"?{u.query}" if u.query else ""), body=data, headers=hdrs)
        resp = conn.getresponse()
        chunks = []
        # Read incrementally so a stalled stream trips the overall deadline.
        while True:
            if time.monotonic() - start > timeout:
                raise TimeoutError(f"{url}: body not finished after {timeout}s")
            chunk = resp.read1(65536)
            if not chunk:
                break
            chunks.append(chunk)
        return Reply(
            resp.status,
            {k.lower(): v for k, v in resp.getheaders()},
            b"".join(chunks),
            time.monotonic() - start,
        )
    finally:
        conn.close()


def metrics(base: str) -> dict:
    """Sums the selected vLLM counters over their label sets."""
    text = request("GET", base + "/metrics", timeout=30).body.decode()
    out = {name: 0.0 for name in DECODE_METRICS}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        key, value = line.rsplit(" ", 1)
        name = key.split("{", 1)[0]
        if name in out:
            out[name] += float(value)
    return out


def sse_events(raw: bytes) -> tuple[list[str], str]:
    """Splits an SSE body into data payloads; returns (payloads, framing problem or '')."""
    text = raw.decode()
    if not text.endswith("\n\n"):
        return [], "stream does not end with a blank line"
    payloads = []
    for event in text[:-2].split("\n\n"):
        if not event.startswith("data: ") or "\n" in event:
            return [], f"unexpected SSE event {event[:80]!r}"
        payloads.append(event[len("data: ") :])
    if not payloads or payloads[-1] != "[DONE]":
        return payloads, "last event is not data: [DONE]"
    return payloads, ""


def output_text(kind: str, stream: bool, reply: Reply) -> tuple[str, dict, str]:
    """(generated text, usage, problem) from a completion or chat answer."""
    if not stream:
        doc = reply.json()
        choice = doc["choices"][0]
        text = choice["text"] if kind == "completions" else choice["message"]["content"]
        return text, doc.get("usage") or {}, ""
    payloads, problem = sse_events(reply.body)
    if problem:
        return "", {}, problem
    parts, usage = [], {}
    for p in payloads[:-1]:
        doc = json.loads(p)
        if "error" in doc:
            return "", {}, f"stream error event: {p[:200]}"
        if doc.get("usage"):
            usage = doc["usage"]
        for choice in doc.get("choices", []):
            if kind == "completions":
                parts.append(choice.get("text") or "")
            else:
                parts.append((choice.get("delta") or {}).get("content") or "")
    return "".join(parts), usage, ""


def make_body(kind: str, stream: bool, tag: str) -> dict:
    """A greedy request whose prompt is unique per tag (no local prefix-cache reuse)."""
    words = " ".join(["the prefill engine sends kv blocks to the decode engine"] * 3)
    content = f"{tag} {words} request {tag}"
    body = {"model": MODEL, "max_tokens": GEN_TOKENS, "temperature": 0, "ignore_eos": True}
    if kind == "completions":
        body["prompt"] = content
    else:
        body["messages"] = [{"role": "user", "content": content}]
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


class DirectGateway:
    """Plays the gateway: prefill leg (shfs augment), then decode with its kv_transfer_params."""

    def __init__(self, prefills: list[str], decode: str) -> None:
        self.prefills = prefills
        self.decode = decode
        self.turn = 0
        self.last_prefill = ""

    def send(self, kind: str, body: dict, timeout=REQUEST_TIMEOUT_S) -> Reply:
        prefill = self.prefills[self.turn % len(self.prefills)]
        self.turn += 1
        self.last_prefill = prefill
        rid = f"pdgate-e2e-{uuid.uuid4().hex}"
        leg = dict(body)
        leg.update(max_tokens=1, stream=False, kv_transfer_params=SHFS_AUGMENT)
        leg.pop("stream_options", None)
        if kind == "chat/completions":
            leg["max_completion_tokens"] = 1
        pre = request("POST", f"{prefill}/v1/{kind}", leg, {"X-Request-Id": rid}, timeout)
        if pre.status != 200:
            return pre
        params = pre.json().get("kv_transfer_params")
        dec = dict(body)
        dec["kv_transfer_params"] = params
        return request("POST", f"{self.decode}/v1/{kind}", dec, {"X-Request-Id": rid}, timeout)


class PdGateway:
    """Sends the client request to pdgate."""

    def __init__(self, url: str) -> None:
        self.url = url

    def send(self, kind: str, body: dict, timeout=REQUEST_TIMEOUT_S) -> Reply:
        return request("POST", f"{self.url}/v1/{kind}", body, timeout=timeout)


class EnvoyGateway:
    """Sends the client request through ``pdgate ext-proc``, Envoy played by the example binary."""

    def __init__(self, addr: str, envoy: str) -> None:
        self.addr = addr
        self.envoy = envoy

    def send(self, kind: str, body: dict, timeout=REQUEST_TIMEOUT_S) -> Reply:
        start = time.monotonic()
        run = subprocess.run(
            [self.envoy, self.addr, f"/v1/{kind}", json.dumps(body)],
            capture_output=True,
            timeout=timeout + 60,
            check=False,
        )
        if run.returncode != 0:
            raise RuntimeError(f"envoy_ext_proc exited {run.returncode}: {run.stderr.decode()[-500:]}")
        out = json.loads(run.stdout)
        reply = Reply(out["status"], out["headers"], out["body"].encode(), time.monotonic() - start)
        reply.destination = out.get("destination")
        return reply


CASES = [(k, s) for k in ("completions", "chat/completions") for s in (False, True)]


def check_pd_case(
    res: Result, gw, args, kind: str, stream: bool, tag: str, label: str, extra: dict | None = None
) -> Reply | None:
    """One request through the PD path, compared to the baseline engine, with KV proof.

    ``extra`` is merged into the client body only (not into the baseline request).
    """
    name = f"{label} {kind} stream={stream}"
    body = make_body(kind, stream, tag)
    base = request("POST", f"{args.baseline}/v1/{kind}", body)
    body.update(extra or {})
    if not res.check(base.status == 200, f"{name}: baseline engine answers", base.body[:300].decode()):
        return None
    want, base_usage, problem = output_text(kind, stream, base)
    if stream:
        res.check(not problem, f"{name}: baseline SSE framing", problem)
    before = metrics(args.decode)
    reply = gw.send(kind, body)
    after = metrics(args.decode)
    if not res.check(reply.status == 200, f"{name}: status 200", f"{reply.status} {reply.body[:300]!r}"):
        return reply
    got, usage, problem = output_text(kind, stream, reply)
    res.check(not problem, f"{name}: response parses (SSE framing)", problem)
    res.check(got == want and got != "", f"{name}: output equals single-engine baseline", f"{got!r} != {want!r}")
    if stream:
        ctype = reply.headers.get("content-type", "")
        res.check(ctype.startswith("text/event-stream"), f"{name}: text/event-stream", ctype)
    prompt_tokens = base_usage.get("prompt_tokens", 0)
    res.check(
        usage.get("prompt_tokens") == prompt_tokens and prompt_tokens > 0,
        f"{name}: usage.prompt_tokens matches baseline",
        f"{usage} vs {base_usage}",
    )
    moved = after["vllm:nixl_bytes_transferred_sum"] - before["vllm:nixl_bytes_transferred_sum"]
    ext = after["vllm:external_prefix_cache_hits_total"] - before["vllm:external_prefix_cache_hits_total"]
    local = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    failed = after["vllm:nixl_num_failed_transfers_total"] - before["vllm:nixl_num_failed_transfers_total"]
    res.check(moved > 0, f"{name}: decode pulled KV over NIXL ({moved:.0f} bytes)", f"delta {moved}")
    res.check(
        ext == prompt_tokens,
        f"{name}: decode external prefix hits == prompt tokens ({ext:.0f})",
        f"external hits delta {ext}, prompt tokens {prompt_tokens}",
    )
    res.check(local == 0 and failed == 0, f"{name}: no local prefix hits, no failed transfers", f"{local=} {failed=}")
    if isinstance(gw, PdGateway):
        h = reply.headers
        if label == "1P1D":
            shown = {k: v for k, v in h.items() if k != "date"}
            print(f"INFO {name}: response headers {shown}", flush=True)
        res.check(bool(h.get("x-request-id")), f"{name}: x-request-id header", str(h))
        res.check(bool(h.get("prefill-target-pod")), f"{name}: prefill-target-pod header", str(h))
        res.check(bool(h.get("target-pod")), f"{name}: target-pod header", str(h))
        res.check(h.get("x-pdgate-connector") == "shfs", f"{name}: x-pdgate-connector: shfs", str(h))
    return reply


def api_body(route: str, stream: bool, tag: str) -> dict:
    """A greedy /v1/responses or /v1/messages request with a prompt unique per tag."""
    words = " ".join(["the prefill engine sends kv blocks to the decode engine"] * 3)
    content = f"{tag} {words} request {tag}"
    if route == "responses":
        return {"model": MODEL, "input": content, "max_output_tokens": 8, "temperature": 0, "stream": stream}
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8,
            "temperature": 0, "stream": stream}


def api_text(stream: bool, reply: Reply) -> tuple[str, str]:
    """(generated text, problem) of a /v1/responses or /v1/messages answer, JSON or SSE."""
    if not stream:
        doc = reply.json()
        if doc.get("object") == "response":
            return "".join(c.get("text", "") for o in doc["output"] for c in o.get("content", [])), ""
        return "".join(c.get("text", "") for c in doc["content"]), ""
    parts, ended = [], False
    for event in reply.body.decode().split("\n\n"):
        data = [ln[len("data: "):] for ln in event.split("\n") if ln.startswith("data: ")]
        if not data or data[0] == "[DONE]":
            continue
        doc = json.loads(data[0])
        kind = doc.get("type", "")
        if kind == "error" or ("error" in doc and not kind):
            return "", f"stream error event: {data[0][:200]}"
        if kind == "response.output_text.delta":
            parts.append(doc["delta"])
        elif kind == "content_block_delta":
            parts.append(doc["delta"].get("text", ""))
        ended = ended or kind in ("response.completed", "message_stop")
    return "".join(parts), "" if ended else "stream ended without response.completed / message_stop"


def phase_api_routes(res: Result, gw, args) -> None:
    """/v1/responses and /v1/messages through PD (the prefill engine computes the prompt, the
    decode pulls it over NIXL), answers equal to the baseline's; /tokenize and /detokenize pass."""
    for route in ("responses", "messages"):
        for stream in (False, True):
            name = f"1P1D {route} stream={stream}"
            body = api_body(route, stream, f"{route}-{stream}-{uuid.uuid4().hex[:8]}")
            base = request("POST", f"{args.baseline}/v1/{route}", body)
            if not res.check(base.status == 200, f"{name}: baseline engine answers", base.body[:300].decode()):
                continue
            want, _ = api_text(stream, base)
            pre_before = metrics(args.prefill[0])["vllm:prompt_tokens_total"]
            before = metrics(args.decode)
            reply = gw.send(route, body)
            after = metrics(args.decode)
            pre_used = metrics(args.prefill[0])["vllm:prompt_tokens_total"] - pre_before
            if not res.check(reply.status == 200, f"{name}: status 200", f"{reply.status} {reply.body[:300]!r}"):
                continue
            got, problem = api_text(stream, reply)
            res.check(not problem, f"{name}: answer parses", problem)
            res.check(got == want and got != "", f"{name}: output equals single-engine baseline", f"{got!r} != {want!r}")
            moved = after["vllm:nixl_bytes_transferred_sum"] - before["vllm:nixl_bytes_transferred_sum"]
            res.check(pre_used > 0, f"{name}: the prefill engine computed the prompt ({pre_used:.0f} tokens)", "")
            res.check(moved > 0, f"{name}: decode pulled KV over NIXL ({moved:.0f} bytes)", f"delta {moved}")
            h = reply.headers
            res.check(bool(h.get("prefill-target-pod")) and "x-pdgate-decode-only" not in h,
                      f"{name}: served by a prefill/decode pair", str(h))
    text = "the prefill engine sends kv blocks"
    want = request("POST", f"{args.baseline}/tokenize", {"model": MODEL, "prompt": text})
    got = request("POST", f"{gw.url}/tokenize", {"model": MODEL, "prompt": text})
    res.check(got.status == 200 and want.status == 200 and got.json()["tokens"] == want.json()["tokens"],
              "/tokenize passes through", f"{got.status} {got.body[:200]!r}")
    tokens = want.json().get("tokens", []) if want.status == 200 else []
    back = request("POST", f"{gw.url}/detokenize", {"model": MODEL, "tokens": tokens})
    res.check(back.status == 200 and text in back.json().get("prompt", ""), "/detokenize passes through",
              f"{back.status} {back.body[:200]!r}")


# vLLM 0.32's decode engine dies (EngineCore AssertionError in the NIXL scheduler,
# API server exits) when kv_transfer_params asks for a remote prefill but lacks
# the remote fields. The gateway must never forward client-supplied params.
HOSTILE_PARAMS = {"kv_transfer_params": {"do_remote_prefill": True}}


def phase_single(res: Result, gw, args) -> None:
    for i, (kind, stream) in enumerate(CASES):
        check_pd_case(res, gw, args, kind, stream, f"single{i}-{uuid.uuid4().hex[:8]}", "1P1D")
    if isinstance(gw, PdGateway):
        tag = f"hostile-{uuid.uuid4().hex[:8]}"
        check_pd_case(res, gw, args, "completions", False, tag, "client kv_transfer_params replaced:", HOSTILE_PARAMS)
        alive = request("GET", f"{args.decode}/health", timeout=30)
        res.check(
            alive.status == 200,
            "decode engine still healthy after client-supplied kv_transfer_params",
            str(alive.status),
        )


def phase_ext_proc(res: Result, args) -> None:
    """The single-pair cases through ext_proc: the decode named is the one engine it has."""
    gw = EnvoyGateway(args.ext_proc, args.envoy)
    want = urllib.parse.urlsplit(args.decode).netloc
    for i, (kind, stream) in enumerate(CASES):
        reply = check_pd_case(res, gw, args, kind, stream, f"extproc{i}-{uuid.uuid4().hex[:8]}", "ext_proc 1P1D")
        if reply is not None and reply.status == 200:
            res.check(reply.destination == want, f"ext_proc {kind} stream={stream}: routed to the decode", str(reply.destination))


def phase_two_prefills(res: Result, gw, args) -> None:
    before = [metrics(p)["vllm:prompt_tokens_total"] for p in args.prefill]
    seen = set()
    for i in range(6):
        kind, stream = CASES[i % len(CASES)]
        reply = check_pd_case(res, gw, args, kind, stream, f"two{i}-{uuid.uuid4().hex[:8]}", "2P1D")
        if reply is not None and isinstance(gw, PdGateway):
            seen.add(reply.headers.get("prefill-target-pod"))
        elif isinstance(gw, DirectGateway):
            seen.add(gw.last_prefill)
    after = [metrics(p)["vllm:prompt_tokens_total"] for p in args.prefill]
    used = [a - b for a, b in zip(after, before, strict=True)]
    res.check(all(u > 0 for u in used), f"2P1D: both prefill engines served prompts {used}", f"{used}")
    res.check(len(seen - {None}) == 2, f"2P1D: two distinct prefill targets {sorted(map(str, seen))}", str(seen))


def kill_group(pgid: int, what: str) -> None:
    print(f"INFO killing {what} (process group {pgid})", flush=True)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return
    # Wait (bounded) until the whole group is gone, so "dead" means dead.
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    print(f"INFO process group {pgid} still present 15 s after SIGKILL", flush=True)


def is_clear_error(reply: Reply) -> bool:
    """A 5xx whose body is an OpenAI-shaped JSON error."""
    if not 500 <= reply.status <= 599:
        return False
    try:
        doc = reply.json()
    except ValueError:
        return False
    if not isinstance(doc, dict):
        return False
    err = doc.get("error")
    return (isinstance(err, dict) and bool(err.get("message"))) or doc.get("object") == "error"


def phase_kill_prefill(res: Result, gw, args) -> None:
    """One of two prefills dies: each request falls back (correct output) or fails cleanly."""
    kill_group(args.prefill_pgid[1], "second prefill engine")
    for i in range(4):
        kind, stream = CASES[i % len(CASES)]
        body = make_body(kind, stream, f"pkill{i}-{uuid.uuid4().hex[:8]}")
        want, _, _ = output_text(kind, stream, request("POST", f"{args.baseline}/v1/{kind}", body))
        try:
            reply = gw.send(kind, body, timeout=FAILURE_TIMEOUT_S)
        except (OSError, TimeoutError) as e:
            res.check(False, f"prefill killed #{i}: answered within {FAILURE_TIMEOUT_S}s", repr(e))
            continue
        h = reply.headers
        print(
            f"INFO prefill-killed #{i}: {reply.status} x-pdgate-fallback={h.get('x-pdgate-fallback')}"
            f" prefill-target-pod={h.get('prefill-target-pod')} ({reply.elapsed:.2f}s)",
            flush=True,
        )
        if reply.status == 200:
            got, _, problem = output_text(kind, stream, reply)
            res.check(
                not problem and got == want,
                f"prefill killed #{i}: fallback 200 with baseline output ({reply.elapsed:.1f}s)",
                f"{problem} {got!r} != {want!r}",
            )
        else:
            res.check(
                is_clear_error(reply),
                f"prefill killed #{i}: clear error {reply.status} ({reply.elapsed:.1f}s)",
                reply.body[:300].decode(errors="replace"),
            )
            print(f"INFO prefill-killed error body: {reply.body[:300]!r}", flush=True)


def phase_kill_decode(res: Result, gw, args) -> None:
    kill_group(args.decode_pgid, "decode engine")
    for kind, stream in CASES:
        body = make_body(kind, stream, f"dkill-{uuid.uuid4().hex[:8]}")
        try:
            reply = gw.send(kind, body, timeout=FAILURE_TIMEOUT_S)
        except ConnectionError as e:
            # Only the direct mode talks to the dead engine itself.
            res.check(isinstance(gw, DirectGateway), f"decode killed {kind} stream={stream}: refused", repr(e))
            continue
        except (OSError, TimeoutError) as e:
            res.check(False, f"decode killed {kind} stream={stream}: answered within timeout", repr(e))
            continue
        res.check(
            is_clear_error(reply),
            f"decode killed {kind} stream={stream}: clear {reply.status} ({reply.elapsed:.1f}s)",
            f"{reply.status} {reply.body[:300]!r}",
        )
        print(f"INFO decode-killed answer: {reply.status} {reply.body[:300]!r}", flush=True)


def phase_all_prefills_dead(res: Result, gw, args) -> None:
    """Every prefill dead, decode alive: decode-only fallback (baseline output) or a clear 5xx."""
    kill_group(args.prefill_pgid[0], "first prefill engine")
    for kind, stream in CASES:
        name = f"no prefill alive {kind} stream={stream}"
        body = make_body(kind, stream, f"allp-{uuid.uuid4().hex[:8]}")
        want, _, _ = output_text(kind, stream, request("POST", f"{args.baseline}/v1/{kind}", body))
        try:
            reply = gw.send(kind, body, timeout=FAILURE_TIMEOUT_S)
        except (OSError, TimeoutError) as e:
            res.check(isinstance(gw, DirectGateway), f"{name}: answered within timeout", repr(e))
            continue
        print(
            f"INFO {name}: {reply.status} x-pdgate-fallback={reply.headers.get('x-pdgate-fallback')}"
            f" ({reply.elapsed:.2f}s) {reply.body[:200]!r}",
            flush=True,
        )
        if reply.status == 200:
            got, _, problem = output_text(kind, stream, reply)
            res.check(
                not problem and got == want,
                f"{name}: fallback 200 with baseline output",
                f"{problem} {got!r} != {want!r}",
            )
        else:
            res.check(is_clear_error(reply), f"{name}: clear {reply.status}", f"{reply.body[:300]!r}")


def phase_stale_params(res: Result, args) -> None:
    """Direct mode only: decode given params of a prefill that has since died."""
    kind, body = "completions", make_body("completions", False, f"stale-{uuid.uuid4().hex[:8]}")
    leg = dict(body, max_tokens=1, kv_transfer_params=SHFS_AUGMENT)
    pre = request("POST", f"{args.prefill[1]}/v1/{kind}", leg)
    params = pre.json().get("kv_transfer_params")
    print(f"INFO prefill kv_transfer_params: {json.dumps(params)}", flush=True)
    kill_group(args.prefill_pgid[1], "second prefill engine")
    reply = request(
        "POST", f"{args.decode}/v1/{kind}", dict(body, kv_transfer_params=params), timeout=FAILURE_TIMEOUT_S
    )
    res.check(
        reply.status >= 500,
        f"decode with dead prefill's params: {reply.status} ({reply.elapsed:.1f}s)",
        f"{reply.body[:300]!r}",
    )
    print(f"INFO decode-with-dead-prefill answer: {reply.status} {reply.body[:400]!r}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--baseline", required=True, help="plain engine URL (single-engine reference)")
    ap.add_argument("--prefill", action="append", required=True, help="prefill engine URL (twice)")
    ap.add_argument("--prefill-pgid", action="append", type=int, required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--decode-pgid", type=int, required=True)
    ap.add_argument("--gateway-one", help="pdgate URL with the first prefill only")
    ap.add_argument("--gateway-two", help="pdgate URL with both prefills")
    ap.add_argument("--direct", action="store_true", help="play the gateway here (no pdgate)")
    ap.add_argument("--ext-proc", help="pdgate ext-proc address (host:port) with the first prefill only")
    ap.add_argument("--envoy", help="the envoy_ext_proc example binary (plays Envoy for --ext-proc)")
    args = ap.parse_args()
    if len(args.prefill) != 2 or len(args.prefill_pgid) != 2:
        ap.error("give --prefill and --prefill-pgid twice")
    if bool(args.ext_proc) != bool(args.envoy):
        ap.error("give --ext-proc and --envoy together")
    res = Result()
    if args.direct:
        one, two = DirectGateway(args.prefill[:1], args.decode), DirectGateway(args.prefill, args.decode)
    elif args.gateway_one and args.gateway_two:
        one, two = PdGateway(args.gateway_one), PdGateway(args.gateway_two)
    else:
        ap.error("give --direct or both --gateway-one and --gateway-two")
    try:
        phase_single(res, one, args)
        if not args.direct:
            phase_api_routes(res, one, args)
        if args.ext_proc:
            phase_ext_proc(res, args)
        phase_two_prefills(res, two, args)
        if args.direct:
            phase_stale_params(res, args)
        else:
            phase_kill_prefill(res, two, args)
        phase_all_prefills_dead(res, two, args)
        phase_kill_decode(res, two, args)
    except Exception as e:  # noqa: BLE001 - report any crash as a failed check
        res.check(False, "checker finished", f"{type(e).__name__}: {e}")
    print(f"vllm_cpu: {res.passed} passed, {res.failed} failed", flush=True)
    return 0 if res.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
