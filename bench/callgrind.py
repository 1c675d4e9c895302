#!/usr/bin/env python3
"""Instructions per request, user space only, for tollgate and nginx side by side.

    python3 bench/callgrind.py [--systems tollgate,nginx] [--scenarios 1,6] [--top 15]
                               [--tollgate-config FILE] [--cache-sim]

Each system serves a seed scenario under `valgrind --tool=callgrind` (pinned like
bench/seed.py), twice: 2,000 requests, then 22,000 (`tollgate bench -c 20`). The difference
divided by 20,000 is the steady cost of one request, start-up and shutdown cancelled out.
Prints, per system and scenario, instructions per request and the functions that cost the
most (self cost, per request, from the larger run minus the smaller). Counts are repeatable
whatever else the machine does; they leave out the kernel. `--tollgate-config` runs tollgate
on another file (e.g. bench/scenario-1-access-log.yaml) with the scenario's request.
`--cache-sim` has callgrind simulate the caches and prints, per request, the instruction
and data references that missed the first level (I1, D1) and the last level (LL): fewer
instructions per cycle show there when the instruction counts are level.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import seed
from procs import die, stop, wait_port

ROOT = Path(__file__).resolve().parent.parent
SMALL, LARGE = 2_000, 22_000


def run_once(system, scenario, n, out, tmp, config=None, sim=False):
    if system == "tollgate":
        config = config or str(ROOT / f"examples/seed/scenario-{scenario}.yaml")
        cmd = [str(seed.BIN), "run", "--config", config]
    elif system == "nginx":
        prefix = Path(tmp) / f"nginx-{scenario}"
        prefix.mkdir(exist_ok=True)
        # One process, no master: the worker's own instructions, and SIGTERM ends it.
        cmd = ["nginx", "-p", str(prefix), "-c", str(ROOT / f"bench/peers/nginx/scenario-{scenario}.conf"),
               "-g", "master_process off;"]
    else:
        die(f"unknown system {system}")
    env = dict(os.environ, RUST_LOG="warn")
    proc = subprocess.Popen(
        ["taskset", "-c", seed.GW_CPU, "valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
        + (["--cache-sim=yes"] if sim else []) + cmd,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        wait_port(seed.GATEWAY, proc, timeout=120)
        path, expect, _ = seed.SCENARIOS[scenario]
        r = subprocess.run(["taskset", "-c", seed.LOAD_CPU, str(seed.BIN), "bench", "--json", "-c", "20",
                            "-n", str(n), "--expect", expect, f"http://{seed.GATEWAY}{path}"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            die(f"bench failed: {r.stderr}")
    finally:
        stop(proc, timeout=60)
        seed.wait_port_free(seed.GATEWAY)
    return (totals(out) if sim else None), functions(out), (functions(out, "I1mr") if sim else None)


def totals(out):
    """Every event's program total (Ir, I1mr, ILmr, Dr, D1mr, DLmr, Dw, D1mw, DLmw)."""
    text = subprocess.run(["callgrind_annotate", "--auto=no", "--threshold=100", out],
                          capture_output=True, text=True).stdout
    events = None
    for line in text.splitlines():
        if line.startswith("Events shown:"):
            events = line.split(":", 1)[1].split()
        if "PROGRAM TOTALS" in line and events:
            values = [int(v.replace(",", "")) for v in re.findall(r"([\d,]+)\s+\(", line)]
            return dict(zip(events, values))
    die(f"no event totals in {out}")


