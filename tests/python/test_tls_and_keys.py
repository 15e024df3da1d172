"""pdgate standing on the internet by itself: HTTPS on the listener and client API keys, tried
with the real `openai` client and `curl` (HTTP/1.1 and HTTP/2 by ALPN).

Run by .ci/run: PDGATE_BIN points at the built pdgate; pdsim is the binary beside it. The
certificate is made here with `openssl`; engines and gateway run on free loopback ports in their
own process groups and are always stopped.
"""

import os
import shutil
import ssl
import subprocess

import openai
import pytest

try:  # the HTTP client the installed openai is built on: httpx2 (openai >= 3), httpx before
    import httpx2 as http_client_lib
except ImportError:
    import httpx as http_client_lib

from procs import free_port, start, stop, wait_http

KEY = "sk-test-1"
MODEL = "m"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.fail("openssl is needed to make the test certificate")
    tmp = tmp_path_factory.mktemp("tls")
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True, timeout=30,
    )
    pdgate = os.environ.get("PDGATE_BIN", "target/debug/pdgate")
    pdsim = os.path.join(os.path.dirname(pdgate), "pdsim")
    procs = []
    try:
        engines = []
        for role in ("prefill", "decode"):
            port = free_port()
            p = start([pdsim, "--role", role, "--listen", f"127.0.0.1:{port}", "--model", MODEL,
                       "--bootstrap-listen", f"127.0.0.1:{free_port()}"])
            procs.append(p)
            wait_http(p, f"http://127.0.0.1:{port}/health")
            engines.append(f"http://127.0.0.1:{port}")
        port = free_port()
        gw = start([pdgate, "--listen", f"127.0.0.1:{port}", "--prefill", engines[0], "--decode", engines[1],
                    "--model", MODEL, "--tls-cert", str(cert), "--tls-key", str(key), "--api-key", KEY])
        procs.append(gw)
        base = f"https://127.0.0.1:{port}"
        wait_http(gw, f"{base}/ready", context=ssl.create_default_context(cafile=str(cert)))
        yield base, str(cert)
    finally:
        for p in reversed(procs):
            stop(p)


def client(base, cert, key=KEY):
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=30,
                         http_client=http_client_lib.Client(verify=ssl.create_default_context(cafile=cert)))


def test_openai_client_over_https(gateway):
    base, cert = gateway
    r = client(base, cert).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=4)
    assert r.choices[0].message.content
    stream = client(base, cert).completions.create(model=MODEL, prompt="hi", max_tokens=4, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices)


def test_wrong_or_missing_key_is_401(gateway):
    base, cert = gateway
    with pytest.raises(openai.AuthenticationError) as e:
        client(base, cert, key="sk-wrong").models.list()
    assert e.value.status_code == 401
    assert e.value.body["type"] == "invalid_request_error"
    # No Authorization header at all (the openai client always sends one), and a key sent
    # under another scheme: both 401 with the same OpenAI-shaped error, nothing served.
    with http_client_lib.Client(verify=ssl.create_default_context(cafile=cert), timeout=30) as http:
        for headers in ({}, {"Authorization": f"Basic {KEY}"}):
            for method, path, body in (("GET", "/v1/models", None),
                                       ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})):
                r = http.request(method, f"{base}{path}", headers=headers, json=body)
                assert r.status_code == 401, (headers, path, r.text)
                error = r.json()["error"]
                assert error["type"] == "invalid_request_error" and error["code"] == 401, error
                assert "choices" not in r.json() and "data" not in r.json()


@pytest.mark.parametrize("version,flag", [("2", "--http2"), ("1.1", "--http1.1")])
def test_curl_speaks_both_versions(gateway, version, flag):
    base, cert = gateway
    out = subprocess.run(
        ["curl", "-sS", flag, "--cacert", cert, "-o", "/dev/null", "-w", "%{http_version} %{http_code}",
         "-H", f"Authorization: Bearer {KEY}", "-H", "content-type: application/json",
         "-d", '{"model":"m","prompt":"hi","max_tokens":2}', f"{base}/v1/completions"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"{version} 200"


def test_curl_refuses_an_unknown_certificate(gateway):
    base, _ = gateway
    out = subprocess.run(["curl", "-sS", "-o", "/dev/null", f"{base}/health"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 60, (out.returncode, out.stderr)
