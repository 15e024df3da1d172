#!/usr/bin/env python3
"""Checks that every metric the Grafana dashboard queries is one pdgate exports.

Usage: check_metrics.py DASHBOARD.json METRICS.txt
METRICS.txt is a scrape of pdgate's /metrics (Prometheus text). A histogram's
`_bucket`/`_sum`/`_count` and a counter's `_total` count as the family pdgate declares
with `# TYPE`. Exits 1 naming every metric the dashboard asks for and pdgate lacks.
"""
import json
import re
import sys

SUFFIXES = ("_bucket", "_sum", "_count", "_total", "_created")


def queried(dashboard):
    exprs = []

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                exprs.append(node["expr"])
            if isinstance(node.get("query"), str):
                exprs.append(node["query"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(dashboard)
    names = set()
    for e in exprs:
        names.update(re.findall(r"\b(pdgate_[a-zA-Z0-9_]+)", e))
    return names


def exported(text):
    families, samples = set(), set()
    for line in text.splitlines():
        m = re.match(r"# TYPE (\S+) (\S+)", line)
        if m:
            families.add(m.group(1))
        elif line and not line.startswith("#"):
            samples.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return families, samples


def known(name, families, samples):
    if name in samples or name in families:
        return True
    return any(name.endswith(s) and name[: -len(s)] in families for s in SUFFIXES)


def main():
    dashboard = json.load(open(sys.argv[1]))
    families, samples = exported(open(sys.argv[2]).read())
    wanted = queried(dashboard)
    if not wanted:
        print("the dashboard queries no pdgate metric", file=sys.stderr)
        return 1
    missing = sorted(n for n in wanted if not known(n, families, samples))
    if missing:
        print("the dashboard queries metrics pdgate does not export:", *missing, sep="\n  ", file=sys.stderr)
        return 1
    print(f"dashboard: all {len(wanted)} queried metrics are exported")
    return 0


if __name__ == "__main__":
    sys.exit(main())
