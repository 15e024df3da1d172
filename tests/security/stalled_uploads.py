"""Memory held by stalled uploads: N clients each send a request head announcing a large body,
then part of it, then nothing. Prints pdgate's resident memory before and while they stall, and
what each client was answered.

    python3 tests/security/stalled_uploads.py --pdgate target/debug/pdgate --pdsim target/debug/pdsim

Starts one pdsim prefill and decode and a pdgate in front of them (all on free loopback ports, each
in its own process group, stopped by their pids at the end). Bounded: every wait has a timeout.
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def wait_http(url, limit=30):
    deadline = time.time() + limit
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{url} not up within {limit}s")


def start(cmd):
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def stop(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pdgate", required=True)
    ap.add_argument("--pdsim", required=True)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--announce-mib", type=int, default=30, help="Content-Length of each upload")
    ap.add_argument("--send-mib", type=int, default=10, help="bytes each client sends before stalling")
    ap.add_argument("--hold", type=float, default=3.0, help="seconds to stall before measuring")
    ap.add_argument("pdgate_args", nargs="*", help="extra pdgate flags (after --)")
    a = ap.parse_args()
    procs = []
    try:
        p_port, d_port, g_port = free_port(), free_port(), free_port()
        for role, port in (("prefill", p_port), ("decode", d_port)):
            procs.append(start([a.pdsim, "--role", role, "--listen", f"127.0.0.1:{port}", "--model", "m",
                                "--bootstrap-listen", f"127.0.0.1:{free_port()}"]))
        wait_http(f"http://127.0.0.1:{p_port}/health")
        wait_http(f"http://127.0.0.1:{d_port}/health")
        gw = start([a.pdgate, "--listen", f"127.0.0.1:{g_port}", "--prefill", f"http://127.0.0.1:{p_port}",
                    "--decode", f"http://127.0.0.1:{d_port}", "--model", "m",
                    "--set", "max_body_bytes=67108864", *a.pdgate_args])
        procs.append(gw)
        wait_http(f"http://127.0.0.1:{g_port}/health")
        before = rss_mib(gw.pid)
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {a.announce_mib << 20}\r\n\r\n").encode()
        chunk = b'{"model":"m","prompt":"' + b"a" * ((a.send_mib << 20) - 24)
        clients = []
        for _ in range(a.clients):
            s = socket.create_connection(("127.0.0.1", g_port), timeout=10)
            s.sendall(head)
            clients.append(s)
        for s in clients:
            s.setblocking(False)
        # Send the partial bodies without blocking on a client the gateway does not read.
        pending = {s: memoryview(chunk) for s in clients}
        deadline = time.time() + 30
        while pending and time.time() < deadline:
            for s, rest in list(pending.items()):
                try:
                    n = s.send(rest[:1 << 20])
                    pending[s] = rest[n:]
                    if not pending[s]:
                        del pending[s]
                except BlockingIOError:
                    pass
                except OSError:
                    del pending[s]
            time.sleep(0.001)
        time.sleep(a.hold)
        during = rss_mib(gw.pid)
        answers = {}
        for s in clients:
            s.setblocking(True)
            s.settimeout(0.2)
            try:
                first = s.recv(64).split(b" ")
                status = first[1].decode() if len(first) > 1 else "closed"
            except (socket.timeout, BlockingIOError):
                status = "waiting"
            except OSError:
                status = "reset"
            answers[status] = answers.get(status, 0) + 1
            s.close()
        print(json.dumps({
            "clients": a.clients, "announced_mib": a.announce_mib, "sent_mib": a.send_mib,
            "rss_before_mib": round(before, 1), "rss_stalled_mib": round(during, 1),
            "answers": answers,
        }))
    finally:
        for p in reversed(procs):
            stop(p)


if __name__ == "__main__":
    sys.exit(main())
