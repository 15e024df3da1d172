"""The real `openai` Python client against `pdgate demo` (simulated engines, several connectors).

Run by .ci/run: PDGATE_BIN points at the built binary. The gateway runs in its own process group
on a free loopback port and is always stopped.
"""

import os
import urllib.request

import openai
import pytest

from procs import free_port, start, stop, wait_http

MODEL = "demo"


@pytest.fixture(scope="module")
def gateway():
    binary = os.environ.get("PDGATE_BIN", "target/debug/pdgate")
    port = free_port()
    proc = start([binary, "demo", "--listen", f"127.0.0.1:{port}"])
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(proc, f"{base}/ready")
        yield base
    finally:
        stop(proc)


@pytest.fixture()
def client(gateway):
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key="none", max_retries=0, timeout=30)


def test_models(client):
    assert MODEL in [m.id for m in client.models.list().data]


def test_chat(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello!"}], max_tokens=8
    )
    assert r.choices[0].message.content
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens == 8


def test_chat_stream_with_usage(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello!"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    assert text
    assert usage is not None and usage.completion_tokens == 8


def test_completions(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8)
    assert r.choices[0].text
    assert r.usage.prompt_tokens > 0


def test_completions_stream(client):
    text = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=8, stream=True
        )
        if c.choices
    )
    assert text


def test_every_connector_is_used(client):
    seen = set()
    # The demo's prefills: two shfs and one of every other connector, in round robin.
    for _ in range(21):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        seen.add(raw.headers["x-pdgate-connector"])
        assert raw.headers["prefill-target-pod"] and raw.headers["target-pod"]
        assert raw.parse().choices[0].message.content
    assert seen == {"shfs", "mooncake", "nixl", "p2pnccl", "moriio", "trtllm"}


def test_errors_are_openai_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "x"}]
        )
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], n=2
        )
    assert e.value.status_code == 400


def test_metrics_count_requests(gateway):
    with urllib.request.urlopen(f"{gateway}/metrics", timeout=5) as r:
        text = r.read().decode()
    assert 'pdgate_requests_total{route="chat"' in text