def functions(out, event="Ir"):
    """One event's total and self cost by function, from callgrind_annotate."""
    text = subprocess.run(["callgrind_annotate", "--auto=no", "--threshold=100", f"--show={event}",
                           f"--sort={event}", out], capture_output=True, text=True).stdout
    total = None
    by_fn = {}
    for line in text.splitlines():
        m = re.match(r"\s*([\d,]+)\s+\(.*?\)\s+PROGRAM TOTALS", line)
        if m:
            total = int(m.group(1).replace(",", ""))
            continue
        m = re.match(r"\s*([\d,]+)\s+\(\s*[\d.]+%\)\s+(.*)$", line)
        if m and total is not None:
            name = re.sub(r"\s+\[.*\]$", "", m.group(2))
            name = name.split(":", 1)[1] if re.match(r"^[^ ]*:", name) and "::" not in name.split(":", 1)[0] else name
            by_fn[name] = by_fn.get(name, 0) + int(m.group(1).replace(",", ""))
    if total is None:
        die(f"no totals in {out}")
    return total, by_fn


def category(name):
    """A function's library: the Rust crate, jemalloc, libc's mem*, glibc malloc, nginx."""
    n = name.lstrip("<")
    if n.startswith("_rjem"):
        return "jemalloc"
    if n.startswith("__mem"):
        return "libc mem*"
    if n.startswith(("_int_", "malloc", "free", "unlink_chunk", "cfree")):
        return "glibc malloc"
    if n.startswith("ngx_"):
        return "nginx"
    if n.startswith("0x"):
        return "unresolved"
    if "::" in n:
        return n.split("::", 1)[0]
    return "other"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--systems", default="tollgate,nginx")
    ap.add_argument("--scenarios", default="1,6")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--tollgate-config", help="run tollgate on this file instead of the scenario's")
    ap.add_argument("--cache-sim", action="store_true", help="count cache misses per request too")
    args = ap.parse_args()
    backend = subprocess.Popen(["taskset", "-c", seed.LOAD_CPU, str(seed.BIN), "echo", "--listen", seed.BACKEND],
                               stderr=subprocess.DEVNULL)
    wait_port(seed.BACKEND, backend)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for s in args.scenarios.split(","):
                for system in args.systems.split(","):
                    small_sim, small, small_i1 = run_once(system, s, SMALL, f"{tmp}/{system}-{s}-small.out", tmp,
                                                args.tollgate_config, args.cache_sim)
                    large_sim, large, large_i1 = run_once(system, s, LARGE, f"{tmp}/{system}-{s}-large.out", tmp,
                                                args.tollgate_config, args.cache_sim)
                    per = (large[0] - small[0]) / (LARGE - SMALL)
                    print(f"\n## {system}, scenario {s}: {per:,.0f} instructions per request")
                    if args.cache_sim:
                        print("misses per request: " + ", ".join(
                            f"{e} {(large_sim[e] - small_sim[e]) / (LARGE - SMALL):,.1f}"
                            for e in large_sim if e not in ("Ir", "Dr", "Dw")))
                        print("data references per request: " + ", ".join(
                            f"{e} {(large_sim[e] - small_sim[e]) / (LARGE - SMALL):,.0f}"
                            for e in ("Dr", "Dw") if e in large_sim))
                        i1 = {f: (large_i1[1].get(f, 0) - small_i1[1].get(f, 0)) / (LARGE - SMALL)
                              for f in set(large_i1[1]) | set(small_i1[1])}
                        print("first-level instruction misses per request, by function:")
                        for f, v in sorted(i1.items(), key=lambda kv: -kv[1])[:args.top]:
                            print(f"{v:8,.1f}  {f[:150]}")
                    diffs = {f: (large[1].get(f, 0) - small[1].get(f, 0)) / (LARGE - SMALL)
                             for f in set(large[1]) | set(small[1])}
                    cats = {}
                    for f, v in diffs.items():
                        cats[category(f)] = cats.get(category(f), 0) + v
                    print("by library: " + ", ".join(f"{c} {v:,.0f}" for c, v in
                                                     sorted(cats.items(), key=lambda kv: -kv[1]) if v >= 50))
                    for f, v in sorted(diffs.items(), key=lambda kv: -kv[1])[:args.top]:
                        print(f"{v:8,.0f}  {f[:150]}")
                    sys.stdout.flush()
    finally:
        stop(backend)


if __name__ == "__main__":
    main()
