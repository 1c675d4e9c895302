#!/usr/bin/env python3
"""CPU per request split into user and system time, tollgate beside its peers.

    python3 bench/split.py [--systems tollgate,nginx] [--scenarios 1,6] [--rounds 3]
                           [--duration 5]

Runs each seed scenario on each system with the pinning of bench/seed.py (gateway on CPU
1; echo backend and load generator on CPU 0), interleaved, and prints the medians of user
and system µs per request (`/proc/PID/stat` of the gateway's processes / requests served)
and requests/s. The system share is the kernel's work for the gateway's reads and writes
and what runs in their context (loopback delivery to the peer, waking it); the user share
is the gateway's own code. Writes nothing.
"""

import argparse
import statistics
import subprocess
import tempfile

import seed
from procs import stop, wait_port


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--systems", default="tollgate,nginx")
    ap.add_argument("--scenarios", default="1,6")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=int, default=5)
    args = ap.parse_args()
    seed.check_tools(args.systems.split(","))
    backend = subprocess.Popen(["taskset", "-c", seed.LOAD_CPU, str(seed.BIN), "echo", "--listen", seed.BACKEND],
                               stderr=subprocess.DEVNULL)
    wait_port(seed.BACKEND, backend)
    results = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for _ in range(args.rounds):
                for sc in args.scenarios.split(","):
                    for system in args.systems.split(","):
                        path, expect, _ = seed.SCENARIOS[sc]
                        proc = seed.start_gateway(system, sc, tmp)
                        try:
                            url = f"http://{seed.GATEWAY}{path}"
                            seed.bench(url, expect, 1, 50)
                            pids = seed.process_tree(proc.pid)
                            u0, s0 = seed.cpu_split(pids)
                            out = seed.bench(url, expect, args.duration, 50)
                            u1, s1 = seed.cpu_split(pids)
                        finally:
                            stop(proc)
                            seed.wait_port_free(seed.GATEWAY)
                        n = max(out["requests"], 1)
                        results.setdefault((sc, system), []).append(
                            ((u1 - u0) * 1e6 / n, (s1 - s0) * 1e6 / n, out["requests_per_second"]))
    finally:
        stop(backend)
    print("| scenario | system | user µs/req | system µs/req | CPU µs/req | requests/s |")
    print("|---|---|---|---|---|---|")
    for (sc, system), runs in sorted(results.items()):
        u, s, r = (statistics.median(x[i] for x in runs) for i in range(3))
        print(f"| {sc} | {system} | {u:.2f} | {s:.2f} | {u + s:.2f} | {r:,.0f} |")


if __name__ == "__main__":
    main()
