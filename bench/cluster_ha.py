"""Shared limits over the three Redis modes, and what failures do to them: the
measurements of `bench/cluster.py --parts modes,sentinel,cluster-kill,cutoff,one60`.

Every admitted request is taken from the nodes' access logs (time, consumer, status), so
accuracy is judged the way the limit is defined: the most requests admitted in any span
of one window, against the limit."""

import datetime
import json
import random
import threading
import time
import urllib.request

import redis_topo
import seed
from procs import die, wait_port

N, W = 1000, 10.0
SPLIT = [(1, 350), (2, 100), (3, 50)]


def node_yaml(n, redis, prefix, log, redis_port_for=None):
    return f"""listeners: [{{address: "127.0.0.1:{8080 + n}"}}]
admin: {{address: "127.0.0.1:{9900 + n}"}}
cluster:
  redis: {redis_port_for or redis}
  sync_interval: 10ms
  on_redis_down: open
  max_overadmission: 1%
  key_prefix: {prefix}
access_log: {{path: {log}}}
upstreams: {{backend: {{targets: ["127.0.0.1:1337"]}}}}
plans:
  standard: {{limits: [{{requests: {N}, per: 10s}}]}}
  trickle: {{limits: [{{requests: 1, per: 30s}}]}}
consumers:
  - {{name: consumer-1, keys: [c1], plan: standard}}
  - {{name: consumer-2, keys: [c2], plan: trickle}}
routes:
  - {{name: test, path_prefix: /test/, upstream: backend, auth: {{query: [apikey]}}}}
"""


def lone_yaml(log):
    """One node, no cluster: the sliding window a node keeps alone."""
    text = node_yaml(1, "", "x", log)
    start = text.index("cluster:")
    end = text.index("access_log:")
    return text[:start] + text[end:]


def status(n):
    try:
        return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{9900 + n}/status", timeout=1).read())
    except (OSError, ValueError):
        return {}


def metric(n, name):
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{9900 + n}/metrics", timeout=2).read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


class Nodes:
    """Three gateway nodes (or one lone node) on CPU 1, each with its own access log."""

    def __init__(self, ctx, redis, prefix, count=3, redis_for=None):
        self.ctx, self.logs, self.procs = ctx, [], []
        for n in range(1, count + 1):
            log = ctx.tmp / f"access-{prefix}-{n}.log"
            cfg = ctx.tmp / f"node-{prefix}-{n}.yaml"
            cfg.write_text(lone_yaml(log) if redis is None else
                           node_yaml(n, redis, prefix, log, (redis_for or {}).get(n)))
            self.logs.append(log)
            self.procs.append(ctx.start([str(ctx.bin), "run", "--config", str(cfg)], "1"))
        for n, p in enumerate(self.procs, 1):
            wait_port(f"127.0.0.1:{8080 + n}", p)
        if redis is not None:
            redis_topo.until("the nodes see each other through Redis", lambda: all(
                metric(n, "tollgate_cluster_nodes") == count and metric(n, "tollgate_cluster_redis_up") == 1
                for n in range(1, count + 1)))

    def cpu(self):
        return seed.cpu_seconds([p.pid for p in self.procs])

    def admitted(self, consumer):
        """Times (epoch seconds) of the requests admitted for `consumer`, all nodes."""
        out = []
        for log in self.logs:
            if not log.exists():
                continue
            for line in log.read_text().splitlines():
                try:
                    r = json.loads(line)
                except ValueError:
                    continue
                if r.get("consumer") == consumer and r.get("status") == 200:
                    t = datetime.datetime.fromisoformat(r["time"].replace("Z", "+00:00"))
                    out.append(t.timestamp())
        return sorted(out)

    def stop(self):
        for p in self.procs:
            self.ctx.stop(p)


def most_in_span(times, span):
    """The most of `times` within any half-open span of `span` seconds."""
    best, j = 0, 0
    for i, t in enumerate(times):
        while times[j] <= t - span:
            j += 1
        best = max(best, i - j + 1)
    return best


def start_load(ctx, seconds, consumer="c1", split=SPLIT, connections=20):
    """Open-loop load on each node of `split` ((node, requests/s), …), started at once."""
    return [ctx.bench(f"http://127.0.0.1:{8080 + n}/test/?apikey={consumer}", rate, seconds, connections=connections)
            for n, rate in split]


def finish(runs):
    """Each load's JSON report, once it ends."""
    return [json.loads(p.communicate()[0]) for p in runs]


