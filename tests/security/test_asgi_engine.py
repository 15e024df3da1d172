"""The stand-in engine is itself tested: it records what it receives and routes the way uvicorn and
Starlette route for vLLM (%-decoded paths, 307 on a trailing slash naming the Host it was given).

Run: `python -m pytest -q tests/security` in a venv with tests/security/requirements.txt.
"""

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

ENGINE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "asgi_engine.py")


def start_engine(record_file: str, parser: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(
        [sys.executable, ENGINE, "--port", "0", "--record", record_file, "--http", parser]
        + ["--redirect", "/v1/responses"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    line = proc.stdout.readline().decode().strip()
    if not line.isdigit():
        proc.kill()
        raise RuntimeError(f"engine did not print its port: {line!r} {proc.stderr.read().decode()}")
    port = int(line)
    deadline = time.monotonic() + 20
    while True:
        try:
            status, _, _ = send(port, "GET", "/health")
            if status == 200:
                return proc, port
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"engine not healthy: {proc.stderr.read().decode()}")
        time.sleep(0.05)


def send(port, method, path, body=None, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def recorded(port):
    status, _, body = send(port, "GET", "/_recorded")
    assert status == 200
    return json.loads(body)["requests"]


@pytest.fixture(params=["httptools", "h11"])
def engine(request, tmp_path):
    record_file = tmp_path / "requests.jsonl"
    proc, port = start_engine(str(record_file), request.param)
    try:
        # Forget the health checks of the start-up.
        status, _, _ = send(port, "DELETE", "/_recorded")
        assert status == 204
        record_file.write_text("")
        yield port, record_file
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


def test_percent_escaped_path_reaches_the_real_handler(engine):
    port, _ = engine
    body = json.dumps({"prompt": "x", "kv_transfer_params": {"remote_host": "169.254.169.254"}})
    status, _, answer = send(port, "POST", "/v1/%63ompletions", body)
    assert status == 200, answer
    assert json.loads(answer)["object"] == "text_completion"
    [rec] = recorded(port)
    assert rec["raw_path"] == "/v1/%63ompletions"
    assert rec["path"] == "/v1/completions"
    assert json.loads(rec["body"])["kv_transfer_params"]["remote_host"] == "169.254.169.254"
    assert rec["body_complete"] is True and rec["status"] == 200
    # %2F is decoded too: the router sees a real slash.
    status, _, _ = send(port, "GET", "/v1%2Fmodels")
    assert status == 200
    assert recorded(port)[-1]["path"] == "/v1/models"


def test_trailing_slash_redirect_names_the_host_it_was_sent(engine):
    port, _ = engine
    status, headers, _ = send(port, "POST", "/v1/completions/", "{}")
    assert status == 307
    assert headers["location"] == f"http://127.0.0.1:{port}/v1/completions"
    # A gateway that forwards with the engine's address as Host leaks that address.
    status, headers, _ = send(
        port, "POST", "/v1/chat/completions/", "{}", {"Host": "10.0.0.7:8000"}
    )
    assert status == 307
    assert headers["location"] == "http://10.0.0.7:8000/v1/chat/completions"
    # --redirect: an allowed path whose answer is a redirect to the engine itself.
    status, headers, _ = send(port, "POST", "/v1/responses", "{}", {"Host": "10.0.0.7:8000"})
    assert status == 307
    assert headers["location"] == "http://10.0.0.7:8000/v1/responses/"
    assert [r["status"] for r in recorded(port)] == [307, 307, 307]


def test_records_headers_in_order_and_to_the_file(engine):
    port, record_file = engine
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}]})
    headers = {"Authorization": "Bearer client-key", "X-Data-Parallel-Rank": "3"}
    status, _, _ = send(port, "POST", "/v1/chat/completions?a=1", body, headers)
    assert status == 200
    [rec] = recorded(port)
    names = [k for k, _ in rec["headers"]]
    assert names.index("authorization") < names.index("x-data-parallel-rank")
    assert ["authorization", "Bearer client-key"] in rec["headers"]
    assert rec["query_string"] == "a=1" and rec["method"] == "POST"
    lines = [json.loads(line) for line in record_file.read_text().splitlines()]
    assert [(line["raw_path"], line["query_string"]) for line in lines] == [
        ("/v1/chat/completions", "a=1")
    ]
    # The record endpoint does not record itself.
    assert all(r["path"] != "/_recorded" for r in recorded(port))


