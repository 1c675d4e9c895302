#!/usr/bin/env python3
"""The io_uring spike against the same proxy on epoll, nginx and tollgate, interleaved.

    python3 bench/experiments/uring/run.py [--rounds 5] [--duration 5] [--scenarios 1,6]

Builds the spike (`cargo build --release` here), then per round runs each scenario on every
system in turn (the order rotates between rounds), pinned as bench/seed.py pins: the system
on CPU 1, the echo backend and `tollgate bench -c 50` on CPU 0. Prints medians of
requests/s and of user and system CPU µs per request, and each system's ratio to nginx.
Scenario 1 is a proxied request with a valid key, scenario 6 a 401 at the edge.
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

import seed  # noqa: E402
from procs import stop, wait_port  # noqa: E402

SPIKE = HERE / "target/release/uring-spike"
SYSTEMS = ["spike-tokio", "spike-monoio-epoll", "spike-monoio-uring", "spike-monoio-uring-defer", "nginx",
           "tollgate"]


def cpu_split(pids):
    """(user, system) CPU seconds of the processes."""
    user = system = 0
    for p in pids:
        try:
            f = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        user += int(f[11])
        system += int(f[12])
    return user / seed.CLK_TCK, system / seed.CLK_TCK


def start(system, scenario, tmp):
    if system.startswith("spike-"):
        proc = subprocess.Popen(["taskset", "-c", seed.GW_CPU, str(SPIKE), system[len("spike-"):],
                                 seed.GATEWAY, seed.BACKEND], stderr=subprocess.DEVNULL)
        wait_port(seed.GATEWAY, proc)
        return proc
    return seed.start_gateway(system, scenario, tmp)


def one(system, scenario, args, tmp):
    path, expect, _ = seed.SCENARIOS[scenario]
    proc = start(system, scenario, tmp)
    try:
        url = f"http://{seed.GATEWAY}{path}"
        seed.bench(url, expect, args.warmup, args.connections)
        pids = seed.process_tree(proc.pid)
        u0, s0 = cpu_split(pids)
        r = seed.bench(url, expect, args.duration, args.connections)
        u1, s1 = cpu_split(pids)
    finally:
        stop(proc)
        seed.wait_port_free(seed.GATEWAY)
    n = max(r["requests"], 1)
    return {"rps": r["requests_per_second"], "user": (u1 - u0) * 1e6 / n, "sys": (s1 - s0) * 1e6 / n,
            "failed": r["failed"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--duration", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--connections", type=int, default=50)
    ap.add_argument("--scenarios", default="1,6")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    args = ap.parse_args()
    subprocess.run(["cargo", "build", "--release", "-q"], cwd=HERE, check=True)
    systems = args.systems.split(",")
    scenarios = args.scenarios.split(",")
    res = {(s, k): [] for s in scenarios for k in systems}
    backend = subprocess.Popen(["taskset", "-c", seed.LOAD_CPU, str(seed.BIN), "echo", "--listen", seed.BACKEND],
                               stderr=subprocess.DEVNULL)
    wait_port(seed.BACKEND, backend)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for rnd in range(args.rounds):
                order = systems[rnd % len(systems):] + systems[:rnd % len(systems)]
                for s in scenarios:
                    for k in order:
                        r = one(k, s, args, tmp)
                        res[(s, k)].append(r)
                        print(f"round {rnd + 1} scenario {s} {k}: {r['rps']:.0f} req/s, "
                              f"{r['user']:.2f} + {r['sys']:.2f} µs CPU/req, {r['failed']} failed",
                              file=sys.stderr)
    finally:
        stop(backend)
    print(f"{args.rounds} interleaved rounds of {args.duration} s, {args.connections} connections, medians\n")
    for s in scenarios:
        med = {k: {m: statistics.median(r[m] for r in res[(s, k)]) for m in ("rps", "user", "sys")}
               for k in systems}
        base = med.get("nginx")
        print(f"scenario {s} ({seed.SCENARIOS[s][2]})\n")
        print("| system | requests/s | user µs/req | system µs/req | CPU µs/req | CPU ÷ nginx |")
        print("|---|---|---|---|---|---|")
        for k in systems:
            m = med[k]
            cpu = m["user"] + m["sys"]
            ratio = f"{cpu / (base['user'] + base['sys']):.2f}" if base else "–"
            print(f"| {k} | {m['rps']:,.0f} | {m['user']:.2f} | {m['sys']:.2f} | {cpu:.2f} | {ratio} |")
        print()


if __name__ == "__main__":
    main()
