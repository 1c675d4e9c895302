"""Redis topologies for the cluster benchmark, as real processes on loopback: one server,
a master with replicas watched by three sentinels, and a Redis Cluster of three masters
with a replica each. Every process is stopped by its pid."""

import subprocess
import time

import procs
from procs import die, wait_port


def _server(port, cpu, workdir, *extra):
    args = ["taskset", "-c", cpu, "redis-server", "--port", str(port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--protected-mode", "no", "--dir", str(workdir),
            "--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0", *extra]
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(f"127.0.0.1:{port}", p)
    return p


def cli(port, *args):
    """`redis-cli -p PORT ARGS…`, its output as text ('' if the server is gone)."""
    r = subprocess.run(["redis-cli", "-p", str(port), *map(str, args)], capture_output=True, text=True, timeout=5)
    return r.stdout.strip()


def role(port):
    out = cli(port, "ROLE")
    return out.splitlines()[0] if out else ""


def until(what, ok, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ok():
            return
        time.sleep(0.05)
    die(f"{what}: not within {timeout}s")


class Topology:
    """Processes of one topology; `redis` is the YAML of `cluster.redis` for the nodes."""

    def __init__(self):
        self.procs = {}
        self.redis = ""

    def kill(self, port):
        """SIGKILL, like a crash."""
        p = self.procs.pop(port)
        p.kill()
        p.wait()

    def stop(self):
        for p in self.procs.values():
            procs.stop(p, timeout=5)
        self.procs = {}


def single(port, workdir, cpu="0"):
    t = Topology()
    t.procs[port] = _server(port, cpu, workdir)
    t.redis = f"redis://127.0.0.1:{port}/0"
    return t


def sentinel(base, workdir, cpu="0"):
    """A master on `base`, replicas on base+1 and base+2, sentinels on base+10..12 (master
    name `tg`, down after 1 s)."""
    t = Topology()
    t.master = base
    workdir = _fresh(workdir, "sentinel")
    t.procs[base] = _server(base, cpu, workdir)
    for r in (base + 1, base + 2):
        t.procs[r] = _server(r, cpu, workdir, "--replicaof", "127.0.0.1", str(base))
        until("a replica in sync", lambda r=r: "master_link_status:up" in cli(r, "INFO", "replication"))
    for s in (base + 10, base + 11, base + 12):
        conf = workdir / f"sentinel-{s}.conf"
        conf.write_text(f"port {s}\nbind 127.0.0.1\nsentinel monitor tg 127.0.0.1 {base} 2\n"
                        "sentinel down-after-milliseconds tg 1000\nsentinel failover-timeout tg 5000\n"
                        "sentinel parallel-syncs tg 1\n")
        p = subprocess.Popen(["taskset", "-c", cpu, "redis-server", str(conf), "--sentinel"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(f"127.0.0.1:{s}", p)
        t.procs[s] = p
    t.redis = ("{sentinels: [" + ", ".join(f'"127.0.0.1:{s}"' for s in (base + 10, base + 11, base + 12))
               + "], master_name: tg}")
    return t


def _fresh(workdir, name):
    """A folder of its own for one topology's files (cluster and sentinel state)."""
    d = workdir / f"{name}-{time.time_ns()}"
    d.mkdir()
    return d


def cluster(base, workdir, cpu="0"):
    """Three masters and three replicas on base..base+5 (bus ports base+100..), node
    timeout 1 s."""
    t = Topology()
    workdir = _fresh(workdir, "cluster")
    ports = [base + i for i in range(6)]
    try:
        _cluster(t, ports, workdir, cpu)
    except BaseException:
        t.stop()
        raise
    return t


def _cluster(t, ports, workdir, cpu):
    for p in ports:
        t.procs[p] = _server(p, cpu, workdir, "--cluster-enabled", "yes", "--cluster-port", str(p + 100),
                             "--cluster-config-file", f"nodes-{p}.conf", "--cluster-node-timeout", "1000")
    out = subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports],
                          "--cluster-replicas", "1", "--cluster-yes"], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        die(f"redis-cli --cluster create failed: {out.stdout[-500:]}")
    until("the cluster ok", lambda: all("cluster_state:ok" in cli(p, "CLUSTER", "INFO") for p in ports))
    for p in ports:
        if role(p) == "slave":
            until("a replica in sync", lambda p=p: "master_link_status:up" in cli(p, "INFO", "replication"))
    t.ports = ports
    t.redis = "{cluster_nodes: [" + ", ".join(f'"127.0.0.1:{p}"' for p in ports[:3]) + "]}"


def cluster_owner(t, key):
    """The port of the live master that serves `key`'s slot."""
    slot = int(cli(t.ports[0] if t.ports[0] in t.procs else next(iter(t.procs)), "CLUSTER", "KEYSLOT", key))
    for p in t.procs:
        if role(p) != "master":
            continue
        me = cli(p, "CLUSTER", "MYID")
        for line in cli(p, "CLUSTER", "NODES").splitlines():
            parts = line.split()
            if parts and parts[0] == me:
                for r in parts[8:]:
                    lo, _, hi = r.partition("-")
                    if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                        return p
    return None
