"""Checks the facts pdgate's cache-aware routing relies on against one real vLLM engine.

Driven by tests/e2e/vllm_cache.sh, which starts the engine with
``--block-size 32 --prefix-caching-hash-algo sha256_cbor --enable-prompt-tokens-details``
and ``--kv-events-config`` whose endpoint is ``tcp://127.0.0.1:SUB_PORT`` (so the engine's PUB
connects to the SUB this script binds) and whose replay endpoint is ``tcp://127.0.0.1:REPLAY_PORT``.

Checks, one ``PASS``/``FAIL`` line each, ending with ``kv_events: N passed, M failed``:
- every message is 3 frames (topic, 8-byte big-endian sequence, msgpack payload), sequences
  count up by one, payloads decode as ``[ts, events, dp_rank]`` with map events;
- the tokens in ``BlockStored`` equal the engine's ``/tokenize`` of the request (completion and chat);
- the block hashes equal vLLM's sha256_cbor chain recomputed here (and, with ``--pdcache-tokens``,
  pdcache's tokenizer and hash from the Rust example agree with both);
- ``vllm:prefix_cache_hits_total`` grows per request by the prediction "longest prefix of the
  request's full blocks already stored, capped at floor((n-1)/bs)*bs", and
  ``usage.prompt_tokens_details.cached_tokens`` equals it;
- replay over a DEALER socket returns every batch the SUB received, byte for byte, then the end marker.

Needs pyzmq and a msgpack decoder (``msgpack`` or, as in vLLM's own venv, ``msgspec``).
"""

import argparse
import hashlib
import json
import subprocess
import sys
import time
import urllib.request

import zmq

try:
    import msgpack

    def unpack(b: bytes):
        return msgpack.unpackb(b, raw=False, strict_map_key=False)

except ImportError:  # vLLM's venv has msgspec (its own encoder), not msgpack
    import msgspec

    def unpack(b: bytes):
        return msgspec.msgpack.decode(b)


MODEL = "tiny"
HTTP_TIMEOUT_S = 60
EVENT_WAIT_S = 5.0
END_SEQ = 0xFFFFFFFFFFFFFFFF
WORDS = (
    "the prefill decode engine cache block token request gateway transfer memory host port "
    "model stream chat completion answer question small fast slow river mountain tree city"
).split()


class Result:
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


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S) as r:
        return json.loads(r.read())


def metric(base: str, name: str) -> float:
    with urllib.request.urlopen(base + "/metrics", timeout=HTTP_TIMEOUT_S) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


# ---- vLLM's sha256_cbor chain, written out (canonical CBOR of [bytes32, [uint...], null]) ----
def cbor_head(major: int, n: int) -> bytes:
    m = major << 5
    if n < 24:
        return bytes([m | n])
    for add, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * size):
            return bytes([m | add]) + n.to_bytes(size, "big")
    raise ValueError(n)


NONE_HASH = hashlib.sha256(cbor_head(3, len(b"vllm-none-hash")) + b"vllm-none-hash").digest()


