"""Checks pdgate's routing to the data-parallel ranks of a real vLLM engine (standard library only).

Driven by tests/e2e/vllm_dp.sh: a prefill engine of ``--ranks`` data-parallel ranks behind one
URL, declared to pdgate with ``data_parallel_size``. Interleaved shared-prefix groups go through
the gateway. Per request: status 200; the prefill pdgate names (``prefill-target-pod``) is one
rank of the engine (``prefill#dp<r>``); pdgate's ``x-pdgate-predicted-cached-tokens`` equals that
rank's ``vllm:prefix_cache_hits_total`` delta (the engine's per-rank metrics, label ``engine``)
and the answer's ``usage.prompt_tokens_details.cached_tokens``; no other rank computed anything;
a group's later questions go to the rank that holds its prefix and hit there. Over the run both
ranks serve groups. Ends with ``data_parallel: N passed, M failed``.
"""

import argparse
import json
import sys
import time

from check_cache_routing import http, words
from check_pd import Result

MODEL = "tiny"
PREDICTED = "x-pdgate-predicted-cached-tokens"
HITS = "vllm:prefix_cache_hits_total"
PROMPT = "vllm:prompt_tokens_total"
def per_rank(url: str, ranks: int) -> dict[int, dict[str, float]]:
    """Each rank's counters from the engine's /metrics (vLLM labels a rank's series engine="r")."""
    got = {r: {HITS: 0.0, PROMPT: 0.0} for r in range(ranks)}
    _, _, text = http(url + "/metrics")
    for line in text.decode().splitlines():
        if line.startswith("#") or not line:
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        if name not in (HITS, PROMPT):
            continue
        for r in range(ranks):
            if f'engine="{r}"' in labels:
                got[r][name] += float(value)
    return got


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gateway", required=True)
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--ranks", type=int, required=True)
    ap.add_argument("--block-size", type=int, default=32)
    args = ap.parse_args()
    st = Result()
    groups, questions = 4, 3
    prefix = {g: words(9000 + g, 3 * args.block_size) for g in range(groups)}
    home: dict[int, int] = {}
    exact = total = 0
    for q in range(questions):
        for g in range(groups):
            name = f"group{g}-q{q}"
            body = {"model": MODEL, "prompt": prefix[g] + " " + words(9100 + 10 * g + q, 12),
                    "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            before = per_rank(args.prefill, args.ranks)
            status, headers, raw = http(args.gateway + "/v1/completions", body)
            if not st.check(status == 200, f"{name}: 200", f"{status} {raw[:300]!r}"):
                continue
            pod = headers.get("prefill-target-pod", "")
            rank = int(pod.rpartition("#dp")[2]) if "#dp" in pod else None
            if not st.check(rank is not None and 0 <= rank < args.ranks,
                            f"{name}: routed to a rank of the prefill ({pod})", pod):
                continue
            # A rank counts a request's tokens once it finished; the answer may beat the scrape.
            deadline = time.monotonic() + 3
            while True:
                after = per_rank(args.prefill, args.ranks)
                if after[rank][PROMPT] > before[rank][PROMPT] or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            d = {r: {m: after[r][m] - before[r][m] for m in (HITS, PROMPT)} for r in after}
            predicted = int(headers.get(PREDICTED, "-1"))
            cached = (json.loads(raw).get("usage") or {}).get("prompt_tokens_details", {}).get("cached_tokens")
            hits = int(d[rank][HITS])
            print(f"  {name}: rank {rank} predicted={predicted} rank_hits={hits} usage_cached={cached}", flush=True)
            total += 1
            exact += predicted == hits == cached
            st.check(predicted == hits == cached,
                     f"{name}: predicted cached {predicted} == rank {rank}'s prefix hits {hits} == usage {cached}")
            others = [r for r in d if r != rank]
            st.check(all(d[r][PROMPT] == 0 for r in others), f"{name}: no other rank computed",
                     str({r: d[r][PROMPT] for r in others}))
            if q == 0:
                home[g] = rank
            else:
                st.check(rank == home[g], f"{name}: on rank {home[g]}, which holds its prefix", f"rank {rank}")
                st.check(hits > 0, f"{name}: the group's prefix was a hit on its rank", f"{hits} hits")
    st.check(len(set(home.values())) == args.ranks, f"groups spread over all {args.ranks} ranks",
             str(home))
    print(f"  predictions exact on {exact}/{total} requests; groups by rank {home}", flush=True)
    print(f"data_parallel: {st.passed} passed, {st.failed} failed", flush=True)
    return 0 if st.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
