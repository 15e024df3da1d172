"""Engine counters for bench/cache.sh (standard library only).

  cache_metrics.py snap NAME=URL ...                  one JSON object: name -> {metric: value}
  cache_metrics.py gw URL                             a gateway's decode-only count (JSON)
  cache_metrics.py row ARM WORKLOAD BEFORE AFTER TRACE_JSON ORACLE_JSON GW_JSON   one result row
  cache_metrics.py oracle URL MODEL BS SENT_JSONL     oracle prefill hits of what was sent (JSON)
  cache_metrics.py table RESULTS_JSONL [SUMMARY_JSON] the table (rounds pooled); the pooled rows
  cache_metrics.py markdown RESULTS_JSONL            the same table in Markdown
  cache_metrics.py rows OUT_DIR                       every cell's row again from its saved files

Engines are named p1, p2 (prefills) and d (decode) in snapshots.
"""

import json
import os
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


def oracle(url: str, model: str, bs: int, sent: str) -> dict:
    """Prefill hits with one infinite cache over what was sent, in send order: each prompt hits
    the longest prefix any earlier prompt stored (whole blocks), capped at floor((n-1)/bs)*bs as
    the engine caps it. Prompts are tokenized by the engine (chat: with its template).
    Generated tokens are not counted as reusable (an engine caching its output can beat it on
    multi-turn)."""
    stored, hits, total = set(), 0, 0
    for line in open(sent):
        if not line.strip():
            continue
        toks = post(url + "/tokenize", {"model": model, **json.loads(line)})["tokens"]
        n, h = len(toks), 0
        while h + bs <= n and tuple(toks[: h + bs]) in stored:
            h += bs
        hits += min(h, (n - 1) // bs * bs)
        total += n
        for k in range(bs, n // bs * bs + 1, bs):
            stored.add(tuple(toks[:k]))
    return {"oracle_hits": hits, "prompt_tokens": total}


def decode_only(url: str) -> float | None:
    """pdgate's decode-only decisions (its /metrics), None when the gateway is not pdgate."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            return decode_only_of(r.read().decode())
    except OSError:
        return None


def decode_only_of(text: str) -> float | None:
    n = None
    for line in text.splitlines():
        if line.startswith("pdgate_"):
            n = n or 0.0
        if line.startswith("pdgate_cache_decisions_total{") and 'kind="decode_only"' in line:
            n += float(line.rsplit(" ", 1)[1])
    return n


def delta(before: dict, after: dict, eng: str, m: str) -> float:
    return after[eng][m] - before[eng][m]


def row(arm: str, workload: str, before: dict, after: dict, trace: dict, orc: dict, gw: float | None) -> dict:
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
        "decode_queried": d("vllm:prefix_cache_queries_total"),
        "decode_local_hits": d("vllm:prefix_cache_hits_total"),
        "decode_external_hits": d("vllm:external_prefix_cache_hits_total"),
        "nixl_bytes": d("vllm:nixl_bytes_transferred_sum"),
        "nixl_failed": d("vllm:nixl_num_failed_transfers_total"),
        "decode_only": gw,
        "prompt_tokens": orc.get("prompt_tokens"),
        **{k: trace.get(k) for k in ("requests", "ok", "errors", "ttft_p50_ms", "ttft_p95_ms",
                                     "e2e_p50_ms", "e2e_p95_ms", "throughput_rps", "ttft_ms", "e2e_ms")},
    }


SUMS = ("prefill_hits", "prefill_queried", "prefill_computed", "decode_computed", "decode_queried",
        "decode_local_hits", "decode_external_hits", "nixl_bytes", "nixl_failed", "requests", "ok",
        "prompt_tokens")


def pct(xs: list, q: float):
    xs = sorted(x for x in xs if x is not None)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def pool(rows: list[dict]) -> list[dict]:
    """One row per (arm, workload), rounds pooled: counters summed, percentiles over every
    request, throughput averaged; in first-seen order."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["arm"], r["workload"]), []).append(r)
    out = []
    for (arm, wl), rs in groups.items():
        p = {"arm": arm, "workload": wl, "rounds": len(rs)}
        for k in SUMS:
            p[k] = sum(r.get(k) or 0 for r in rs)
        p["prefill_hit_share"] = round(p["prefill_hits"] / p["prefill_queried"], 3) if p["prefill_queried"] else None
        # Prompt tokens computed nowhere (reused on the prefill, pulled by the decode, or served
        # from the decode's cache): a decode that recomputes the prompt counts against it.
        computed = p["prefill_computed"] + p["decode_computed"]
        p["reuse_share"] = round(1 - computed / p["prompt_tokens"], 3) if p["prompt_tokens"] else None
        orc = [r["oracle_share"] for r in rs if r.get("oracle_share") is not None]
        p["oracle_share"] = round(sum(orc) / len(orc), 3) if orc else None
        splits = [[float(x) for x in r["prefill_split"].split("/")] for r in rs]
        p["prefill_split"] = "/".join(f"{sum(c):.0f}" for c in zip(*splits))
        do = [r.get("decode_only") for r in rs]
        p["decode_only"] = None if all(v is None for v in do) else sum(v or 0 for v in do)
        errs: dict = {}
        for r in rs:
            for k, v in (r.get("errors") or {}).items():
                errs[k] = errs.get(k, 0) + v
        p["errors"] = errs
        p["ttft_ms"] = [v for r in rs for v in (r.get("ttft_ms") or [])]
        p["e2e_ms"] = [v for r in rs for v in (r.get("e2e_ms") or [])]
        for name, xs in (("ttft", p["ttft_ms"]), ("e2e", p["e2e_ms"])):
            p[f"{name}_p50_ms"], p[f"{name}_p95_ms"] = pct(xs, 0.5), pct(xs, 0.95)
        tp = [r["throughput_rps"] for r in rs if r.get("throughput_rps")]
        p["throughput_rps"] = round(sum(tp) / len(tp), 3) if tp else None
        out.append(p)
    return out


def table(path: str, summary: str | None, markdown: bool = False) -> None:
    rows = pool([json.loads(line) for line in open(path) if line.strip()])
    if summary:
        with open(summary, "w") as f:
            json.dump(rows, f)
    cols = ("arm", "workload", "hit", "oracle", "reuse", "P split", "P comp", "D comp", "D ext", "D local",
            "NIXL MB", "D-only", "TTFT p50", "p95", "E2E p50", "p95", "req/s", "ok/n", "note")
    out = [cols]
    for r in rows:
        note = ""
        if r.get("ok") and r["nixl_bytes"] == 0:
            note = "decode recomputed: no PD benefit"
        elif r.get("decode_queried") and r["decode_computed"] > 0.5 * r["decode_queried"] and not r.get("decode_only"):
            note = f"decode recomputed {r['decode_computed'] / r['decode_queried']:.0%} of its prompts"
        if r.get("errors"):
            note = (note + " errors " + json.dumps(r["errors"])).strip()
        f = lambda v, fmt="{:.0f}": "-" if v is None else fmt.format(v)  # noqa: E731
        out.append((r["arm"], r["workload"], f(r["prefill_hit_share"], "{:.2f}"), f(r["oracle_share"], "{:.2f}"),
                    f(r.get("reuse_share"), "{:.2f}"), r["prefill_split"], f(r["prefill_computed"]), f(r["decode_computed"]),
                    f(r["decode_external_hits"]), f(r["decode_local_hits"]), f(r["nixl_bytes"] / 1e6, "{:.1f}"),
                    f(r.get("decode_only")),
                    f(r["ttft_p50_ms"]), f(r["ttft_p95_ms"]), f(r["e2e_p50_ms"]), f(r["e2e_p95_ms"]),
                    f(r["throughput_rps"], "{:.2f}"), f"{r.get('ok')}/{r.get('requests')}", note))
    if markdown:
        print("| " + " | ".join(cols) + " |")
        print("|" + "---|" * len(cols))
        for row_ in out[1:]:
            print("| " + " | ".join(str(v) for v in row_) + " |")
        return
    widths = [max(len(str(row[i])) for row in out) for i in range(len(cols))]
    for row_ in out:
        print("  ".join(str(v).ljust(w) for v, w in zip(row_, widths)).rstrip())


def main() -> int:
    cmd, rest = sys.argv[1], sys.argv[2:]
    if cmd == "snap":
        print(json.dumps({kv.split("=", 1)[0]: scrape(kv.split("=", 1)[1]) for kv in rest}))
    elif cmd == "row":
        arm, workload, b, a, t, o, g = rest
        load = lambda p: json.load(open(p))  # noqa: E731
        print(json.dumps(row(arm, workload, load(b), load(a), load(t), load(o), load(g).get("decode_only"))))
    elif cmd == "rows":
        import glob
        load = lambda p: json.load(open(p))  # noqa: E731
        for t in sorted(glob.glob(rest[0] + "/r*.trace.json"), key=lambda p: os.path.getmtime(p)):
            tag = t[: -len(".trace.json")]
            cell = os.path.basename(tag).split("-", 1)[1]  # r<round>-<workload>-<arm>
            wl = next(w for w in ("shared-prefix", "multi-turn", "random") if cell.startswith(w + "-"))
            arm = cell[len(wl) + 1:]
            if not all(os.path.exists(tag + x) for x in (".after.json", ".oracle.json", ".gw.json")):
                continue  # a cell still running, or cut short
            gw = load(tag + ".gw.json").get("decode_only")
            if os.path.exists(tag + ".gw.prom"):
                gw = decode_only_of(open(tag + ".gw.prom").read())
            print(json.dumps(row(arm, wl, load(tag + ".before.json"), load(tag + ".after.json"), load(t),
                                 load(tag + ".oracle.json"), gw)))
    elif cmd == "gw":
        print(json.dumps({"decode_only": decode_only(rest[0])}))
    elif cmd == "oracle":
        print(json.dumps(oracle(rest[0], rest[1], int(rest[2]), rest[3])))
    elif cmd == "table":
        table(rest[0], rest[1] if len(rest) > 1 else None)
    elif cmd == "markdown":
        table(rest[0], None, markdown=True)
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
