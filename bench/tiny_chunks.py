#!/usr/bin/env python3
"""Memory a request body costs while the gateway reads it ahead, by the size of its chunks.

    python3 bench/tiny_chunks.py [--bin target/release/tollgate] [--connections 50]

For each shape of the same 65,535-byte body (one chunk; 65,535 one-byte chunks written
`0000000000000001\\r\\nX\\r\\n`), starts the gateway alone on loopback, opens the
connections, sends each a chunked POST with that body and no last chunk (so the gateway
holds what it read ahead, up to 64 KiB, until `body_timeout`), waits until the gateway's
resident memory settles (`conns.settle_rss`), and prints the growth. The upstream is never reached.
"""

import argparse
import os
import socket
import subprocess
import tempfile
from pathlib import Path

from conns import settle_rss
from procs import stop, wait_port

ROOT = Path(__file__).resolve().parent.parent
ADDR = ("127.0.0.1", 18380)
HEAD = b"POST /x HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n"
SHAPES = {
    "one chunk": b"%x\r\n" % 65535 + b"X" * 65535 + b"\r\n",
    "one-byte chunks": b"0000000000000001\r\nX\r\n" * 65535,
}


def run(binary, connections, body):
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "gw.yaml"
        cfg.write_text(
            f"listeners: [{{address: \"{ADDR[0]}:{ADDR[1]}\", body_timeout: 60s}}]\n"
            "upstreams: {backend: {targets: [\"127.0.0.1:9\"]}}\n"
            "routes: [{name: all, path_prefix: /, upstream: backend}]\n")
        gw = subprocess.Popen([binary, "run", "--config", str(cfg)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, env=dict(os.environ, RUST_LOG="warn"))
        socks = []
        try:
            wait_port(f"{ADDR[0]}:{ADDR[1]}", gw)
            before = settle_rss(gw.pid, seconds=15, still=0.5)
            for _ in range(connections):
                s = socket.create_connection(ADDR)
                s.sendall(HEAD + body)
                socks.append(s)
            return before, settle_rss(gw.pid, seconds=15, still=0.5)
        finally:
            for s in socks:
                s.close()
            stop(gw)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=str(ROOT / "target/release/tollgate"))
    ap.add_argument("--connections", type=int, default=50)
    args = ap.parse_args()
    print(f"{args.bin}, {args.connections} connections")
    for name, body in SHAPES.items():
        before, after = run(args.bin, args.connections, body)
        grown = (after - before) * 1024
        print(f"{name:16} RSS {before:,} → {after:,} KiB: +{grown / 1e6:.1f} MB, "
              f"{grown / args.connections / 1024:,.0f} KiB a connection")


if __name__ == "__main__":
    main()
