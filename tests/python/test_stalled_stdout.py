"""A gateway whose standard output nobody reads (a pipe left full, a stalled log collector)
keeps serving: the access log's writer blocks on its own thread, never on a runtime worker, so
no request waits for the log. 600 requests write about 200 KiB of access log into a 64 KiB
pipe that is never read."""

import json
import os
import subprocess

from procs import free_port, stop, wait_http


def test_a_full_stdout_pipe_stalls_no_request():
    binary = os.environ.get("PDGATE_BIN", "target/debug/pdgate")
    port = free_port()
    # On purpose: a pipe that is never read.
    proc = subprocess.Popen(
        [binary, "demo", "--listen", f"127.0.0.1:{port}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_http(proc, f"http://127.0.0.1:{port}/ready")
        argv = [os.path.join(os.path.dirname(binary), "pdbench"), "--url", f"http://127.0.0.1:{port}",
                "--api", "chat", "--concurrency", "64", "--requests", "600", "--timeout", "10", "--json"]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        assert (report["ok"], report["errors"]) == (600, 0), (report["errors_by_class"], report["sample_error"])
    finally:
        stop(proc)
