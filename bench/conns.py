#!/usr/bin/env python3
"""Memory per idle keep-alive connection, and what is given back when they close.

    python3 bench/conns.py [--connections 10000] [--waves 3]

Starts the echo backend and tollgate (target/release/tollgate) on scenario 1's config, then
for each wave: opens N client connections, sends one request on each and reads the answer
(so each connection has served a request and sits idle in keep-alive), measures the
gateway's resident memory, closes them all and measures again. With `--paced RPS` (default
2000), a paced load (`tollgate bench --rate RPS`, 5 s, 20 connections) runs before the
first wave and again while its connections are open, for their latency percentiles side by
side. Prints one JSON object: start RSS, RSS with N idle connections and after each wave,
bytes per connection, and the paced runs. Loopback only; every loop is bounded.
"""

import argparse
import json
import os
import resource
import selectors
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from procs import die, stop, wait_port

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / "target" / "release" / "tollgate"
BACKEND = "127.0.0.1:1337"
GATEWAY = "127.0.0.1:8080"
REQUEST = b"GET /test/?apikey=t1 HTTP/1.1\r\nHost: bench\r\n\r\n"


def rss_kib(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def settle_rss(pid, seconds=3.0, still=0.25):
    """RSS once it has not moved for `still` seconds, at most `seconds` from now (closed
    connections are freed, and pages given back, asynchronously)."""
    deadline = time.monotonic() + seconds
    last, since = rss_kib(pid), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = rss_kib(pid)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= still:
            break
    return last


def wave(n):
    """Opens n connections, one request each, and returns the sockets once all answered."""
    socks = []
    sel = selectors.DefaultSelector()
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", 8080))
        s.setblocking(False)
        s.send(REQUEST)
        sel.register(s, selectors.EVENT_READ)
        socks.append(s)
    pending = len(socks)
    deadline = time.monotonic() + 60
    while pending and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=1):
            data = key.fileobj.recv(4096)
            if data:
                sel.unregister(key.fileobj)
                pending -= 1
    sel.close()
    if pending:
        die(f"{pending} of {n} connections got no answer within 60 s")
    return socks


def paced(rate):
    """A 5 s open-loop load at `rate` requests/s: its latency percentiles in ms."""
    out = subprocess.run([BIN, "bench", "--json", "--rate", str(rate), "-d", "5s", "-c", "20",
                          "--expect", "200", f"http://{GATEWAY}/test/?apikey=t1"],
                         capture_output=True, text=True)
    if not out.stdout.strip():
        die(f"bench failed: {out.stderr}")
    r = json.loads(out.stdout)
    lat = r.get("latency_ms") or {}
    return {"requests": r["requests"], "failed": r["failed"],
            "p50_ms": lat.get("p50"), "p99_ms": lat.get("p99"), "max_ms": lat.get("slowest")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--connections", type=int, default=10000)
    ap.add_argument("--waves", type=int, default=3)
    ap.add_argument("--paced", type=int, default=2000, help="paced load, requests/s (0: none)")
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for the gateway")
    args = ap.parse_args()
    if not BIN.exists():
        die("build first: cargo build --release")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = args.connections + 256
    if hard < need:
        die(f"needs `ulimit -n {need}` (hard limit is {hard})")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))

    cfg = (ROOT / "examples" / "seed" / "scenario-1.yaml").read_text()
    capped = cfg.replace("- address: 127.0.0.1:8080", "- address: 127.0.0.1:8080\n    max_connections: 20000")
    if capped == cfg:
        die("scenario-1.yaml's listener line changed: cannot raise its max_connections")
    cfg = capped
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gw.yaml"
        path.write_text(cfg)
        echo = subprocess.Popen([BIN, "echo", "--listen", BACKEND], stderr=subprocess.DEVNULL)
        wait_port(BACKEND, echo)
        gw = subprocess.Popen([BIN, "run", "--config", path], stderr=subprocess.DEVNULL,
                              env={**os.environ, **dict(e.split("=", 1) for e in args.env)})
        try:
            wait_port(GATEWAY, gw)
            waves = []
            load = {}
            if args.paced:
                load["before"] = paced(args.paced)
            # After the paced load: its connections and the upstream pool it filled are
            # not counted per idle connection.
            start = settle_rss(gw.pid)
            for i in range(args.waves):
                socks = wave(args.connections)
                held = settle_rss(gw.pid)
                if args.paced and i == 0:
                    load["with_idle_connections"] = paced(args.paced)
                for s in socks:
                    s.close()
                after = settle_rss(gw.pid, seconds=30.0, still=3.0)
                waves.append({"idle_kib": held, "after_close_kib": after})
            per_conn = (waves[0]["idle_kib"] - start) * 1024 / args.connections
            print(json.dumps({
                "connections": args.connections,
                "start_kib": start,
                "waves": waves,
                "bytes_per_idle_connection": round(per_conn),
                "paced_load": load,
            }, indent=1))
        finally:
            stop(gw)
            stop(echo)


if __name__ == "__main__":
    sys.exit(main())
