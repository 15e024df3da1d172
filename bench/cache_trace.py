"""A small bounded trace driver for bench/cache.sh (standard library only).

Sends one workload, closed loop, to a gateway (``--url``) or plays the PD gateway itself
(``--direct PREFILL,PREFILL... --decode URL``: prefill leg with the shfs augment and one output
token, prefill chosen round robin, then a streaming decode leg with the returned params).
Every request streams so TTFT is measured; prints one JSON report on stdout.

Workloads (deterministic from --seed):
- ``shared-prefix``: G groups x P prompts; each prompt = the group's system text (S words) +
  a question of Q words; sent group-interleaved, round p rotated by p (g0 g1 .. gN, then
  g1 g2 .. g0, ...), so a blind router spreads every group over every prefill.
- ``random``: G*P unrelated prompts of S+Q words (the control).

This is the stop-gap until pdbench grows its own shared-prefix / multi-turn / random traces;
bench/cache.sh selects the driver with BENCH_DRIVER.
"""

import argparse
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


def post(url: str, body: dict, timeout: float, stream: bool):
    """Returns (status, ttft_s or None, body bytes)."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    t0 = time.monotonic()
    try:
        conn.request("POST", u.path, json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        if not stream or r.status != 200:
            return r.status, None, r.read()
        ttft, chunks = None, []
        while True:
            line = r.readline()
            if not line:
                break
            chunks.append(line)
            if ttft is None and line.startswith(b"data:") and b'"text"' in line and b'"text":""' not in line:
                ttft = time.monotonic() - t0
        return r.status, ttft, b"".join(chunks)
    finally:
        conn.close()


def pct(xs: list[float], q: float):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url")
    ap.add_argument("--direct", help="comma-separated prefill URLs (plays the gateway)")
    ap.add_argument("--decode")
    ap.add_argument("--model", required=True)
    ap.add_argument("--workload", choices=("shared-prefix", "random"), default="shared-prefix")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--per-group", type=int, default=4)
    ap.add_argument("--system-words", type=int, default=600)
    ap.add_argument("--question-words", type=int, default=40)
    ap.add_argument("--output-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    prompts = trace(a.workload, a.groups, a.per_group, a.system_words, a.question_words, a.seed)
    prefills = a.direct.split(",") if a.direct else []
    lock = threading.Lock()
    nxt = [0]
    ttfts, e2es, errors = [], [], {}

    def one(i: int, prompt: str) -> None:
        body = {"model": a.model, "prompt": prompt, "max_tokens": a.output_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}
        t0 = time.monotonic()
        if prefills:
            pre = dict(body, max_tokens=1, stream=False, kv_transfer_params=AUGMENT)
            st, _, raw = post(prefills[i % len(prefills)] + "/v1/completions", pre, a.timeout, False)
            if st != 200:
                raise RuntimeError(f"prefill {st}")
            body["kv_transfer_params"] = json.loads(raw)["kv_transfer_params"]
            t_dec = time.monotonic()
            st, ttft, raw = post(a.decode + "/v1/completions", body, a.timeout, True)
            if ttft is not None:  # the client's TTFT includes the prefill leg
                ttft += t_dec - t0
        else:
            st, ttft, raw = post(a.url + "/v1/completions", body, a.timeout, True)
        if st != 200 or ttft is None:
            raise RuntimeError(f"status {st}")
        with lock:
            ttfts.append(ttft)
            e2es.append(time.monotonic() - t0)

    def worker() -> None:
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= len(prompts):
                return
            try:
                one(i, prompts[i])
            except Exception as e:  # noqa: BLE001 (every failure is counted by kind, not raised)
                with lock:
                    k = str(e)[:60]
                    errors[k] = errors.get(k, 0) + 1

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker) for _ in range(a.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    print(json.dumps({
        "workload": a.workload, "requests": len(prompts), "ok": len(e2es), "errors": errors,
        "wall_s": round(wall, 3), "throughput_rps": round(len(e2es) / wall, 3) if wall else None,
        "ttft_p50_ms": round(pct(ttfts, 0.5) * 1000, 1) if ttfts else None,
        "ttft_p95_ms": round(pct(ttfts, 0.95) * 1000, 1) if ttfts else None,
        "e2e_p50_ms": round(pct(e2es, 0.5) * 1000, 1) if e2es else None,
        "e2e_p95_ms": round(pct(e2es, 0.95) * 1000, 1) if e2es else None,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
