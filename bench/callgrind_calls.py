#!/usr/bin/env python3
"""Heap allocations (and other counted calls) in callgrind output, per unit of work.

Usage: callgrind_calls.py CALLGRIND_OUT... --per N UNIT

Sums the `calls=` lines of every call into jemalloc's allocation and free entry points (the
global allocator of pdgate, pdsim and pdbench; C symbols, never inlined into Rust code), plus
a few per-event suspects (clock reads, timer resets, tracing), and prints them per UNIT.
"""

import re
import sys
from collections import Counter

# Function name -> group.
GROUPS = [
    ("allocations", re.compile(r"^_?rjem_(malloc|mallocx|calloc)$|^(malloc|calloc)$")),
    ("reallocations", re.compile(r"^_?rjem_(realloc|rallocx)$|^realloc$")),
    ("frees", re.compile(r"^_?rjem_(free|sdallocx|dallocx)$|^free$")),
    ("clock reads (clock_gettime)", re.compile(r"^(__vdso_)?clock_gettime")),
    ("timer resets (tokio Sleep::reset)", re.compile(r"tokio::time::sleep::Sleep::reset\b")),
]


def main():
    args = sys.argv[1:]
    if "--per" not in args:
        print(__doc__, file=sys.stderr)
        return 2
    i = args.index("--per")
    files, per, unit = args[:i], int(args[i + 1]), " ".join(args[i + 2:]) or "unit"
    counts = Counter()
    for path in files:
        names = {}
        cfn = None
        with open(path, errors="replace") as f:
            for line in f:
                if line.startswith("cfn="):
                    m = re.match(r"cfn=\((\d+)\)(?: (.*))?", line.rstrip("\n"))
                    if m:
                        if m.group(2):
                            names[m.group(1)] = m.group(2)
                        cfn = names.get(m.group(1))
                    else:
                        cfn = line[4:].strip()
                elif line.startswith("fn="):
                    m = re.match(r"fn=\((\d+)\)(?: (.*))?", line.rstrip("\n"))
                    if m and m.group(2):
                        names[m.group(1)] = m.group(2)
                elif line.startswith("calls=") and cfn:
                    n = int(line[6:].split()[0])
                    for group, rx in GROUPS:
                        if rx.search(cfn):
                            counts[group] += n
                            break
    for group, _ in GROUPS:
        n = counts[group]
        print(f"  {group}: {n} ({n / per:.3f} per {unit})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
