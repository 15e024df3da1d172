"""A small bounded trace driver for bench/cache.sh (standard library only).

Sends one workload, closed loop, to a gateway (``--url``) or plays the PD gateway itself
(``--direct PREFILL,PREFILL... --decode URL``: prefill leg with the shfs augment and one output
token, prefill chosen round robin, then a streaming decode leg with the returned params).
Every request streams so TTFT is measured; prints one JSON report on stdout (percentiles and
every request's TTFT and end-to-end time, for the charts). ``--sent FILE`` writes what was
sent, in send order, one JSON line per request (the oracle is computed from it).

Workloads (deterministic from --seed, the same shapes as pdbench's traces):
- ``shared-prefix``: G groups x P prompts; each prompt = the group's system text (S words) +
  a question of Q words; sent group-interleaved, round p rotated by p (g0 g1 .. gN, then
  g1 g2 .. g0, ...), so a blind router spreads every group over every prefill.
- ``multi-turn``: N sessions x T turns on the chat API; turn t sends the session's system
  text (S words), every earlier user message and answer, and a new user message of Q words;
  a session's next turn is sent only after its previous turn answered and joins the back of
  the queue (sessions interleave).
- ``random``: G*P unrelated prompts of S+Q words (the control).

pdbench (crates/pdbench) has the same three traces; this driver stays because bench/cache.sh
also needs the direct flow over two prefills, p95 and the per-request samples.
"""

import argparse
import collections
import http.client
import json
import sys
import threading
import time
import urllib.parse

WORDS = (
    "the prefill decode engine cache block token request gateway transfer memory host port "
    "model stream chat completion answer question small fast slow river mountain tree city "
    "light water fire earth number one two three four five six seven eight nine ten hello world"
).split()
AUGMENT = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def text(seed: int, n: int) -> str:
    out, x = [], seed & 0x7FFFFFFF
    for _ in range(n):
        x = (x * 1103515245 + 12345) % (1 << 31)
        out.append(WORDS[(x >> 8) % len(WORDS)])
    return " ".join(out)


def trace(kind: str, groups: int, per: int, sys_words: int, q_words: int, seed: int) -> list[str]:
    if kind == "random":
        return [text(seed * 1_000_003 + i, sys_words + q_words) for i in range(groups * per)]
    systems = [text(seed * 7919 + g, sys_words) for g in range(groups)]
    # Round p sends the groups rotated by p: with a plain g0..gN order and an even number of
    # groups, round robin over two prefills pins every group to one prefill and looks perfect
    # (seen in the first real run: round robin at the oracle share).
    return [
        systems[(k + p) % groups] + " " + text(seed * 104729 + ((k + p) % groups) * 1000 + p, q_words)
        for p in range(per)
        for k in range(groups)
    ]


def session_system(seed: int, s: int, sys_words: int) -> str:
    return text(seed * 15485863 + s, sys_words)


def user_message(seed: int, s: int, turn: int, q_words: int) -> str:
    return text(seed * 32452843 + s * 1000 + turn, q_words)


