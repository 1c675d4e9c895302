#!/usr/bin/env python3
"""Cluster accuracy: three tollgate nodes sharing limits through one Redis, in real time.

    python3 bench/cluster.py [--windows 3] [--no-build]

1. A limit of 1,000 per 10 s, traffic split 70/20/10 across the nodes at 5x the limit
   (open loop: 350 + 100 + 50 requests/s): requests admitted cluster-wide per window.
2. A limit of 1 per 30 s under steady load on all nodes: admitted per window (must be 1).
3. Latency at a fixed rate with Redis answering at once and with every Redis command
   delayed by 200 ms (a proxy in front of it): a slow Redis must not slow requests.

Pinning: the three nodes on CPU 1; Redis, the echo backend and the load on CPU 0.
Windows are aligned to the wall clock, as the nodes align them. Writes docs/cluster-results.md.
"""

import argparse
import asyncio
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import procs
from procs import die, wait_port

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / "target" / "release" / "tollgate"
REDIS_PORT = 6391
SLOW_PORT = 6392
BACKEND = "127.0.0.1:1337"


def start(cmd, cpu):
    return subprocess.Popen(["taskset", "-c", cpu] + cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop(p):
    procs.stop(p, timeout=10)


def metric(admin_port, name):
    text = urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/metrics", timeout=2).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def node_config(n, redis_port, prefix):
    text = (ROOT / f"examples/cluster/node-{n}.yaml").read_text()
    text = text.replace("redis://127.0.0.1:6379/0", f"redis://127.0.0.1:{redis_port}/0")
    return text.replace("  max_overadmission: 1%", f"  max_overadmission: 1%\n  key_prefix: {prefix}")


def bench(url, rate, seconds, expect="200,429", connections=20):
    cmd = ["taskset", "-c", "0", str(BIN), "bench", "--json", "-c", str(connections), "--rate", str(rate),
           "-d", f"{int(seconds * 1000)}ms", "--expect", expect, url]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def sleep_until_window(window_s, offset=0.05):
    now = time.time()
    start = (int(now // window_s) + 1) * window_s + offset
    time.sleep(start - now)
    return start


def run_nodes(redis_port, tmp, prefix):
    procs = []
    for n in (1, 2, 3):
        cfg = Path(tmp) / f"node-{n}-{prefix}.yaml"
        cfg.write_text(node_config(n, redis_port, prefix))
        procs.append(start([str(BIN), "run", "--config", str(cfg)], "1"))
    for n, p in zip((1, 2, 3), procs):
        wait_port(f"127.0.0.1:{8080 + n}", p)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            if all(metric(9900 + n, "tollgate_cluster_nodes") == 3 and metric(9900 + n, "tollgate_cluster_redis_up") == 1
                   for n in (1, 2, 3)):
                return procs
        except OSError:
            pass
        time.sleep(0.2)
    die("the nodes did not see each other through Redis")


def accuracy(windows, redis_port, tmp):
    procs = run_nodes(redis_port, tmp, f"acc{time.time_ns()}")
    rows = []
    try:
        split = [(1, 350), (2, 100), (3, 50)]
        for w in range(windows):
            start = sleep_until_window(10)
            runs = [bench(f"http://127.0.0.1:{8080 + n}/test/?apikey=c1", rate, 9.9) for n, rate in split]
            outs = [json.loads(p.communicate()[0]) for p in runs]
            per_node = [o["statuses"].get("200", 0) for o in outs]
            sent = sum(o["requests"] for o in outs)
            errors = sum(sum(o["errors"].values()) for o in outs)
            rows.append({"window": datetime.datetime.fromtimestamp(start, datetime.timezone.utc).strftime("%H:%M:%S"),
                         "sent": sent, "admitted": sum(per_node), "per_node": per_node, "errors": errors})
            print(f"1000/10s window {w + 1}: sent {sent}, admitted {sum(per_node)} {per_node}", flush=True)
        over = sum(metric(9900 + n, "tollgate_cluster_overadmitted_total") or 0 for n in (1, 2, 3))
    finally:
        for p in procs:
            stop(p)
    return rows, over


def exactly_one(windows, redis_port, tmp):
    procs = run_nodes(redis_port, tmp, f"one{time.time_ns()}")
    rows = []
    try:
        for w in range(windows):
            start = sleep_until_window(30)
            runs = [bench(f"http://127.0.0.1:{8080 + n}/test/?apikey=c2", 10, 29.9, connections=4) for n in (1, 2, 3)]
            outs = [json.loads(p.communicate()[0]) for p in runs]
            per_node = [o["statuses"].get("200", 0) for o in outs]
            rows.append({"window": datetime.datetime.fromtimestamp(start, datetime.timezone.utc).strftime("%H:%M:%S"),
                         "sent": sum(o["requests"] for o in outs), "admitted": sum(per_node), "per_node": per_node})
            print(f"1/30s window {w + 1}: admitted {sum(per_node)} {per_node}", flush=True)
    finally:
        for p in procs:
            stop(p)
    return rows


class SlowProxy(threading.Thread):
    """Delays every chunk sent to Redis by `delay` seconds."""

    def __init__(self, listen, target, delay):
        super().__init__(daemon=True)
        self.listen, self.target, self.delay = listen, target, delay
        self.loop = asyncio.new_event_loop()

    def run(self):
        asyncio.set_event_loop(self.loop)

        async def pipe(reader, writer, delay):
            try:
                while data := await reader.read(65536):
                    if delay:
                        await asyncio.sleep(delay)
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                writer.close()

        async def handle(cr, cw):
            try:
                sr, sw = await asyncio.open_connection("127.0.0.1", self.target)
            except OSError:
                cw.close()
                return
            await asyncio.gather(pipe(cr, sw, self.delay), pipe(sr, cw, 0))

        async def main():
            server = await asyncio.start_server(handle, "127.0.0.1", self.listen)
            async with server:
                await server.serve_forever()

        self.loop.run_until_complete(main())


def latency(redis_port, tmp, seconds):
    rows = []
    for label, port in (("Redis answers at once", redis_port), ("every Redis command delayed 200 ms", SLOW_PORT)):
        procs = run_nodes(port, tmp, f"lat{time.time_ns()}")
        try:
            # Consumer 1 well under its limit (100 per second against 1,000 per 10 s would trip,
            # so 90 per second across the three nodes), latency from the intended send time.
            runs = [bench(f"http://127.0.0.1:{8080 + n}/test/?apikey=c3", 30, seconds, connections=4) for n in (1, 2, 3)]
            outs = [json.loads(p.communicate()[0]) for p in runs]
            p50 = max(o["latency_ms"]["p50"] for o in outs)
            p99 = max(o["latency_ms"]["p99"] for o in outs)
            slowest = max(o["latency_ms"]["slowest"] for o in outs)
            statuses = {}
            for o in outs:
                for k, v in o["statuses"].items():
                    statuses[k] = statuses.get(k, 0) + v
            rows.append({"redis": label, "p50": p50, "p99": p99, "slowest": slowest, "statuses": statuses})
            print(f"{label}: p50 {p50:.3f} ms, p99 {p99:.3f} ms, slowest {slowest:.3f} ms, {statuses}", flush=True)
        finally:
            for p in procs:
                stop(p)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--no-build", action="store_true")
    ap.add_argument("--parts", default="accuracy,one,latency", help="which measurements to run")
    args = ap.parse_args()
    for tool in ("redis-server", "taskset"):
        if not shutil.which(tool):
            die(f"needs {tool} (sudo apt-get install {'redis-server' if tool == 'redis-server' else 'util-linux'})")
    if not args.no_build:
        subprocess.run(["cargo", "build", "--release", "--locked", "-q"], cwd=ROOT, check=True)
    redis = start(["redis-server", "--port", str(REDIS_PORT), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"], "0")
    echo = start([str(BIN), "echo", "--listen", BACKEND], "0")
    SlowProxy(SLOW_PORT, REDIS_PORT, 0.2).start()
    try:
        wait_port(f"127.0.0.1:{REDIS_PORT}", redis)
        wait_port(BACKEND, echo)
        wait_port(f"127.0.0.1:{SLOW_PORT}")
        parts = args.parts.split(",")
        with tempfile.TemporaryDirectory() as tmp:
            acc, over = accuracy(args.windows, REDIS_PORT, tmp) if "accuracy" in parts else ([], 0)
            one = exactly_one(max(1, args.windows - 1), REDIS_PORT, tmp) if "one" in parts else []
            lat = latency(REDIS_PORT, tmp, 20) if "latency" in parts else []
    finally:
        stop(echo)
        stop(redis)

    L = ["# Cluster accuracy (generated)\n",
         f"Generated by `python3 bench/cluster.py --windows {args.windows}` on "
         f"{datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}: three nodes on CPU 1, "
         "Redis, the echo backend and the load (`tollgate bench --rate`, open loop) on CPU 0; "
         "`sync_interval: 10ms`, `max_overadmission: 1%`. Windows aligned to the wall clock.\n",
         "## 1,000 per 10 s, traffic 70/20/10 at 5× the limit\n",
         "| window (UTC) | requests sent | admitted cluster-wide | per node (70/20/10) | vs limit | errors |",
         "|---|---|---|---|---|---|"]
    for r in acc:
        L.append(f"| {r['window']} | {r['sent']} | {r['admitted']} | {' / '.join(map(str, r['per_node']))} "
                 f"| {r['admitted'] / 1000 - 1:+.1%} | {r['errors']} |")
    L.append(f"\nRequests admitted on credit that Redis could not grant afterwards (all nodes, all windows): {over:.0f}.\n")
    L.append("## 1 per 30 s, 10 requests/s on each of the three nodes\n")
    L.append("| window (UTC) | requests sent | admitted cluster-wide | per node |")
    L.append("|---|---|---|---|")
    for r in one:
        L.append(f"| {r['window']} | {r['sent']} | {r['admitted']} | {' / '.join(map(str, r['per_node']))} |")
    L.append("\n## Latency with a slow Redis\n")
    L.append("90 requests/s across the three nodes for 20 s, under the limit; latency from each request's "
             "intended send time (worst node).\n")
    L.append("| Redis | p50 ms | p99 ms | slowest ms | statuses |")
    L.append("|---|---|---|---|---|")
    for r in lat:
        L.append(f"| {r['redis']} | {r['p50']:.3f} | {r['p99']:.3f} | {r['slowest']:.3f} | {r['statuses']} |")
    if parts == ["accuracy", "one", "latency"]:
        (ROOT / "docs" / "cluster-results.md").write_text("\n".join(L) + "\n")
        print("wrote docs/cluster-results.md")
    else:
        print("\n".join(L))


if __name__ == "__main__":
    # SIGTERM unwinds like Ctrl-C, so the servers started here are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    main()
