#!/usr/bin/env python3
"""Turn bench/compare.sh results (pdbench JSON + proc.tsv) into one table of ratios.

Usage: ratios.py OUT_DIR [--markdown]

For every cell (plain-cN, stream-cN, open-loop plain-rR and stream-rR, shared-c1, soak) and target (direct, pdgate, vllm-router,
floor, pdgate-base, minproxy): throughput and its ratio to direct, p50/p99 end-to-end latency added over
direct, TTFT p50 added over direct, TTFT p50/p99 and inter-token p99 (streams), the gateway's
CPU seconds per 1000 successful requests (the CPU sample spans the cell's warm-up, the count does
not), its CPU microseconds per relayed SSE event (streams: warm-up and measured streams, each the
tokens plus the usage event and [DONE]), its peak RSS, and errors.
"""

import csv
import json
import os
import re
import sys

CELL_RE = re.compile(r"^((?:plain|stream|shared)-[cr]\d+|soak)-(.+)\.json$")


def cell_key(cell):
    if cell == "soak":
        return (3, False, 0)
    mode, rest = cell.split("-", 1)
    # Closed-loop cells (cN) first, then open-loop ones (rR), each by size.
    return ({"plain": 0, "stream": 1}.get(mode, 2), rest[0] == "r", int(rest[1:]))


def target_key(t):
    return {"direct": 0, "pdgate": 1, "pdgate-base": 2, "vllm-router": 3, "floor": 4,
            "floor-drive": 5, "minproxy": 6}.get(t, 7), t


def load(out):
    results = {}
    for name in os.listdir(out):
        m = CELL_RE.match(name)
        if not m:
            continue
        try:
            with open(os.path.join(out, name)) as f:
                results[(m.group(1), m.group(2))] = json.load(f)
        except (OSError, ValueError):
            results[(m.group(1), m.group(2))] = None
    proc = {}
    path = os.path.join(out, "proc.tsv")
    if os.path.exists(path):
        with open(path) as f:
            for row in csv.DictReader(f, delimiter="\t"):
                proc[(row["cell"], row["target"])] = row
    return results, proc


def fmt(v, spec):
    return "-" if v is None else format(v, spec)


def pct(r, hist, q):
    h = (r or {}).get(hist)
    return None if not h else h.get(q)


def gateway_cost(r, pr):
    """(CPU ms per successful request, CPU us per relayed event, peak RSS MiB) of one cell's
    target, from its pdbench result and its proc.tsv row (None where unknown)."""
    cpu = rss = per_event = None
    if pr and r and r.get("ok"):
        cpu = float(pr["cpu_s"]) * 1000.0 / r["ok"]
        rss = int(pr["rss_kb"]) / 1024.0
        events = int(pr.get("events_per_stream") or 0)
        if events:
            streams = r["ok"] + int(pr.get("warmup") or 0)
            per_event = float(pr["cpu_s"]) * 1e6 / (streams * events)
    return cpu, per_event, rss


def cells_of(results):
    return sorted({c for c, _ in results}, key=cell_key)


def targets_of(results, cell):
    return sorted({t for c, t in results if c == cell}, key=target_key)


def main():
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = sys.argv[1]
    markdown = "--markdown" in sys.argv[2:]
    results, proc = load(out)
    header = ["cell", "target", "req/s", "x direct", "p50 ms", "+p50 ms", "p99 ms",
              "+p99 ms", "+ttft p50", "ttft p50", "ttft p99", "itl p99", "cpu s/1k",
              "cpu us/ev", "rss MiB", "errors"]
    rows = []
    for cell in cells_of(results):
        base = results.get((cell, "direct"))
        for t in targets_of(results, cell):
            r = results.get((cell, t))
            if r is None:
                rows.append([cell, t] + ["failed"] + ["-"] * (len(header) - 3))
                continue
            rps = r.get("throughput_rps")
            ratio = rps / base["throughput_rps"] if base and base.get("throughput_rps") else None
            p50, p99 = pct(r, "latency_ms", "p50"), pct(r, "latency_ms", "p99")
            b50, b99 = pct(base, "latency_ms", "p50"), pct(base, "latency_ms", "p99")
            t50, bt50 = pct(r, "ttft_ms", "p50"), pct(base, "ttft_ms", "p50")
            add = lambda a, b: None if a is None or b is None else a - b  # noqa: E731
            cpu, per_event, rss = gateway_cost(r, proc.get((cell, t)))
            t99, i99 = pct(r, "ttft_ms", "p99"), pct(r, "itl_ms", "p99")
            errs = r.get("errors_by_class") or {}
            err = ",".join(f"{k}={v}" for k, v in sorted(errs.items())) or "0"
            rows.append([
                cell, t, fmt(rps, ".0f"), fmt(ratio, ".2f"),
                fmt(p50, ".3f"), "" if t == "direct" else fmt(add(p50, b50), "+.3f"),
                fmt(p99, ".3f"), "" if t == "direct" else fmt(add(p99, b99), "+.3f"),
                "" if t == "direct" or t50 is None else fmt(add(t50, bt50), "+.3f"),
                "" if t50 is None else fmt(t50, ".3f"),
                "" if t99 is None else fmt(t99, ".3f"),
                "" if i99 is None else fmt(i99, ".3f"),
                "" if t == "direct" else fmt(cpu, ".3f"),
                "" if per_event is None else fmt(per_event, ".2f"),
                "" if t == "direct" else fmt(rss, ".1f"),
                err,
            ])
    if markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "|".join("---" for _ in header) + "|")
        for row in rows:
            print("| " + " | ".join(row) + " |")
    else:
        widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
        for row in [header] + rows:
            print("  ".join(str(x).rjust(w) if i > 1 else str(x).ljust(w)
                            for i, (x, w) in enumerate(zip(row, widths))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
