"""Engine counters for bench/cache.sh (standard library only).

  cache_metrics.py snap NAME=URL ...                  one JSON object: name -> {metric: value}
  cache_metrics.py row ARM WORKLOAD BEFORE AFTER TRACE_JSON ORACLE_JSON   one result row (JSON)
  cache_metrics.py oracle URL MODEL BS TRACE_ARGS...  oracle prefill hits for a trace (JSON)
  cache_metrics.py table RESULTS_JSONL                the table

Engines are named p1, p2 (prefills) and d (decode) in snapshots.
"""

import json
import sys
import urllib.request

METRICS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "vllm:request_prefill_kv_computed_tokens_sum",
    "vllm:nixl_bytes_transferred_sum",
    "vllm:external_prefix_cache_queries_total",
    "vllm:external_prefix_cache_hits_total",
    "vllm:nixl_num_failed_transfers_total",
)


def scrape(url: str) -> dict:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = dict.fromkeys(METRICS, 0.0)
    for line in text.splitlines():
        for m in METRICS:
            if line.startswith(m + "{") or line.startswith(m + " "):
                out[m] += float(line.rsplit(" ", 1)[1])
    return out


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def oracle(url: str, model: str, bs: int, trace_args: list[str]) -> dict:
    """Prefill hits with one infinite cache: each prompt hits the longest prefix any earlier
    prompt stored (whole blocks), capped at floor((n-1)/bs)*bs as the engine caps it."""
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    import cache_trace

    a = dict(zip(trace_args[0::2], trace_args[1::2]))
    prompts = cache_trace.trace(a["workload"], int(a["groups"]), int(a["per_group"]),
                                int(a["system_words"]), int(a["question_words"]), int(a["seed"]))
    stored, hits, total = set(), 0, 0
    for p in prompts:
        toks = post(url + "/tokenize", {"model": model, "prompt": p})["tokens"]
        n, h = len(toks), 0
        while h + bs <= n and tuple(toks[: h + bs]) in stored:
            h += bs
        hits += min(h, (n - 1) // bs * bs)
        total += n
        for k in range(bs, n // bs * bs + 1, bs):
            stored.add(tuple(toks[:k]))
    return {"oracle_hits": hits, "prompt_tokens": total}


def delta(before: dict, after: dict, eng: str, m: str) -> float:
    return after[eng][m] - before[eng][m]


def row(arm: str, workload: str, before: dict, after: dict, trace: dict, orc: dict) -> dict:
    pre = [e for e in after if e.startswith("p")]
    q = sum(delta(before, after, e, "vllm:prefix_cache_queries_total") for e in pre)
    h = sum(delta(before, after, e, "vllm:prefix_cache_hits_total") for e in pre)
    d = lambda m: delta(before, after, "d", m)  # noqa: E731
    return {
        "arm": arm, "workload": workload,
        "prefill_hit_share": round(h / q, 3) if q else None,
        "oracle_share": round(orc["oracle_hits"] / orc["prompt_tokens"], 3) if orc.get("prompt_tokens") else None,
        "prefill_hits": h, "prefill_queried": q,
        "prefill_split": "/".join(f"{delta(before, after, e, 'vllm:prompt_tokens_total'):.0f}" for e in sorted(pre)),
        # Computed = queried - served from cache. vLLM's request_prefill_kv_computed_tokens counts
        # tokens pulled over NIXL as computed on the decode, so it cannot tell a decode that
        # pulled its KV from one that recomputed the prompt.
        "prefill_computed": q - h,
        "decode_computed": d("vllm:prefix_cache_queries_total") - d("vllm:prefix_cache_hits_total")
        - d("vllm:external_prefix_cache_hits_total"),
        "decode_local_hits": d("vllm:prefix_cache_hits_total"),
        "decode_external_hits": d("vllm:external_prefix_cache_hits_total"),
        "nixl_bytes": d("vllm:nixl_bytes_transferred_sum"),
        "nixl_failed": d("vllm:nixl_num_failed_transfers_total"),
        **{k: trace.get(k) for k in ("requests", "ok", "errors", "ttft_p50_ms", "ttft_p95_ms",
                                     "e2e_p50_ms", "e2e_p95_ms", "throughput_rps")},
    }


def table(path: str) -> None:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    cols = ("arm", "workload", "hit", "oracle", "P split", "P comp", "D comp", "D ext", "D local",
            "NIXL MB", "TTFT p50", "p95", "E2E p50", "p95", "req/s", "ok/n", "note")
    out = [cols]
    for r in rows:
        note = ""
        if r.get("ok") and r["nixl_bytes"] == 0:
            note = "decode recomputed: no PD benefit"
        if r.get("errors"):
            note = (note + " errors " + json.dumps(r["errors"])).strip()
        f = lambda v, fmt="{:.0f}": "-" if v is None else fmt.format(v)  # noqa: E731
        out.append((r["arm"], r["workload"], f(r["prefill_hit_share"], "{:.2f}"), f(r["oracle_share"], "{:.2f}"),
                    r["prefill_split"], f(r["prefill_computed"]), f(r["decode_computed"]),
                    f(r["decode_external_hits"]), f(r["decode_local_hits"]), f(r["nixl_bytes"] / 1e6, "{:.1f}"),
                    f(r["ttft_p50_ms"]), f(r["ttft_p95_ms"]), f(r["e2e_p50_ms"]), f(r["e2e_p95_ms"]),
                    f(r["throughput_rps"], "{:.2f}"), f"{r.get('ok')}/{r.get('requests')}", note))
    widths = [max(len(str(row[i])) for row in out) for i in range(len(cols))]
    for row_ in out:
        print("  ".join(str(v).ljust(w) for v, w in zip(row_, widths)).rstrip())


def main() -> int:
    cmd, rest = sys.argv[1], sys.argv[2:]
    if cmd == "snap":
        print(json.dumps({kv.split("=", 1)[0]: scrape(kv.split("=", 1)[1]) for kv in rest}))
    elif cmd == "row":
        arm, workload, b, a, t, o = rest
        load = lambda p: json.load(open(p))  # noqa: E731
        print(json.dumps(row(arm, workload, load(b), load(a), load(t), load(o))))
    elif cmd == "oracle":
        print(json.dumps(oracle(rest[0], rest[1], int(rest[2]), rest[3:])))
    elif cmd == "table":
        table(rest[0])
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
