"""Processes for the Python tests: free loopback ports, each process in its own process group,
bounded waits, and stops by the pid that was started."""

import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str]) -> subprocess.Popen:
    """Starts `cmd` in its own process group, its output in a temporary file (`proc.log`): a
    pipe nobody reads fills after 64 KiB of logs and then stalls the process's writes."""
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    proc.log = log
    return proc


def output(proc: subprocess.Popen) -> str:
    """What a process started by `start` has written so far (another: what its pipe holds)."""
    log = getattr(proc, "log", None)
    if log is None:
        return proc.stdout.read().decode(errors="replace") if proc.stdout else ""
    log.seek(0)
    return log.read().decode(errors="replace")


def wait_http(proc: subprocess.Popen, url: str, limit: float = 30, context=None) -> None:
    """Polls `url` until it answers 200; fails when `proc` exits or after `limit` seconds."""
    deadline = time.monotonic() + limit
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited: {output(proc)}")
        try:
            with urllib.request.urlopen(url, timeout=2, context=context) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not ready within {limit} s")
        time.sleep(0.1)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)
