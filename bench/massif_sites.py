#!/usr/bin/env python3
"""Group the peak heap of a valgrind massif profile by allocation site.

Usage: massif_sites.py MASSIF_OUT [TOP]

For every leaf of the peak snapshot's allocation tree, the site is the first stack frame
(from the allocator outwards) that is not allocator or container plumbing, so hyper's read
buffers, write buffers and request channels show up as themselves instead of as
`RawVec::grow`. Prints the peak heap and the TOP (default 12) largest sites.
"""

import collections
import re
import sys

PLUMBING = re.compile(
    r"alloc::|raw_vec|bytes_mut|grow|realloc|malloc|UnknownInlinedFun|__rust|RawVec|core::ptr"
    r"|with_capacity|alloc \(|alloc_impl|allocate|reserve|Box<|<alloc|Vec<T|from_iter|extend|to_vec|clone|into_boxed"
    r"|Arc<|Arc::new|new \(|String|spec_"
)
NODE = re.compile(r"\s*n(\d+): (\d+) (.*)")


def peak_tree(lines):
    """Lines of the peak snapshot's heap tree (or of the largest snapshot)."""
    snapshots, current = [], None
    for i, line in enumerate(lines):
        if line.startswith("snapshot="):
            current = {"start": i, "heap": 0, "kind": ""}
            snapshots.append(current)
        elif current is not None and line.startswith("mem_heap_B="):
            current["heap"] = int(line.split("=", 1)[1])
        elif current is not None and line.startswith("heap_tree="):
            current["kind"] = line.split("=", 1)[1]
    if not snapshots:
        return 0, []
    peaks = [s for s in snapshots if s["kind"] == "peak"]
    snap = peaks[0] if peaks else max(snapshots, key=lambda s: s["heap"])
    i = snap["start"]
    while i < len(lines) and not lines[i].startswith("heap_tree="):
        i += 1
    tree = []
    for line in lines[i + 1:]:
        if not NODE.match(line):
            break
        tree.append(line)
    return snap["heap"], tree


def sites(tree):
    total = collections.Counter()
    stack = []
    for line in tree:
        m = NODE.match(line)
        depth = len(line) - len(line.lstrip(" "))
        children, size, desc = int(m.group(1)), int(m.group(2)), m.group(3)
        del stack[depth:]
        stack.append(desc)
        if children:
            continue
        name = None
        for frame in stack[1:]:
            if not PLUMBING.search(frame):
                name = re.sub(r"\(.*$", "", frame.split(": ", 1)[-1]).strip()[:150]
                break
        total[name or desc[:100]] += size
    return total


def main():
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    with open(sys.argv[1]) as f:
        heap, tree = peak_tree(f.read().split("\n"))
    print(f"peak heap: {heap / 1048576:.1f} MiB")
    for site, size in sites(tree).most_common(top):
        print(f"{size / 1048576:8.2f} MiB  {site}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
