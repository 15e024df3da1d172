"""pdsim's KV events decoded with pyzmq + msgpack exactly as a vLLM consumer decodes vLLM's.

Run by .ci/run: PDGATE_BIN points at the built pdgate; pdsim is the binary beside it. The
subscriber binds a free loopback port and pdsim connects to it (vLLM's rule for an endpoint
without `*`); the engine runs in its own process group and is always stopped. Outside CI the
test skips when pyzmq or msgpack is not installed.
"""

import json
import os
import pathlib
import time
import urllib.request

import pytest

from procs import free_port, start, stop, wait_http

if os.environ.get("CI"):
    import msgpack
    import zmq
else:
    zmq = pytest.importorskip("zmq")
    msgpack = pytest.importorskip("msgpack")

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "crates/pdcache/tests/fixtures/vllm-0.32-kv-events.jsonl"
END_SEQ = 0xFFFFFFFFFFFFFFFF


def _pdsim_bin() -> str:
    gate = os.environ.get("PDGATE_BIN", "target/debug/pdgate")
    return str(pathlib.Path(gate).with_name("pdsim"))


def _post(base: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(
        base + path, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read() or b"null")


def _captured_shapes():
    """Key sets and value types of the BlockStored events real vLLM 0.32 sent."""
    shapes = set()
    for line in FIXTURE.read_text().splitlines():
        msg = json.loads(line)
        batch = msgpack.unpackb(bytes.fromhex(msg["payload_hex"]), raw=False)
        for ev in batch[1]:
            if isinstance(ev, dict) and ev["type"] == "BlockStored":
                shapes.add(tuple(sorted(ev)))
    return shapes


@pytest.fixture()
def engine():
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub_port = sub.bind_to_random_port("tcp://127.0.0.1")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    replay_port = free_port()
    port = free_port()
    cfg = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{sub_port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
        "topic": "kv@pdsim",
    }
    proc = start([_pdsim_bin(), "--role", "both", "--connector", "none", "--zero-delay",
                  "--listen", f"127.0.0.1:{port}", "--enable-prompt-tokens-details",
                  "--kv-events-config", json.dumps(cfg)])
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(proc, f"{base}/health")
        yield base, sub, replay_port
    finally:
        sub.close(linger=0)
        stop(proc)


def _recv(sub, timeout_ms=5000):
    if not sub.poll(timeout_ms):
        return None
    return sub.recv_multipart()


def test_events_decode_like_vllm_and_replay(engine):
    base, sub, replay_port = engine
    prompt = " ".join(f"w{i}" for i in range(40))
    # ZMQ drops what is sent before the subscription reaches the publisher: retry until one lands.
    frames = None
    for _ in range(100):
        _post(base, "/reset_prefix_cache", {})
        frames = _recv(sub, 100)
        if frames:
            break
    assert frames, "no event reached the subscriber"
    while _recv(sub, 100):
        pass
    out = _post(base, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    frames = _recv(sub)
    assert frames is not None and len(frames) == 3
    topic, seq, payload = frames
    assert topic == b"kv@pdsim"
    assert len(seq) == 8
    batch = msgpack.unpackb(payload, raw=False)
    assert len(batch) == 3
    ts, events, dp_rank = batch
    assert isinstance(ts, float) and abs(ts - time.time()) < 60
    assert dp_rank == 0
    (ev,) = events
    assert isinstance(ev, dict) and ev["type"] == "BlockStored"
    assert tuple(sorted(ev)) in _captured_shapes()
    assert ev["block_size"] == 16 and ev["parent_block_hash"] is None
    assert len(ev["block_hashes"]) == 2 and all(0 <= h < 2**64 for h in ev["block_hashes"])
    assert len(ev["token_ids"]) == 32
    assert ev["extra_keys"] == [None, None] and ev["medium"] == "GPU"
    assert ev["group_idx"] == 0 and ev["kv_cache_spec_kind"] == "full_attention"
    tokens = _post(base, "/tokenize", {"prompt": prompt})
    assert tokens["tokens"][:32] == ev["token_ids"]
    out = _post(base, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 32

    # Replay: a DEALER asks from the batch just seen; the end marker closes the answer.
    start = int.from_bytes(seq, "big")
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        seqs = []
        while True:
            assert dealer.poll(5000), "replay answered within 5 s"
            parts = dealer.recv_multipart()
            assert parts[0] == b""
            s = int.from_bytes(parts[-2], "big")
            if s == END_SEQ:
                break
            seqs.append(s)
            replayed = msgpack.unpackb(parts[-1], raw=False)
            assert replayed[1][0]["type"] in ("BlockStored", "AllBlocksCleared")
        assert seqs and seqs[0] == start
    finally:
        dealer.close(linger=0)
