#!/usr/bin/env python3
"""Two builds of tollgate side by side: CPU per request and requests/s, interleaved.

    python3 bench/ab.py A_BINARY B_BINARY [--rounds 5] [--scenarios 1,6] [--duration 5]
    python3 bench/ab.py BIN BIN --a-config X.yaml --b-config Y.yaml --scenarios 1

For judging a change that touches every request (an allocator, a buffer size), or the price
of a feature (the same binary on two configs, each serving the scenario's URL): each round
runs every scenario on A then B (the order alternates between rounds), with the pinning of
bench/seed.py (gateway on CPU 1; echo backend and load generator on CPU 0). The echo
backend and the load generator are target/release/tollgate for both, so only the gateway
differs. Prints the medians (CPU, its user part, requests/s) and the B/A ratios; writes
nothing.
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import seed
from procs import die, stop, wait_port


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--scenarios", default="1,6")
    ap.add_argument("--duration", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--connections", type=int, default=50)
    ap.add_argument("--a-config", help="config for A instead of the scenario's")
    ap.add_argument("--b-config", help="config for B instead of the scenario's")
    args = ap.parse_args()
    tools = seed.BIN
    builds = {"A": Path(args.a).resolve(), "B": Path(args.b).resolve()}
    for p in builds.values():
        if not p.exists():
            die(f"no such binary: {p}")
    scenarios = args.scenarios.split(",")
    results = {(s, k): [] for s in scenarios for k in builds}
    backend = subprocess.Popen(["taskset", "-c", seed.LOAD_CPU, str(tools), "echo", "--listen", seed.BACKEND],
                               stderr=subprocess.DEVNULL)
    wait_port(seed.BACKEND, backend)
    original_start = seed.start_gateway

    configs = {"A": args.a_config, "B": args.b_config}

    def start_with(binary, config):
        def start(system, scenario, tmp):
            if config:
                proc = subprocess.Popen(["taskset", "-c", seed.GW_CPU, str(binary), "run", "--config", config],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                wait_port(seed.GATEWAY, proc)
                return proc
            seed.BIN = binary
            try:
                return original_start(system, scenario, tmp)
            finally:
                seed.BIN = tools
        return start

    try:
        with tempfile.TemporaryDirectory() as tmp:
            for rnd in range(args.rounds):
                order = ["A", "B"] if rnd % 2 == 0 else ["B", "A"]
                for s in scenarios:
                    for k in order:
                        seed.start_gateway = start_with(builds[k], configs[k])
                        r = seed.one_run("tollgate", s, args, tmp)
                        results[(s, k)].append(r)
                        print(f"round {rnd + 1} scenario {s} {k}: {r['rps']:.0f} req/s, "
                              f"{r['cpu_us']:.2f} µs CPU/req ({r['user_us']:.2f} user)", file=sys.stderr)
    finally:
        stop(backend)
    print(f"A = {builds['A']} {configs['A'] or ''}\nB = {builds['B']} {configs['B'] or ''}\n"
          f"{args.rounds} interleaved rounds, medians\n")
    print("| scenario | A µs/req | B µs/req | B/A CPU | A user µs | B user µs | B/A user "
          "| A req/s | B req/s | B/A req/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for s in scenarios:
        med = {k: [statistics.median(r[f] for r in results[(s, k)]) for f in ("cpu_us", "user_us", "rps")]
               for k in builds}
        a, b = med["A"], med["B"]
        print(f"| {s} | {a[0]:.2f} | {b[0]:.2f} | {b[0] / a[0]:.3f} "
              f"| {a[1]:.2f} | {b[1]:.2f} | {b[1] / a[1]:.3f} "
              f"| {a[2]:.0f} | {b[2]:.0f} | {b[2] / a[2]:.3f} |")


if __name__ == "__main__":
    sys.exit(main())
