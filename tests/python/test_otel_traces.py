"""pdgate's OpenTelemetry export, received by real OTLP receivers started here: an HTTP/protobuf
one (`opentelemetry-proto` decodes each ExportTraceServiceRequest) and a gRPC one (grpcio with
the same package's TraceService). One PD request through pdsim engines (shfs) must arrive as one
trace that continues the client's `traceparent`: a `request` root with `prefill`, `kv_handoff`,
`decode` and `relay` children and their attributes, and each engine must have received a
`traceparent` whose parent is its own leg's span.

Run by .ci/run: PDGATE_BIN points at the built pdgate; pdsim is the binary beside it.
"""

import http.server
import json
import os
import secrets
import threading
import time
import urllib.request
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from procs import free_port, start, stop, wait_http


class Spans:
    """What a receiver got: (resource attributes, span) pairs, thread-safe."""

    def __init__(self):
        self.lock = threading.Lock()
        self.items = []

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self.lock:
            for rs in request.resource_spans:
                resource = attrs(rs.resource.attributes)
                for ss in rs.scope_spans:
                    self.items.extend((resource, s) for s in ss.spans)

    def of_trace(self, trace_id: bytes):
        with self.lock:
            return [(r, s) for r, s in self.items if s.trace_id == trace_id]

    def wait(self, trace_id: bytes, names: set, limit: float = 20):
        deadline = time.monotonic() + limit
        while True:
            got = self.of_trace(trace_id)
            if names <= {s.name for _, s in got}:
                return got
            if time.monotonic() > deadline:
                raise AssertionError(f"spans {sorted(names)} not received; got {[s.name for _, s in got]}")
            time.sleep(0.1)


def value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def attrs(kvs) -> dict:
    return {kv.key: value(kv.value) for kv in kvs}


