#!/usr/bin/env python3
"""Precise clock reads per request, and what a read costs on this machine.

    python3 bench/clocks.py [BINARY ...] [--scenarios 1,6] [--requests 20000]

For each build (default target/release/tollgate) and seed scenario, counts the gateway's
calls to libc's `clock_gettime` for a precise clock (those `Instant::now()` and
`SystemTime::now()` make; the reads of `CLOCK_*_COARSE` are filtered out by their clock id)
with a perf uprobe while `tollgate bench -c 20` sends the scenario's request, and prints
the calls per request. Then times `CLOCK_MONOTONIC` against `CLOCK_MONOTONIC_COARSE` with
a small C loop (10 million reads each). Needs root (uprobes), perf and cc. The counts are
exact whatever else the machine does; the nanoseconds are this machine's. Writes nothing.
"""

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

import seed
from procs import die, stop, wait_port

LIBC = "/lib/x86_64-linux-gnu/libc.so.6"
EVENT = "probe_libc:clock_gettime"
# CLOCK_REALTIME_COARSE is 5 and CLOCK_MONOTONIC_COARSE 6 (linux/time.h).
PRECISE = "clk != 5 && clk != 6"

LOOP = r"""
#include <stdio.h>
#include <time.h>
static double per_read(clockid_t id) {
    struct timespec t, a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (int i = 0; i < 10000000; i++) clock_gettime(id, &t);
    clock_gettime(CLOCK_MONOTONIC, &b);
    return ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / 1e7;
}
int main(void) {
    struct timespec r;
    clock_getres(CLOCK_MONOTONIC_COARSE, &r);
    printf("CLOCK_MONOTONIC %.1f ns a read; CLOCK_MONOTONIC_COARSE %.1f ns (resolution %ld ms)\n",
           per_read(CLOCK_MONOTONIC), per_read(CLOCK_MONOTONIC_COARSE), r.tv_nsec / 1000000);
    return 0;
}
"""


def count(binary, scenario, requests):
    path, expect, _ = seed.SCENARIOS[scenario]
    url = "http://" + seed.GATEWAY + path
    tools = seed.BIN
    backend = subprocess.Popen([str(tools), "echo", "--listen", seed.BACKEND],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    gw = None
    try:
        wait_port(seed.BACKEND, backend)
        # seed.py's gateway, pinned as in every bench, on the build under test.
        seed.BIN = Path(binary)
        try:
            with tempfile.TemporaryDirectory() as tmp:
                gw = seed.start_gateway("tollgate", scenario, tmp)
        finally:
            seed.BIN = tools
        load = [str(tools), "bench", url, "--expect", expect, "-c", "20", "-n"]
        subprocess.run(load + ["2000"], check=True, capture_output=True)
        with tempfile.NamedTemporaryFile("r", suffix=".csv") as out:
            stat = subprocess.Popen(["perf", "stat", "-x,", "-e", EVENT, "--filter", PRECISE, "-p", str(gw.pid),
                                     "-o", out.name])
            time.sleep(0.3)
            subprocess.run(load + [str(requests)], check=True, capture_output=True)
            stat.send_signal(2)
            stat.wait(timeout=30)
            line = next((l for l in Path(out.name).read_text().splitlines() if EVENT in l), "")
        calls = int(line.split(",")[0])
        return calls / requests
    finally:
        if gw is not None:
            stop(gw)
        stop(backend)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binaries", nargs="*", default=[str(seed.BIN)])
    ap.add_argument("--scenarios", default="1,6")
    ap.add_argument("--requests", type=int, default=20000)
    args = ap.parse_args()
    added = subprocess.run(["perf", "probe", "-x", LIBC, "--add", "clock_gettime clk=%di:s32"],
                           capture_output=True, text=True)
    if added.returncode != 0 and "exists" not in added.stderr:
        die(f"could not add the uprobe (root and perf needed): {added.stderr.strip()}")
    try:
        for b in args.binaries:
            for s in args.scenarios.split(","):
                print(f"{b} scenario {s}: {count(b, s, args.requests):.2f} precise reads a request",
                      flush=True)
    finally:
        subprocess.run(["perf", "probe", "-d", EVENT], capture_output=True)
    with tempfile.TemporaryDirectory() as d:
        src, exe = Path(d) / "loop.c", Path(d) / "loop"
        src.write_text(LOOP)
        subprocess.run(["cc", "-O2", str(src), "-o", str(exe)], check=True)
        print(subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout, end="")


if __name__ == "__main__":
    main()
