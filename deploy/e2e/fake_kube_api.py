#!/usr/bin/env python3
"""A tiny fake Kubernetes API for pdgate's Kubernetes discovery end-to-end check.

Serves GET /api/v1/namespaces/<ns>/pods (list, and watch=true streams) from a JSON file of
pod objects that the test may rewrite at any time: open watches emit ADDED / MODIFIED /
DELETED events for what changed. Honours labelSelector terms of the form k=v.

Usage: fake_kube_api.py PORT PODS_JSON
Optional environment: FAKE_KUBE_API_CERT and FAKE_KUBE_API_KEY (PEM files) serve HTTPS instead
of HTTP, as an in-cluster API server does; FAKE_KUBE_API_TOKEN answers 401 to requests without
`Authorization: Bearer <token>` (the service-account token check).
"""
import json
import os
import ssl
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

PORT, PODS_FILE = int(sys.argv[1]), sys.argv[2]
LOCK = threading.Lock()
STATE = {"rv": 1, "raw": None, "pods": {}}


def strip(pod):
    """The pod without its resourceVersion, for change detection."""
    meta = {k: v for k, v in pod["metadata"].items() if k != "resourceVersion"}
    return json.dumps({**pod, "metadata": meta}, sort_keys=True)


def load():
    """Re-reads the pods file; bumps resourceVersions of changed pods."""
    with LOCK:
        try:
            with open(PODS_FILE) as f:
                raw = f.read()
        except OSError:
            return
        if raw == STATE["raw"]:
            return
        new = {p["metadata"]["name"]: p for p in json.loads(raw)}
        old = STATE["pods"]
        for name, pod in new.items():
            prev = old.get(name)
            if prev is not None and strip(prev) == strip(pod):
                pod["metadata"]["resourceVersion"] = prev["metadata"]["resourceVersion"]
            else:
                STATE["rv"] += 1
                pod["metadata"]["resourceVersion"] = str(STATE["rv"])
        if set(old) - set(new):
            STATE["rv"] += 1
        STATE["raw"], STATE["pods"] = raw, new


def selected(pod, selector):
    labels = pod.get("metadata", {}).get("labels", {})
    terms = [t for t in selector.split(",") if t]
    return all(labels.get(k) == v for k, v in (t.split("=", 1) for t in terms))


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def log_message(self, fmt, *args):
        sys.stderr.write("fake_kube_api: %s\n" % self.path)

    def do_GET(self):
        token = os.environ.get("FAKE_KUBE_API_TOKEN")
        if token and self.headers.get("Authorization") != f"Bearer {token}":
            self.send_error(401)
            return
        url = urlparse(self.path)
        q = parse_qs(url.query)
        selector = q.get("labelSelector", [""])[0]
        load()
        if not url.path.endswith("/pods"):
            self.send_error(404)
            return
        if q.get("watch") != ["true"]:
            with LOCK:
                items = [p for p in STATE["pods"].values() if selected(p, selector)]
                body = json.dumps({"apiVersion": "v1", "kind": "PodList",
                                   "metadata": {"resourceVersion": str(STATE["rv"])},
                                   "items": items}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.end_headers()
        with LOCK:
            seen = {n: p["metadata"]["resourceVersion"] for n, p in STATE["pods"].items()}
        deadline = time.time() + 30
        try:
            while time.time() < deadline:
                time.sleep(0.1)
                load()
                events = []
                with LOCK:
                    pods = dict(STATE["pods"])
                for name, pod in pods.items():
                    if seen.get(name) != pod["metadata"]["resourceVersion"] and selected(pod, selector):
                        events.append({"type": "MODIFIED" if name in seen else "ADDED", "object": pod})
                        seen[name] = pod["metadata"]["resourceVersion"]
                for name in list(seen):
                    if name not in pods:
                        gone = {"apiVersion": "v1", "kind": "Pod",
                                "metadata": {"name": name, "namespace": "llm",
                                             "resourceVersion": str(STATE["rv"])}}
                        events.append({"type": "DELETED", "object": gone})
                        del seen[name]
                for e in events:
                    self.wfile.write((json.dumps(e) + "\n").encode())
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass


server = ThreadingHTTPServer(("127.0.0.1", PORT), Handler)
if os.environ.get("FAKE_KUBE_API_CERT"):
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(os.environ["FAKE_KUBE_API_CERT"], os.environ["FAKE_KUBE_API_KEY"])
    server.socket = tls.wrap_socket(server.socket, server_side=True)
server.serve_forever()
