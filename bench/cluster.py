#!/usr/bin/env python3
"""Shared limits in real time: three tollgate nodes on loopback sharing each consumer's
limits through Redis, in its three modes, and through failures.

    python3 bench/cluster.py [--rounds 2] [--no-build] [--parts modes,one60,sentinel,cluster-kill,cutoff,latency]

- modes: 1,000 per 10 s, traffic split 70/20/10 across the nodes at 5x the limit (open
  loop: 350 + 100 + 50 requests/s) for 22 s, over one Redis and over a Redis Cluster of
  three masters (each with a replica), against one node alone: the most requests admitted
  in any 10 s span, and the nodes' CPU per request. Interleaved, `--rounds` times.
- one60: 1 per 30 s driven from the three nodes (10 requests/s each) for 60 s from a random
  start: how many pass, and how far apart.
- sentinel / cluster-kill: the same 70/20/10 load for 33 s; 8 s in, the master is killed
  (Sentinel: one master, two replicas, three sentinels; Cluster: the master of the
  consumer's slot). When the replica is promoted, when each node follows it, the most
  admitted in any 10 s span, the slowest request.
- cutoff: the busiest node cut off from Redis for 30 s (its link to Redis goes through a
  relay that drops its connections and refuses new ones), then back.
- latency: latency at a fixed rate with Redis answering at once and with every Redis
  command delayed by 200 ms (a proxy in front of it): a slow Redis must not slow requests.

Admitted requests are read from the nodes' access logs. Pinning: the nodes on CPU 1;
Redis, the echo backend and the load on CPU 0. Writes docs/cluster-results.md.
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

import cluster_ha
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


class Ctx:
    """What the measurements share: the binary, a scratch folder, process helpers."""

    def __init__(self, tmp):
        self.tmp, self.bin = Path(tmp), BIN

    @staticmethod
    def start(cmd, cpu):
        return start(cmd, cpu)

    @staticmethod
    def stop(p):
        stop(p)

    @staticmethod
    def bench(url, rate, seconds, expect="200,429", connections=20):
        return bench(url, rate, seconds, expect, connections)


def report(args, modes, one, fails, cut, lat):
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    L = ["# Cluster accuracy and failures (generated)\n",
         f"Generated by `python3 bench/cluster.py --rounds {args.rounds}` on {now}: three nodes on CPU 1; "
         "Redis, the echo backend and the load (`tollgate bench --rate`, open loop) on CPU 0; "
         "`sync_interval: 10ms`, `max_overadmission: 1%`, `on_redis_down: open`. Admitted requests are "
         "read from the nodes' access logs.\n",
         "## 1,000 per 10 s, traffic 70/20/10 at 5× the limit, 22 s\n",
         "| mode | round | requests sent | admitted | most in any 10 s | vs limit | CPU µs / request | slowest ms | errors |",
         "|---|---|---|---|---|---|---|---|---|"]
    for r in modes:
        L.append(f"| {r['mode']} | {r['round']} | {r['sent']} | {r['admitted']} | {r['most_in_window']} "
                 f"| {r['most_in_window'] / 1000 - 1:+.1%} | {r['cpu_us']:.1f} | {r['slowest_ms']:.1f} | {r['errors']} |")
    if modes:
        def med(label, k):
            v = sorted(r[k] for r in modes if r["mode"] == label)
            return v[len(v) // 2] if v else float("nan")
        L.append(f"\nMedian CPU per request: Redis Cluster {med('Redis Cluster', 'cpu_us'):.1f} µs against one Redis "
                 f"{med('one Redis', 'cpu_us'):.1f} µs (ratio {med('Redis Cluster', 'cpu_us') / med('one Redis', 'cpu_us'):.3f}). "
                 "A lone node serves all 500 requests/s itself.\n")
    if one:
        L.append("## 1 per 30 s from three nodes for 60 s\n")
        L.append("| run | admitted | gaps between them (s) | most in any 30 s |")
        L.append("|---|---|---|---|")
        for r in one:
            L.append(f"| {r['run']} | {r['admitted']} | {r['gaps_s']} | {r['most_in_30s']} |")
    if fails:
        L.append("\n## The master killed (or moved by `SENTINEL FAILOVER`) 10.5 s into a 33 s run (70/20/10 at 5×), as the first window's requests leave it\n")
        L.append("| Redis | replica promoted after (s) | nodes following it after (s) | admitted | admitted alone meanwhile | most in any 10 s | vs limit | slowest request ms | errors |")
        L.append("|---|---|---|---|---|---|---|---|---|")
        for r in fails:
            prom = "—" if r["promoted_after_s"] is None else f"{r['promoted_after_s']:.2f}"
            L.append(f"| {r['redis']} | {prom} | {' / '.join(map(str, r['followed_after_s']))} | {r['admitted']} "
                     f"| {r['fail_open']:.0f} | {r['most_in_window']} | {r['most_in_window'] / 1000 - 1:+.1%} | {r['slowest_ms']:.1f} | {r['errors']} |")
        L.append("\nTimes are from the kill. A node follows when its `/status` names the promoted server and Redis answers it. "
                 "\"Admitted alone\": requests the nodes admitted on their shares while no master answered "
                 "(`tollgate_cluster_fail_open_admitted_total`), added to the counts when they re-joined.\n")
    if cut:
        L.append("## The busiest node (70%) cut off from Redis for 30 s of a 50 s run\n")
        L.append("| admitted | most in any 10 s | most in any 10 s while cut | most in any 10 s after | admitted alone by the cut node | slowest ms | errors |")
        L.append("|---|---|---|---|---|---|---|")
        L.append(f"| {cut['admitted']} | {cut['most_in_window']} | {cut['most_in_window_cut']} | {cut['most_in_window_after']} "
                 f"| {cut['cut_node_fail_open']:.0f} | {cut['slowest_ms']:.1f} | {cut['errors']} |")
    if lat:
        L.append("\n## Latency with a slow Redis\n")
        L.append("90 requests/s across the three nodes for 20 s, under the limit; latency from each request's "
                 "intended send time (worst node).\n")
        L.append("| Redis | p50 ms | p99 ms | slowest ms | statuses |")
        L.append("|---|---|---|---|---|")
        for r in lat:
            L.append(f"| {r['redis']} | {r['p50']:.3f} | {r['p99']:.3f} | {r['slowest']:.3f} | {r['statuses']} |")
    return "\n".join(L) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-build", action="store_true")
    ap.add_argument("--parts", default="modes,one60,sentinel,sentinel-planned,cluster-kill,cutoff,latency",
                    help="which measurements to run")
    args = ap.parse_args()
    for tool in ("redis-server", "redis-cli", "taskset"):
        if not shutil.which(tool):
            die(f"needs {tool} (sudo apt-get install {'util-linux' if tool == 'taskset' else 'redis-server'})")
    if not args.no_build:
        subprocess.run(["cargo", "build", "--release", "--locked", "-q"], cwd=ROOT, check=True)
    parts = args.parts.split(",")
    echo = start([str(BIN), "echo", "--listen", BACKEND], "0")
    modes, one, fails, cut, lat = [], [], [], None, []
    try:
        wait_port(BACKEND, echo)
        with tempfile.TemporaryDirectory() as tmp:
            ctx = Ctx(tmp)
            if "modes" in parts:
                modes = cluster_ha.modes(ctx, args.rounds)
            if "one60" in parts:
                one = cluster_ha.one60(ctx)
            if "sentinel" in parts:
                fails.append(cluster_ha.failover(ctx, "sentinel"))
            if "sentinel-planned" in parts:
                fails.append(cluster_ha.failover(ctx, "sentinel", planned=True))
            if "cluster-kill" in parts:
                fails.append(cluster_ha.failover(ctx, "cluster"))
            if "cutoff" in parts:
                cut = cluster_ha.cutoff(ctx)
            if "latency" in parts:
                redis = start(["redis-server", "--port", str(REDIS_PORT), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no"], "0")
                SlowProxy(SLOW_PORT, REDIS_PORT, 0.2).start()
                try:
                    wait_port(f"127.0.0.1:{REDIS_PORT}", redis)
                    wait_port(f"127.0.0.1:{SLOW_PORT}")
                    lat = latency(REDIS_PORT, tmp, 20)
                finally:
                    stop(redis)
    finally:
        stop(echo)
    text = report(args, modes, one, fails, cut, lat)
    if parts == ["modes", "one60", "sentinel", "sentinel-planned", "cluster-kill", "cutoff", "latency"]:
        (ROOT / "docs" / "cluster-results.md").write_text(text)
        print("wrote docs/cluster-results.md")
    else:
        print(text)


if __name__ == "__main__":
    # SIGTERM unwinds like Ctrl-C, so the servers started here are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    main()
