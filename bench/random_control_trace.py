#!/usr/bin/env python3
"""The random-prompt control of a Mooncake-format trace: the same arrival times, input and output
lengths, but every block id unique, so no two requests share a prefix and cache-aware routing
has nothing to win (it must not lose either). Reads JSONL, gzipped or not; writes gzipped JSONL.

Usage: bench/random_control_trace.py IN OUT.jsonl.gz"""

import gzip
import json
import sys


def main() -> None:
    src, dst = sys.argv[1], sys.argv[2]
    opener = gzip.open if src.endswith(".gz") else open
    next_id = 0
    with opener(src, "rt") as fin, gzip.open(dst, "wt") as fout:
        for line in fin:
            if not line.strip():
                continue
            rec = json.loads(line)
            n = len(rec.get("hash_ids", []))
            rec["hash_ids"] = list(range(next_id, next_id + n))
            next_id += n
            fout.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