def load(ctx, seconds, consumer="c1", split=SPLIT):
    return finish(start_load(ctx, seconds, consumer, split))


def summary(outs):
    sent = sum(o["requests"] for o in outs)
    slowest = max((o.get("latency_ms") or {}).get("slowest", 0) for o in outs)
    errors = sum(sum(o["errors"].values()) for o in outs)
    return sent, slowest, errors


def modes(ctx, rounds, seconds=22.0):
    """One Redis against a Redis Cluster (and a lone node), interleaved: accuracy and CPU."""
    rows = []
    for r in range(rounds):
        for label in ("lone node", "one Redis", "Redis Cluster"):
            if label == "one Redis":
                topo = redis_topo.single(6391, ctx.tmp)
            elif label == "Redis Cluster":
                topo = redis_topo.cluster(7100, ctx.tmp)
            else:
                topo = None
            prefix = f"m{time.time_ns()}"
            nodes = Nodes(ctx, None if topo is None else topo.redis, prefix, count=1 if topo is None else 3)
            try:
                split = [(1, 500)] if topo is None else SPLIT
                cpu0 = nodes.cpu()
                outs = load(ctx, seconds, split=split)
                cpu = nodes.cpu() - cpu0
                times = nodes.admitted("consumer-1")
            finally:
                nodes.stop()
                if topo:
                    topo.stop()
            sent, slowest, errors = summary(outs)
            row = {"mode": label, "round": r + 1, "sent": sent, "admitted": len(times),
                   "most_in_window": most_in_span(times, W), "cpu_us": cpu * 1e6 / max(sent, 1),
                   "slowest_ms": slowest, "errors": errors}
            rows.append(row)
            print(f"modes: {row}", flush=True)
    return rows


def failover(ctx, kind, seconds=33.0, kill_at=10.5, planned=False):
    """The Redis master killed mid-run (Sentinel, or the Cluster master of consumer-1's slot);
    `planned`: Sentinel's master moved by `SENTINEL FAILOVER` instead, the old one alive."""
    topo = redis_topo.sentinel(6400, ctx.tmp) if kind == "sentinel" else redis_topo.cluster(7200, ctx.tmp)
    prefix = f"f{time.time_ns()}"
    nodes = Nodes(ctx, topo.redis, prefix)
    key = f"{prefix}:consumer:{{consumer-1}}:{N}-per-10s:{N}:10"
    seen = {}
    stop = threading.Event()
    try:
        victim = topo.master if kind == "sentinel" else redis_topo.cluster_owner(topo, key)
        masters_before = [p for p in topo.procs if redis_topo.role(p) == "master"]
        replicas = [p for p in topo.procs if redis_topo.role(p) == "slave"]
        killed = {}

        def watch():
            while not stop.is_set():
                if "at" in killed:
                    if "promoted" not in killed:
                        for p in replicas:
                            if p not in masters_before and redis_topo.role(p) == "master":
                                killed["promoted"] = (p, time.monotonic() - killed["at"])
                    for n in (1, 2, 3):
                        if n in seen:
                            continue
                        c = status(n).get("cluster", {})
                        server = c.get("server", {})
                        promoted = killed.get("promoted", (None,))[0]
                        follows = promoted is not None and c.get("redis_up") and (
                            server.get("address") == f"127.0.0.1:{promoted}" if kind == "sentinel"
                            else f"127.0.0.1:{promoted}" in (server.get("masters") or []))
                        if follows:
                            seen[n] = time.monotonic() - killed["at"]
                time.sleep(0.1)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        runs = start_load(ctx, seconds)
        time.sleep(kill_at)
        killed["at"], killed["wall"] = time.monotonic(), time.time()
        if planned:
            asked = redis_topo.cli(6410, "SENTINEL", "FAILOVER", "tg")
            if asked != "OK":
                raise RuntimeError(f"SENTINEL FAILOVER: {asked}")
        else:
            topo.kill(victim)
        outs = finish(runs)
        redis_topo.until("every node follows", lambda: len(seen) == 3, timeout=20)
        stop.set()
        fail_open = sum(metric(n, "tollgate_cluster_fail_open_admitted_total") or 0 for n in (1, 2, 3))
        times = nodes.admitted("consumer-1")
    finally:
        stop.set()
        nodes.stop()
        topo.stop()
    sent, slowest, errors = summary(outs)
    row = {"redis": f"{kind} (SENTINEL FAILOVER)" if planned else kind, "sent": sent, "admitted": len(times), "most_in_window": most_in_span(times, W),
           "promoted_after_s": killed.get("promoted", (None, None))[1],
           "followed_after_s": [round(seen.get(n, -1), 2) for n in (1, 2, 3)],
           "fail_open": fail_open, "slowest_ms": slowest, "errors": errors,
           # What the consumer on the killed master got each second, from 2 s before the kill.
           "admitted_per_s": [sum(1 for t in times if killed["wall"] + k <= t < killed["wall"] + k + 1)
                              for k in range(-2, 8)] if "wall" in killed else []}
    print(f"failover: {row}", flush=True)
    return row