@pytest.fixture(scope="module")
def http_receiver():
    spans = Spans()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            if self.path != "/v1/traces":
                self.send_response(404)
                self.end_headers()
                return
            request = trace_service_pb2.ExportTraceServiceRequest()
            request.ParseFromString(body)
            spans.add(request)
            answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", spans
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def grpc_receiver():
    spans = Spans()

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            spans.add(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"http://127.0.0.1:{port}", spans
    finally:
        server.stop(grace=None)


@pytest.fixture(scope="module")
def engines():
    pdsim = os.path.join(os.path.dirname(os.environ.get("PDGATE_BIN", "target/debug/pdgate")), "pdsim")
    procs, urls = [], {}
    try:
        for role in ("prefill", "decode"):
            port = free_port()
            proc = start([pdsim, "--role", role, "--connector", "shfs", "--listen", f"127.0.0.1:{port}",
                          "--side-channel-listen", f"127.0.0.1:{free_port()}", "--model", "m",
                          "--zero-delay", "--slots", "0"])
            procs.append(proc)
            urls[role] = f"http://127.0.0.1:{port}"
            wait_http(proc, f"{urls[role]}/health")
        yield urls
    finally:
        for proc in procs:
            stop(proc)


def gateway(engines, *extra):
    binary = os.environ.get("PDGATE_BIN", "target/debug/pdgate")
    port = free_port()
    proc = start([binary, "--prefill", engines["prefill"], "--decode", engines["decode"],
                  "--kv-connector", "shfs", "--listen", f"127.0.0.1:{port}", *extra])
    base = f"http://127.0.0.1:{port}"
    wait_http(proc, f"{base}/ready")
    return proc, base


def complete(base: str, request_id: str, traceparent: str):
    body = json.dumps({"model": "m", "prompt": "Tell me a story", "max_tokens": 4}).encode()
    req = urllib.request.Request(f"{base}/v1/completions", data=body, method="POST", headers={
        "content-type": "application/json", "x-request-id": request_id,
        "traceparent": traceparent, "tracestate": "vendor=abc"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200
        r.read()
        return dict(r.headers)


def received_traceparent(engine_url: str, request_id: str) -> str:
    with urllib.request.urlopen(f"{engine_url}/sim/stats", timeout=5) as r:
        stats = json.load(r)
    seen = [x["traceparent"] for x in stats["recent_requests"] if x["request_id"] == request_id]
    assert seen, f"{engine_url} got no request {request_id}"
    return seen[-1]


def client_context():
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, parent_id, f"00-{trace_id}-{parent_id}-01"


def tree(spans) -> str:
    """The spans as an indented tree, children by start time, with their attributes."""
    by_parent = {}
    ids = {s.span_id for s in spans}
    for s in sorted(spans, key=lambda s: s.start_time_unix_nano):
        by_parent.setdefault(s.parent_span_id if s.parent_span_id in ids else b"", []).append(s)
    lines = []

    def walk(parent: bytes, depth: int):
        for s in by_parent.get(parent, []):
            ms = (s.end_time_unix_nano - s.start_time_unix_nano) / 1e6
            a = ", ".join(f"{k}={v}" for k, v in sorted(attrs(s.attributes).items()))
            lines.append(f"{'  ' * depth}{s.name} [{ms:.2f} ms] span={s.span_id.hex()} {a}")
            walk(s.span_id, depth + 1)

    walk(b"", 0)
    return "\n".join(lines)


def test_one_pd_request_is_one_trace_over_http(engines, http_receiver):
    endpoint, spans = http_receiver
    proc, base = gateway(engines, "--otlp-endpoint", endpoint)
    try:
        trace_id, parent_id, traceparent = client_context()
        headers = complete(base, "otel-http-1", traceparent)
        got = spans.wait(bytes.fromhex(trace_id), {"request", "prefill", "kv_handoff", "decode", "relay"})
        with urllib.request.urlopen(f"{base}/metrics", timeout=5) as r:
            metrics = r.read().decode()
    finally:
        stop(proc)
    only = [s for _, s in got]
    print(f"\ncaptured span tree (trace {trace_id}, client parent {parent_id}):\n{tree(only)}")
    assert all(r.get("service.name") == "pdgate" for r, _ in got)
    roots = [s for s in only if s.name == "request"]
    assert len(roots) == 1
    root = roots[0]
    assert root.parent_span_id == bytes.fromhex(parent_id), "the client's traceparent is continued"
    assert root.trace_state == "vendor=abc"
    a = attrs(root.attributes)
    assert a["request_id"] == "otel-http-1"
    assert a["connector"] == "shfs" and a["model"] == "m"
    assert a["routing"] == "pd" and a["outcome"] == "success"
    assert a["http.response.status_code"] == 200 and a["retries"] == 0 and a["fallback"] is False
    assert a["prefill_policy"] == "round_robin" and a["decode_policy"] == "least_request"
    # The engines the request really went to: each is named by its address (no `name` given), and
    # pdgate sends no target headers by default (`--expose-target-headers` is off).
    assert "target-pod" not in {k.lower() for k in headers}, headers
    assert a["prefill"] == engines["prefill"].removeprefix("http://"), a
    assert a["decode"] == engines["decode"].removeprefix("http://"), a
    assert isinstance(a.get("cached_tokens", 0), int)
    assert len(root.attributes) == len(a), "every attribute once"
    assert root.status.code == root.status.STATUS_CODE_OK
    assert root.kind == root.SPAN_KIND_SERVER
    children = {s.name: s for s in only if s.parent_span_id == root.span_id}
    assert set(children) == {"prefill", "kv_handoff", "decode", "relay"}, tree(only)
    for s in children.values():
        assert attrs(s.attributes)["request_id"] == "otel-http-1"
    assert children["prefill"].kind == children["decode"].kind == root.SPAN_KIND_CLIENT
    assert attrs(children["prefill"].attributes)["endpoint"] == a["prefill"]
    assert attrs(children["decode"].attributes)["endpoint"] == a["decode"]
    # Each engine got its own leg's span as the parent, in the client's trace.
    for role, leg in (("prefill", "prefill"), ("decode", "decode")):
        version, tid, pid, flags = received_traceparent(engines[role], "otel-http-1").split("-")
        assert (version, tid, flags) == ("00", trace_id, "01")
        assert pid == children[leg].span_id.hex(), f"{role} engine's parent is the {leg} span"
    assert 'pdgate_otel_spans_dropped_total{reason="queue_full"} 0' in metrics


def test_grpc_export(engines, grpc_receiver):
    endpoint, spans = grpc_receiver
    proc, base = gateway(engines, "--otlp-endpoint", endpoint, "--otlp-protocol", "grpc",
                         "--otlp-service-name", "gate-a")
    try:
        trace_id, _, traceparent = client_context()
        complete(base, "otel-grpc-1", traceparent)
        got = spans.wait(bytes.fromhex(trace_id), {"request", "prefill", "decode", "relay"})
    finally:
        stop(proc)
    assert {r.get("service.name") for r, _ in got} == {"gate-a"}
    root = next(s for _, s in got if s.name == "request")
    assert attrs(root.attributes)["request_id"] == "otel-grpc-1"


def test_sample_ratio_zero_exports_nothing_new_but_continues_sampled_parents(engines, http_receiver):
    endpoint, spans = http_receiver
    proc, base = gateway(engines, "--otlp-endpoint", endpoint, "--otlp-sample-ratio", "0")
    try:
        new_trace = secrets.token_hex(16)
        # Not sampled by the client (flags 00) and a ratio of 0: nothing goes out, but the engines
        # still get the trace id (with the not-sampled flag).
        complete(base, "otel-unsampled", f"00-{new_trace}-{secrets.token_hex(8)}-00")
        trace_id, _, traceparent = client_context()
        complete(base, "otel-parent-sampled", traceparent)
        spans.wait(bytes.fromhex(trace_id), {"request", "prefill", "decode", "relay"})
        time.sleep(1)  # the batch that would hold the unsampled spans has gone out by now
    finally:
        stop(proc)
    assert spans.of_trace(bytes.fromhex(new_trace)) == []
    _, tid, _, flags = received_traceparent(engines["decode"], "otel-unsampled").split("-")
    assert (tid, flags) == (new_trace, "00")


def test_without_export_the_client_traceparent_is_forwarded_unchanged(engines):
    proc, base = gateway(engines)
    try:
        _, _, traceparent = client_context()
        complete(base, "otel-off-1", traceparent)
    finally:
        stop(proc)
    for role in ("prefill", "decode"):
        assert received_traceparent(engines[role], "otel-off-1") == traceparent