def post(url: str, body: dict, timeout: float, stream: bool):
    """Returns (status, ttft_s or None, body bytes, generated text)."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    t0 = time.monotonic()
    try:
        conn.request("POST", u.path, json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        if not stream or r.status != 200:
            return r.status, None, r.read(), ""
        ttft, chunks, out = None, [], []
        while True:
            line = r.readline()
            if not line:
                break
            chunks.append(line)
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            try:
                ev = json.loads(line[5:])
            except ValueError:
                continue
            for c in ev.get("choices") or []:
                piece = c.get("text") or (c.get("delta") or {}).get("content") or ""
                if piece:
                    out.append(piece)
                    if ttft is None:
                        ttft = time.monotonic() - t0
        return r.status, ttft, b"".join(chunks), "".join(out)
    finally:
        conn.close()


def pct(xs: list[float], q: float):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Queue:
    """Ready requests in send order; multi-turn sessions come back after their answer."""

    def __init__(self, a):
        self.a = a
        self.cv = threading.Condition()
        self.open = 0  # multi-turn: sessions not finished
        if a.workload == "multi-turn":
            self.ready = collections.deque((s, 0) for s in range(a.sessions))
            self.history = {s: [{"role": "system", "content": session_system(a.seed, s, a.system_words)}]
                            for s in range(a.sessions)}
            self.open = a.sessions
        else:
            prompts = trace(a.workload, a.groups, a.per_group, a.system_words, a.question_words, a.seed)
            self.ready = collections.deque(enumerate(prompts))

    def take(self):
        """Next (key, payload) or None when the trace is done; blocks while a turn is pending."""
        with self.cv:
            while not self.ready:
                if self.open == 0:
                    return None
                self.cv.wait(timeout=1)
            key, item = self.ready.popleft()
            if self.a.workload != "multi-turn":
                return key, {"prompt": item}
            s, turn = key, item
            msgs = self.history[s] + [{"role": "user", "content": user_message(self.a.seed, s, turn,
                                                                               self.a.question_words)}]
            return (s, turn), {"messages": msgs}

    def done(self, key, payload, answer: str | None) -> None:
        if self.a.workload != "multi-turn":
            return
        s, turn = key
        with self.cv:
            if answer is None or turn + 1 >= self.a.turns:
                self.open -= 1  # a failed turn ends its session
            else:
                self.history[s] = payload["messages"] + [{"role": "assistant", "content": answer}]
                self.ready.append((s, turn + 1))
            self.cv.notify_all()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url")
    ap.add_argument("--direct", help="comma-separated prefill URLs (plays the gateway)")
    ap.add_argument("--decode")
    ap.add_argument("--model", required=True)
    ap.add_argument("--workload", choices=("shared-prefix", "multi-turn", "random"), default="shared-prefix")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--per-group", type=int, default=4)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-words", type=int, default=600)
    ap.add_argument("--question-words", type=int, default=40)
    ap.add_argument("--output-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--sent", help="write what was sent here, one JSON line per request")
    a = ap.parse_args()
    q = Queue(a)
    prefills = a.direct.split(",") if a.direct else []
    route = "/v1/chat/completions" if a.workload == "multi-turn" else "/v1/completions"
    lock = threading.Lock()
    sent = open(a.sent, "w") if a.sent else None
    n_sent = [0]
    ttfts, e2es, errors = [], [], {}

    def one(i: int, payload: dict) -> str:
        body = {"model": a.model, **payload, "max_tokens": a.output_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}
        t0 = time.monotonic()
        if prefills:
            pre = dict(body, max_tokens=1, stream=False, kv_transfer_params=AUGMENT)
            st, _, raw, _ = post(prefills[i % len(prefills)] + route, pre, a.timeout, False)
            if st != 200:
                raise RuntimeError(f"prefill {st}")
            body["kv_transfer_params"] = json.loads(raw)["kv_transfer_params"]
            t_dec = time.monotonic()
            st, ttft, raw, answer = post(a.decode + route, body, a.timeout, True)
            if ttft is not None:  # the client's TTFT includes the prefill leg
                ttft += t_dec - t0
        else:
            st, ttft, raw, answer = post(a.url + route, body, a.timeout, True)
        if st != 200 or ttft is None:
            raise RuntimeError(f"status {st} {raw[:80]!r}" if st != 200 else "no token")
        with lock:
            ttfts.append(ttft)
            e2es.append(time.monotonic() - t0)
        return answer

    def worker() -> None:
        while True:
            got = q.take()
            if got is None:
                return
            key, payload = got
            with lock:
                i = n_sent[0]
                n_sent[0] += 1
                if sent:
                    sent.write(json.dumps(payload) + "\n")
            answer = None
            try:
                answer = one(i, payload)
            except Exception as e:  # noqa: BLE001 (every failure is counted by kind, not raised)
                with lock:
                    k = str(e)[:60]
                    errors[k] = errors.get(k, 0) + 1
            q.done(key, payload, answer)

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker) for _ in range(a.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    if sent:
        sent.close()
    ms = lambda v: round(v * 1000, 1) if v is not None else None  # noqa: E731
    print(json.dumps({
        "workload": a.workload, "requests": n_sent[0], "ok": len(e2es), "errors": errors,
        "wall_s": round(wall, 3), "throughput_rps": round(len(e2es) / wall, 3) if wall else None,
        "ttft_p50_ms": ms(pct(ttfts, 0.5)), "ttft_p95_ms": ms(pct(ttfts, 0.95)),
        "e2e_p50_ms": ms(pct(e2es, 0.5)), "e2e_p95_ms": ms(pct(e2es, 0.95)),
        "ttft_ms": [ms(v) for v in ttfts], "e2e_ms": [ms(v) for v in e2es],
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
