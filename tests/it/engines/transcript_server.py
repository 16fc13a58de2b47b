#!/usr/bin/env python3
"""Records a serving engine's HTTP exchanges, or serves them again: the integration tests audit
recorded responses of a real engine (vLLM 0.28 on a CPU, docs/ENGINES.md) without the engine.

    transcript_server.py record UPSTREAM OUT.jsonl [--port P]   # a proxy to UPSTREAM, every exchange appended
    transcript_server.py serve IN.jsonl [--port P]              # answers each request as recorded

Each line of a transcript: {"request": {"method", "path", "body"}, "response": {"status", "body"}},
bodies as JSON. A request is matched by method, path and body (JSON, keys sorted); a request that
was not recorded gets HTTP 404 with a one-line reason. ``--port 0`` picks a free port; the server
prints ``READY <port>`` once listening. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

LOCK = threading.Lock()


def key(method: str, path: str, body: Any) -> str:
    return json.dumps([method, path, body], sort_keys=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("upstream")
    rec.add_argument("out")
    srv = sub.add_parser("serve")
    srv.add_argument("transcript")
    for p in (rec, srv):
        p.add_argument("--port", type=int, default=0)
    args = parser.parse_args()

    recorded: dict[str, tuple[int, Any]] = {}
    if args.mode == "serve":
        with open(args.transcript, encoding="utf-8") as f:
            for line in f:
                x = json.loads(line)
                q, r = x["request"], x["response"]
                recorded[key(q["method"], q["path"], q["body"])] = (r["status"], r["body"])

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_: Any) -> None:
            pass

        def handle_any(self, method: str) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b""
            body = json.loads(raw) if raw else None
            if args.mode == "serve":
                status, answer = recorded.get(
                    key(method, self.path, body), (404, {"detail": f"not recorded: {method} {self.path}"})
                )
            else:
                request = urllib.request.Request(
                    args.upstream.rstrip("/") + self.path,
                    data=raw or None,
                    method=method,
                    headers={"Content-Type": "application/json"},
                )
                try:
                    with urllib.request.urlopen(request, timeout=600) as r:
                        status, text = r.status, r.read()
                except urllib.error.HTTPError as e:
                    status, text = e.code, e.read()
                answer = json.loads(text) if text else None
                with LOCK, open(args.out, "a", encoding="utf-8") as f:
                    exchange = {"method": method, "path": self.path, "body": body}
                    f.write(json.dumps({"request": exchange, "response": {"status": status, "body": answer}}) + "\n")
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.handle_any("GET")

        def do_POST(self) -> None:  # noqa: N802
            self.handle_any("POST")

    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    print(f"READY {server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
