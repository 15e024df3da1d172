"""The README's quick start, run as written against `pdgate demo`: the curl example, the
`openai` one-liner and the pdbench line (its request count cut to keep the test short). Only the
address changes: the demo listens on a free loopback port instead of 8080.

Run by .ci/run: PDGATE_BIN points at the built pdgate; pdbench is the binary beside it.
"""

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from procs import free_port, start, stop, wait_http

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def quick_start() -> str:
    """The fenced `sh` block right after the first paragraph after the two first commands."""
    blocks = re.findall(r"```sh\n(.*?)```", README, flags=re.S)
    assert len(blocks) >= 2, "the README starts with two sh blocks"
    return blocks[1]


def command(block: str, starts: str) -> str:
    """The (possibly continued) command line of `block` that starts with `starts`."""
    lines, out, taking = block.splitlines(), [], False
    for line in lines:
        if line.startswith(starts):
            taking = True
        if taking:
            out.append(line.rstrip("\\").rstrip())
            if not line.endswith("\\"):
                break
    assert out, f"no `{starts}` line in the README's quick start"
    return " ".join(out)


@pytest.fixture(scope="module")
def demo():
    binary = os.environ.get("PDGATE_BIN", "target/debug/pdgate")
    port = free_port()
    proc = start([binary, "demo", "--listen", f"127.0.0.1:{port}"])
    try:
        wait_http(proc, f"http://127.0.0.1:{port}/ready")
        yield port, os.path.dirname(binary)
    finally:
        stop(proc)


def at(line: str, port: int) -> str:
    return line.replace("127.0.0.1:8080", f"127.0.0.1:{port}")


def test_the_first_lines_are_the_two_commands():
    first = re.findall(r"```sh\n(.*?)```", README, flags=re.S)[0].splitlines()
    assert first[0].startswith("cargo run --release -p pdgate -- demo"), first
    assert first[1].startswith("cargo test --workspace"), first


def test_the_curl_example(demo):
    port, _ = demo
    line = at(command(quick_start(), "curl "), port)
    out = subprocess.run(line, shell=True, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert body["choices"][0]["text"], body


def test_the_openai_one_liner(demo):
    port, _ = demo
    line = at(command(quick_start(), "python3 -c"), port)
    argv = shlex.split(line)
    argv[0] = sys.executable  # the interpreter that has `openai` installed
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip(), "the one-liner printed the completion"


def test_the_pdbench_line(demo):
    port, bindir = demo
    block = next(b for b in re.findall(r"```sh\n(.*?)```", README, flags=re.S) if b.startswith("pdbench "))
    line = block.splitlines()[0].split("#")[0]
    line = re.sub(r"\[[^\]]*\]", "", at(line, port))          # optional flags in brackets
    line = re.sub(r"--requests \d+", "--requests 200", line)  # a short run
    argv = shlex.split(line)
    argv[0] = os.path.join(bindir, "pdbench")
    out = subprocess.run(argv + ["--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["model"] == "demo", "pdbench asked the gateway which model it serves"
    assert (report["requests"], report["ok"], report["errors"]) == (200, 200, 0), (
        report["errors_by_class"],
        report["sample_error"],
    )
