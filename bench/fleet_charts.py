#!/usr/bin/env python3
"""Table and charts of a bench/fleet.sh run.

Reads OUT/<arm>-r<factor>.json (pdbench --json reports) and OUT/proc.tsv; prints a Markdown
table (one row per arm and rate factor) and, with matplotlib, draws
  OUT/fleet-slo.svg   SLO attainment vs offered request rate, one line per policy;
  OUT/fleet-goodput.svg  goodput (requests/s within both objectives) vs offered rate;
  OUT/fleet-ttft.svg  the TTFT CDF of each policy at one rate factor (the highest that every
                      policy ran, or --cdf-factor).
Usage: fleet_charts.py OUT [--cdf-factor F]
"""

import csv
import json
import sys
from pathlib import Path

ORDER = ["round_robin", "least_request", "ca_approx", "ca_precise", "ca_precise_scrape", "ca_precise_x2",
         "ca_precise_do", "ca_shed", "vllm_router", "smg"]


def load(out: Path):
    runs = []
    for p in sorted(out.glob("*-r*.json")):
        arm, _, factor = p.stem.rpartition("-r")
        try:
            report = json.loads(p.read_text())
        except (json.JSONDecodeError, OSError):
            print(f"skipping {p.name}: not a report", file=sys.stderr)
            continue
        replay = report.get("replay") or {}
        span = replay.get("span_s") or 0.0
        n = replay.get("requests_in_file") or 0
        # Offered rate in simulated requests per second: the trace's mean rate times the factor.
        offered = float(factor) * n / span if span > 0 else 0.0
        runs.append({"arm": arm, "factor": float(factor), "offered": offered, "r": report})
    order = {a: i for i, a in enumerate(ORDER)}
    runs.sort(key=lambda x: (x["factor"], order.get(x["arm"], 99), x["arm"]))
    return runs


def proc(out: Path):
    rows = {}
    p = out / "proc.tsv"
    if p.exists():
        with p.open() as f:
            for row in csv.DictReader(f, delimiter="\t"):
                rows[(row["arm"], float(row["rate_factor"]))] = row
    return rows


def pct(x):
    return "-" if x is None else f"{100 * x:.1f}%"


def ms(p, key):
    return "-" if not p else f"{p[key]:.0f}"


def table(runs, procs):
    head = ("| arm | factor | req/s offered | ok | errors | TTFT p50/p90/p99 ms | ITL p50/p99 ms "
            "| e2e p50/p99 ms | SLO both | goodput req/s | prefill hits | oracle | bounded "
            "| busy max/mean P, D | decode recomputed | gateway CPU | machine busy |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for x in runs:
        r = x["r"]
        slo = r.get("slo") or {}
        eng = r.get("engines") or {}
        oracle = r.get("oracle") or {}
        limited = oracle.get("limited") or {}
        busy = {b["role"]: b.get("max_over_mean") for b in eng.get("balance", [])}
        pr = procs.get((x["arm"], x["factor"]))
        gw = "-"
        machine = "-"
        if pr:
            wall = float(pr["wall_s"]) or 1.0
            gw = f"{float(pr['gateway_cpu_s']) / wall:.2f} cores"
            machine = pct(float(pr["machine_busy"]))
        t, i, e = r.get("ttft_ms"), r.get("itl_ms"), r.get("latency_ms")
        print(
            f"| {x['arm']} | {x['factor']:g} | {x['offered']:.2f} | {r['ok']} | {r['errors']} "
            f"| {ms(t, 'p50')}/{ms(t, 'p90')}/{ms(t, 'p99')} | {ms(i, 'p50')}/{ms(i, 'p99')} "
            f"| {ms(e, 'p50')}/{ms(e, 'p99')} | {pct(slo.get('attainment'))} "
            f"| {slo.get('goodput_rps', 0):.2f} | {pct(eng.get('prefill_hit_share'))} "
            f"| {pct(oracle.get('hit_share'))} | {pct(limited.get('hit_share'))} "
            f"| {busy.get('prefill') or 0:.2f}, {busy.get('decode') or 0:.2f} "
            f"| {eng.get('recomputed', 0):.0f} | {gw} | {machine} |"
        )


def charts(out: Path, runs, cdf_factor):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: no charts", file=sys.stderr)
        return
    arms = [a for a in ORDER if any(x["arm"] == a for x in runs)]
    arms += sorted({x["arm"] for x in runs} - set(arms))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for a in arms:
        pts = sorted((x["offered"], (x["r"].get("slo") or {}).get("attainment", 0.0)) for x in runs if x["arm"] == a)
        ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", label=a)
    ax.set_xlabel("offered request rate (req/s, simulated time)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_title("requests within both the TTFT and the ITL objective")
    ax.set_ylim(0, 102)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "fleet-slo.svg")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for a in arms:
        pts = sorted((x["offered"], (x["r"].get("slo") or {}).get("goodput_rps", 0.0)) for x in runs if x["arm"] == a)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=a)
    ax.set_xlabel("offered request rate (req/s, simulated time)")
    ax.set_ylabel("goodput (req/s within both objectives)")
    ax.set_title("goodput against offered load")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "fleet-goodput.svg")

    factors = sorted({x["factor"] for x in runs})
    if cdf_factor is None:
        full = [f for f in factors if all(any(x["arm"] == a and x["factor"] == f for x in runs) for a in arms)]
        cdf_factor = (full or factors)[-1]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for a in arms:
        for x in runs:
            if x["arm"] == a and x["factor"] == cdf_factor and x["r"].get("ttft_cdf_ms"):
                q = [p[0] for p in x["r"]["ttft_cdf_ms"]]
                v = [p[1] for p in x["r"]["ttft_cdf_ms"]]
                ax.plot(v, q, label=a)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, simulated time)")
    ax.set_ylabel("share of successful requests")
    ax.set_title(f"TTFT CDF at {cdf_factor:g}x the recorded rate")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "fleet-ttft.svg")
    print(f"\ncharts: {out / 'fleet-slo.svg'}, {out / 'fleet-goodput.svg'}, {out / 'fleet-ttft.svg'}",
          file=sys.stderr)


def main():
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    out = Path(sys.argv[1])
    cdf_factor = None
    if "--cdf-factor" in sys.argv:
        cdf_factor = float(sys.argv[sys.argv.index("--cdf-factor") + 1])
    runs = load(out)
    if not runs:
        print(f"no reports in {out}", file=sys.stderr)
        sys.exit(1)
    table(runs, proc(out))
    charts(out, runs, cdf_factor)


if __name__ == "__main__":
    main()