class Gate(threading.Thread):
    """A TCP relay to Redis for one node that can be cut: while cut, it closes what it
    relays and refuses new connections (as a blocked port)."""

    def __init__(self, listen, target):
        super().__init__(daemon=True)
        import socket
        self.socket = socket
        self.listen, self.target = listen, target
        self.cut = threading.Event()
        self.conns = []
        self.lock = threading.Lock()

    def run(self):
        s = self.socket.socket()
        s.setsockopt(self.socket.SOL_SOCKET, self.socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.listen))
        s.listen(64)
        while True:
            c, _ = s.accept()
            if self.cut.is_set():
                c.close()
                continue
            try:
                u = self.socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                c.close()
                continue
            with self.lock:
                self.conns += [c, u]
            for a, b in ((c, u), (u, c)):
                threading.Thread(target=self.pipe, args=(a, b), daemon=True).start()

    def pipe(self, a, b):
        try:
            while not self.cut.is_set():
                data = a.recv(65536)
                if not data:
                    break
                b.sendall(data)
        except OSError:
            pass
        for x in (a, b):
            try:
                x.close()
            except OSError:
                pass

    def sever(self):
        self.cut.set()
        with self.lock:
            for x in self.conns:
                try:
                    x.shutdown(self.socket.SHUT_RDWR)
                except OSError:
                    pass
            self.conns = []

    def mend(self):
        self.cut.clear()


def cutoff(ctx, seconds=50.0, cut_at=5.0, cut_for=30.0):
    """The busiest node cut off from Redis for 30 s, then back."""
    topo = redis_topo.single(6393, ctx.tmp)
    gate = Gate(6394, 6393)
    gate.start()
    prefix = f"c{time.time_ns()}"
    nodes = Nodes(ctx, topo.redis, prefix, redis_for={1: "redis://127.0.0.1:6394/0"})
    try:
        runs = start_load(ctx, seconds)
        time.sleep(cut_at)
        t_cut = time.time()
        gate.sever()
        time.sleep(cut_for)
        gate.mend()
        t_back = time.time()
        outs = finish(runs)
        fail_open = metric(1, "tollgate_cluster_fail_open_admitted_total") or 0
        times = nodes.admitted("consumer-1")
    finally:
        gate.sever()
        nodes.stop()
        topo.stop()
    sent, slowest, errors = summary(outs)
    during = [t for t in times if t_cut <= t < t_back]
    after = [t for t in times if t >= t_back]
    row = {"sent": sent, "admitted": len(times), "most_in_window": most_in_span(times, W),
           "most_in_window_cut": most_in_span(during, W),
           "most_in_window_after": most_in_span(after, W),
           "cut_node_fail_open": fail_open, "slowest_ms": slowest, "errors": errors}
    print(f"cutoff: {row}", flush=True)
    return row


def one60(ctx, runs=2):
    """1 per 30 s driven from three nodes for 60 s from a random start."""
    rows = []
    for r in range(runs):
        topo = redis_topo.single(6395, ctx.tmp)
        prefix = f"o{time.time_ns()}"
        nodes = Nodes(ctx, topo.redis, prefix)
        try:
            time.sleep(random.uniform(0, 3))
            finish(start_load(ctx, 60.0, "c2", [(1, 10), (2, 10), (3, 10)], connections=4))
            times = nodes.admitted("consumer-2")
        finally:
            nodes.stop()
            topo.stop()
        gaps = [round(b - a, 2) for a, b in zip(times, times[1:])]
        row = {"run": r + 1, "admitted": len(times), "gaps_s": gaps, "most_in_30s": most_in_span(times, 30.0)}
        rows.append(row)
        print(f"one60: {row}", flush=True)
    return rows
