"""Charts of a bench/cache.sh run (matplotlib, from the bench venv).

  cache_charts.py SUMMARY_JSON OUT_DIR

Writes OUT_DIR/cache-ttft.svg (TTFT of every request per arm, one panel per workload: box of
p25-p75 with the median, whiskers p5-p95, points beyond) and OUT_DIR/cache-hits.svg (prefill
hit share per arm from the engines' counters, one group per workload, against the trace's
oracle share; below it, prompt tokens computed on the prefills and the decode per prompt token,
where a decode that recomputes the prompt shows and decode-only serving counts as reuse).
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {
    "direct": "#999999",
    "pdgate-rr": "#9ecae1", "pdgate-ca-approx": "#4292c6", "pdgate-ca-precise": "#08519c",
    "pdgate-ca-precise-do": "#08306b",
    "vllm-router-rr": "#fdd0a2", "vllm-router-ca": "#e6550d",
    "smg-rr": "#c7e9c0", "smg-ca": "#31a354",
}


def color(arm: str) -> str:
    return COLORS.get(arm, "#444444")


def main() -> int:
    rows = json.load(open(sys.argv[1]))
    out = sys.argv[2]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    by = {(r["arm"], r["workload"]): r for r in rows}
    plt.rcParams.update({"svg.hashsalt": "pdgate", "font.size": 9})

    fig, axes = plt.subplots(1, len(workloads), figsize=(4.2 * len(workloads), 4.6), squeeze=False)
    for ax, wl in zip(axes[0], workloads):
        present = [a for a in arms if (a, wl) in by and by[(a, wl)]["ttft_ms"]]
        data = [by[(a, wl)]["ttft_ms"] for a in present]
        if data:
            bp = ax.boxplot(data, orientation="horizontal", whis=(5, 95), patch_artist=True, widths=0.6,
                            flierprops={"markersize": 2})
            for patch, a in zip(bp["boxes"], present):
                patch.set_facecolor(color(a))
                patch.set_alpha(0.6)
        ax.set_yticks(range(1, len(present) + 1), present)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (ms, log)")
        ax.set_title(wl)
        ax.grid(axis="x", alpha=0.3, which="both")
    fig.suptitle("TTFT per request (box p25-p75, median, whiskers p5-p95)")
    fig.tight_layout()
    fig.savefig(f"{out}/cache-ttft.svg", metadata={"Date": None})
    plt.close(fig)

    fig, (ax, bx) = plt.subplots(2, 1, sharex=True,
                                 figsize=(max(8.0, 0.45 * len(arms) * len(workloads) + 2.5), 6.6))
    width = 0.8 / max(1, len(arms))
    for j, wl in enumerate(workloads):
        for i, a in enumerate(arms):
            r = by.get((a, wl))
            if not r:
                continue
            x = j + (i - (len(arms) - 1) / 2) * width
            if r.get("prefill_hit_share") is not None:
                ax.bar(x, r["prefill_hit_share"], width * 0.9, color=color(a), label=a if j == 0 else None)
            if r.get("reuse_share") is not None:
                bx.bar(x, 1 - r["reuse_share"], width * 0.9, color=color(a))
        orc = [by[(a, wl)]["oracle_share"] for a in arms if (a, wl) in by and by[(a, wl)].get("oracle_share") is not None]
        if orc:
            o = sum(orc) / len(orc)
            ax.hlines(o, j - 0.45, j + 0.45, colors="black", linestyles="dashed",
                      label="oracle (one infinite cache)" if j == 0 else None)
            bx.hlines(1 - o, j - 0.45, j + 0.45, colors="black", linestyles="dashed")
    ax.set_ylabel("prefill hit share\n(engine counters)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7, ncol=1, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.set_title("Prefill prefix-cache hit share per arm against the oracle (dashed)")
    bx.set_ylabel("prompt tokens computed\n(prefills + decode) / prompt")
    bx.set_title("Tokens computed per prompt token: 1 - oracle at best; a decode that recomputes adds up to 1", fontsize=8)
    bx.set_xticks(range(len(workloads)), workloads)
    fig.tight_layout()
    fig.savefig(f"{out}/cache-hits.svg", metadata={"Date": None})
    plt.close(fig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