def block_chain(tokens: list[int], bs: int) -> list[int]:
    parent, out = NONE_HASH, []
    for i in range(len(tokens) // bs):
        blk = tokens[i * bs : (i + 1) * bs]
        enc = cbor_head(4, 3) + cbor_head(2, 32) + parent + cbor_head(4, len(blk))
        enc += b"".join(cbor_head(0, t) for t in blk) + b"\xf6"
        parent = hashlib.sha256(enc).digest()
        out.append(int.from_bytes(parent[24:], "big"))
    return out


class Events:
    """The SUB side: every message kept raw, the engine's blocks tracked as token prefixes."""

    def __init__(self, ctx: zmq.Context, port: int, topic: str) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sock.bind(f"tcp://127.0.0.1:{port}")
        self.raw: list[tuple[int, bytes]] = []
        self.bad_frames: list[str] = []
        self.by_hash: dict[int, tuple] = {}  # engine hash -> the whole token prefix it ends
        self.stored: set[tuple] = set()  # token prefixes (multiples of bs) the engine holds
        self.unknown_parent = 0
        self.kinds: dict[str, int] = {}
        self.non_map = 0

    def pump(self, until, timeout: float) -> bool:
        """Reads messages until `until()` holds or `timeout` passes; returns `until()`."""
        deadline = time.monotonic() + timeout
        while not until():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if not self.sock.poll(int(left * 1000) + 1):
                continue
            frames = self.sock.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                self.bad_frames.append(f"{len(frames)} frames")
                continue
            seq = int.from_bytes(frames[1], "big")
            self.raw.append((seq, frames[2]))
            self.apply(unpack(frames[2]))
        return True

    def apply(self, batch) -> None:
        events = batch[1]
        for ev in events:
            if not isinstance(ev, dict):
                self.non_map += 1
                continue
            kind = ev.get("type")
            self.kinds[kind] = self.kinds.get(kind, 0) + 1
            if kind == "BlockStored":
                bs = ev["block_size"]
                parent = ev.get("parent_block_hash")
                prefix = () if parent is None else self.by_hash.get(parent)
                if prefix is None:
                    self.unknown_parent += 1
                    continue
                toks = ev["token_ids"]
                for i, h in enumerate(ev["block_hashes"]):
                    prefix = prefix + tuple(toks[i * bs : (i + 1) * bs])
                    self.by_hash[h] = prefix
                    self.stored.add(prefix)
            elif kind == "BlockRemoved":
                for h in ev["block_hashes"]:
                    self.stored.discard(self.by_hash.pop(h, None))
            elif kind == "AllBlocksCleared":
                self.by_hash.clear()
                self.stored.clear()

    def predict(self, tokens: list[int], bs: int) -> int:
        hit = 0
        while hit + bs <= len(tokens) and tuple(tokens[: hit + bs]) in self.stored:
            hit += bs
        return min(hit, (len(tokens) - 1) // bs * bs)

    def holds_all(self, tokens: list[int], bs: int) -> bool:
        full = len(tokens) // bs * bs
        return all(tuple(tokens[:k]) in self.stored for k in range(bs, full + 1, bs))


def words(seed: int, n: int) -> str:
    # A fixed linear congruential walk: the same prompts every run, no RNG state shared.
    out, x = [], seed
    for _ in range(n):
        x = (x * 1103515245 + 12345) % (1 << 31)
        out.append(WORDS[x % len(WORDS)])
    return " ".join(out)


def requests_to_send() -> list[dict]:
    """Completions and chats that share prefixes in several ways (block size 32)."""
    system = words(1, 120)
    doc = words(2, 90)
    reqs = [
        {"prompt": system + " " + doc},  # cold
        {"prompt": system + " " + doc},  # the same again: capped at floor((n-1)/bs)*bs
        {"prompt": system + " " + words(3, 40)},  # shares the system part
        {"prompt": system},  # a prefix of something stored
        {"prompt": words(4, 60)},  # unrelated
    ]
    chat = [{"role": "system", "content": system}, {"role": "user", "content": doc}]
    reqs.append({"messages": chat})
    reqs.append({"messages": chat + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": words(5, 30)}]})
    reqs.append({"messages": chat})
    return reqs


def tokenize(base: str, req: dict) -> list[int]:
    if "messages" in req:
        body = {"model": MODEL, "messages": req["messages"], "add_generation_prompt": True}
    else:
        body = {"model": MODEL, "prompt": req["prompt"]}
    return post(base + "/tokenize", body)["tokens"]


def send(base: str, req: dict) -> dict:
    body = {"model": MODEL, "max_tokens": 1, "temperature": 0}
    if "messages" in req:
        return post(base + "/v1/chat/completions", {**body, "messages": req["messages"]})
    return post(base + "/v1/completions", {**body, "prompt": req["prompt"]})


def check_replay(res: Result, ctx: zmq.Context, port: int, ev: Events) -> None:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    start = ev.raw[0][0] if ev.raw else 0
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    got: dict[int, bytes] = {}
    ended = False
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not ended:
        if not dealer.poll(1000):
            continue
        frames = dealer.recv_multipart()
        # ["", topic, seq, payload] (some vLLM snapshots omit the topic frame)
        seq_frame = frames[-2]
        seq = int.from_bytes(seq_frame, "big")
        if seq == END_SEQ:
            ended = True
        else:
            got[seq] = frames[-1]
    dealer.close()
    res.check(ended, "replay ends with the 0xFFFF_FFFF_FFFF_FFFF marker", f"{len(got)} batches, no end")
    want = dict(ev.raw)
    res.check(
        all(got.get(s) == p for s, p in want.items()),
        f"replay from seq {start} returns the {len(want)} batches the SUB got, byte for byte",
        f"missing or different: {[s for s, p in want.items() if got.get(s) != p][:5]}",
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", required=True)
    ap.add_argument("--sub-port", type=int, required=True)
    ap.add_argument("--replay-port", type=int, required=True)
    ap.add_argument("--topic", default="kv")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--pdcache-tokens", help="pdcache's `tokens` example binary")
    ap.add_argument("--tokenizer", help="tokenizer.json for --pdcache-tokens")
    args = ap.parse_args()
    bs = args.block_size
    res = Result()
    ctx = zmq.Context()
    ev = Events(ctx, args.sub_port, args.topic)
    # The engine's PUB connects to us and drops whatever it publishes before the connection and
    # subscription are up (seen: the first batch lost on a busy machine). Send unrelated warm-up
    # prompts until one's BlockStored arrives; only then is every later batch delivered.
    joined = False
    for attempt in range(10):
        warm = {"prompt": words(1000 + attempt, 3 * bs)}
        toks = tokenize(args.engine, warm)
        send(args.engine, warm)
        if ev.pump(lambda t=toks: ev.holds_all(t, bs), 3.0):
            joined = True
            break
    res.check(joined, "events arrive on the SUB (a warm-up request's BlockStored seen)")
    first_measured = len(ev.raw)
    rust = None
    if args.pdcache_tokens:
        rust = subprocess.Popen(
            [args.pdcache_tokens, args.tokenizer, str(bs)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    exact = 0
    reqs = requests_to_send()
    for i, req in enumerate(reqs):
        name = f"req{i} ({'chat' if 'messages' in req else 'completion'})"
        tokens = tokenize(args.engine, req)
        n = len(tokens)
        predicted = ev.predict(tokens, bs)
        hits0 = metric(args.engine, "vllm:prefix_cache_hits_total")
        reply = send(args.engine, req)
        usage = reply.get("usage") or {}
        res.check(usage.get("prompt_tokens") == n, f"{name}: usage.prompt_tokens == /tokenize length {n}", str(usage))
        arrived = ev.pump(lambda t=tokens: ev.holds_all(t, bs), EVENT_WAIT_S)
        res.check(arrived, f"{name}: BlockStored events cover its {n // bs} full blocks with /tokenize's tokens",
                  f"stored {sum(1 for k in range(bs, n // bs * bs + 1, bs) if tuple(tokens[:k]) in ev.stored)}")
        hashes = [h for h, p in ev.by_hash.items() if len(p) <= n and list(p) == tokens[: len(p)]]
        want_hashes = block_chain(tokens, bs)
        res.check(sorted(hashes) == sorted(want_hashes), f"{name}: event hashes == sha256_cbor chain of /tokenize's tokens",
                  f"{len(hashes)} vs {len(want_hashes)}")
        delta = metric(args.engine, "vllm:prefix_cache_hits_total") - hits0
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        ok = res.check(delta == predicted, f"{name}: prefix_cache_hits_total delta {delta:.0f} == predicted {predicted} (n={n})")
        res.check(cached == predicted, f"{name}: usage cached_tokens {cached} == predicted {predicted}")
        exact += ok
        if rust is not None:
            rust.stdin.write(json.dumps(req) + "\n")
            rust.stdin.flush()
            line = rust.stdout.readline()
            mine = json.loads(line) if line else {}
            res.check(mine.get("tokens") == tokens, f"{name}: pdcache tokens == /tokenize", f"{mine.get('tokens', [])[:8]}... vs {tokens[:8]}...")
            res.check(mine.get("hashes") == want_hashes, f"{name}: pdcache sha256_cbor hashes == engine's")
    if rust is not None:
        rust.stdin.close()
        rust.wait(timeout=10)

    seqs = [s for s, _ in ev.raw[first_measured:]]
    res.check(not ev.bad_frames, "every message is [topic, 8-byte seq, payload]", str(ev.bad_frames[:3]))
    res.check(seqs == list(range(seqs[0], seqs[0] + len(seqs))) if seqs else False,
              f"sequences count up by one ({len(seqs)} batches, from {seqs[0] if seqs else None})")
    res.check(ev.non_map == 0 and ev.unknown_parent == 0, "events are maps and every parent was seen",
              f"non-map {ev.non_map}, unknown parents {ev.unknown_parent}")
    print(f"events by kind: {ev.kinds}; prediction exact on {exact}/{len(reqs)} requests", flush=True)
    check_replay(res, ctx, args.replay_port, ev)
    ev.sock.close()
    ctx.term()
    print(f"kv_events: {res.passed} passed, {res.failed} failed", flush=True)
    return 0 if res.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
