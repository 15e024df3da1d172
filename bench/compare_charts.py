"""Charts of a bench/compare.sh run (matplotlib, from the bench venv).

  compare_charts.py OUT_DIR [CHART_DIR]

Writes CHART_DIR (default OUT_DIR)/overhead.svg: per closed-loop cell (plain and stream, by
clients), each gateway's throughput against the engines called directly, its CPU per request
(plain) or per relayed event (stream), and its peak RSS, one bar per gateway. The numbers are
ratios.py's, from the same files.
"""

import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ratios  # noqa: E402

COLORS = {"pdgate": "#08519c", "pdgate-base": "#9ecae1", "vllm-router": "#e6550d",
          "floor": "#999999", "floor-drive": "#cccccc", "minproxy": "#31a354"}


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = sys.argv[1]
    charts = sys.argv[2] if len(sys.argv) > 2 else out
    results, proc = ratios.load(out)
    cells = [c for c in ratios.cells_of(results) if c.startswith(("plain-c", "stream-c"))]
    gateways = [t for t in dict.fromkeys(t for c in cells for t in ratios.targets_of(results, c))
                if t != "direct"]
    if not cells or not gateways:
        print(f"compare_charts: no closed-loop cells in {out}", file=sys.stderr)
        return 1
    plt.rcParams.update({"svg.hashsalt": "pdgate", "font.size": 9})
    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    width = 0.8 / len(gateways)
    for i, g in enumerate(gateways):
        ratio, cost, rss = [], [], []
        for c in cells:
            r, base = results.get((c, g)), results.get((c, "direct"))
            rps = (r or {}).get("throughput_rps")
            ratio.append(rps / base["throughput_rps"] if rps and base and base.get("throughput_rps") else 0)
            cpu, per_event, peak = ratios.gateway_cost(r, proc.get((c, g)))
            # Plain cells: CPU us per request; stream cells: CPU us per relayed event.
            cost.append((per_event if c.startswith("stream") else (cpu or 0) * 1000) or 0)
            rss.append(peak or 0)
        xs = [x + (i - (len(gateways) - 1) / 2) * width for x in range(len(cells))]
        for ax, ys in zip(axes, (ratio, cost, rss)):
            ax.bar(xs, ys, width, label=g, color=COLORS.get(g, "#444444"))
    axes[0].axhline(1.0, color="black", linewidth=0.6)
    axes[0].set_ylabel("throughput / direct")
    axes[1].set_yscale("log")
    axes[1].set_ylabel("CPU, us (log): per request (plain),\nper relayed event (stream)")
    axes[2].set_ylabel("peak RSS, MiB")
    axes[2].set_xticks(range(len(cells)), cells)
    axes[0].legend(ncol=len(gateways), loc="upper left", frameon=False)
    axes[0].set_title("What a PD gateway adds: bench/compare.sh, one run")
    fig.tight_layout()
    path = os.path.join(charts, "overhead.svg")
    fig.savefig(path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