def test_a_stalled_body_is_recorded_as_it_arrives(engine):
    port, record_file = engine
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n" + b'{"prompt":'
        )
        deadline = time.monotonic() + 5
        while True:
            recs = recorded(port)
            if recs and recs[0]["body"]:
                break
            assert time.monotonic() < deadline, recs
            time.sleep(0.05)
        assert recs[0]["body"] == '{"prompt":'
        assert recs[0]["body_complete"] is False and recs[0]["status"] is None
    # Closed mid-body: the request ends and reaches the file, still incomplete.
    deadline = time.monotonic() + 5
    while True:
        lines = [json.loads(line) for line in record_file.read_text().splitlines()]
        mine = [line for line in lines if line["path"] == "/v1/completions"]
        if mine:
            break
        assert time.monotonic() < deadline, lines
        time.sleep(0.05)
    assert mine[0]["body_complete"] is False and mine[0]["status"] is None
    assert mine[0]["body"] == '{"prompt":'


def test_generation_json_and_sse(engine):
    port, _ = engine
    body = {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("POST", "/v1/completions", json.dumps(body))
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.getheader("content-type").startswith("text/event-stream")
    events = [e for e in resp.read().decode().split("\n\n") if e]
    conn.close()
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "Hello from asgi"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    # vLLM's 400 for stream_options without stream, in the OpenAI error shape.
    status, _, answer = send(
        port,
        "POST",
        "/v1/completions",
        json.dumps({"prompt": "x", "stream_options": {"include_usage": True}}),
    )
    assert status == 400
    assert json.loads(answer)["error"]["param"] == "stream_options"
    # A prefill leg gets NixlConnector-shaped transfer parameters back.
    leg = {"messages": [], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    status, _, answer = send(
        port, "POST", "/v1/chat/completions", json.dumps(leg), {"X-Request-Id": "r1"}
    )
    params = json.loads(answer)["kv_transfer_params"]
    assert (
        status == 200
        and params["do_remote_prefill"] is True
        and params["remote_request_id"] == "r1"
    )
    status, _, answer = send(port, "POST", "/v1/chat/completions", json.dumps({"messages": []}))
    assert status == 200 and "kv_transfer_params" not in json.loads(answer)


def test_other_routes(engine):
    port, _ = engine
    status, _, answer = send(port, "GET", "/v1/models")
    assert status == 200 and json.loads(answer)["data"][0]["id"] == "asgi-model"
    status, _, answer = send(port, "GET", "/health")
    assert status == 200 and answer == b""
    status, _, answer = send(port, "POST", "/v1/nowhere", "{}")
    assert status == 404 and json.loads(answer) == {"detail": "Not Found"}
    status, _, _ = send(port, "GET", "/v1/completions")
    assert status == 405
    status, _, answer = send(port, "POST", "/v1/completions", "not json")
    assert status == 400 and json.loads(answer)["error"]["code"] == 400
    status, _, answer = send(
        port, "POST", "/v1/completions", json.dumps({"model": "other", "prompt": "x"})
    )
    assert status == 404 and json.loads(answer)["error"]["type"] == "NotFoundError"
    for path, body in [
        ("/tokenize", {"prompt": "a b"}),
        ("/detokenize", {"tokens": [1]}),
        ("/v1/embeddings", {"input": "a"}),
    ]:
        status, _, _ = send(port, "POST", path, json.dumps(body))
        assert status == 200, path
