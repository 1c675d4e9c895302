#!/usr/bin/env python3
"""An OTLP/HTTP collector that takes every export and keeps nothing, for pricing traces.

    python3 bench/otlp_sink.py [--listen 127.0.0.1:4318] [--seconds 600]

Answers `POST /v1/traces` with 200 and an empty protobuf `ExportTraceServiceResponse`
(zero bytes), counts exports and bytes, and prints them when it stops (SIGTERM, or after
`--seconds`). It does not decode spans: what a real collector does with them is not the
gateway's cost.
"""

import argparse
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

COUNTS = {"exports": 0, "bytes": 0}


class Sink(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        n = int(self.headers.get("content-length", "0"))
        self.rfile.read(n)
        COUNTS["exports"] += 1
        COUNTS["bytes"] += n
        self.send_response(200 if self.path == "/v1/traces" else 404)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--listen", default="127.0.0.1:4318")
    ap.add_argument("--seconds", type=float, default=600)
    args = ap.parse_args()
    host, port = args.listen.rsplit(":", 1)
    server = ThreadingHTTPServer((host, int(port)), Sink)
    stop = lambda *_: threading.Thread(target=server.shutdown).start()
    signal.signal(signal.SIGTERM, stop)
    timer = threading.Timer(args.seconds, stop)
    timer.daemon = True
    timer.start()
    server.serve_forever()
    print(f"{COUNTS['exports']} exports, {COUNTS['bytes']} bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
