#!/usr/bin/env python3
"""Instructions and simulated cache misses per request with a million consumers, under
callgrind: a count that the machine's noise does not move, beside bench/scale.py's timings.

    python3 bench/scale_misses.py BIN [BIN ...] [--consumers 1000000] [--seconds 10]

For each build, and for each arm of bench/scale.py (keys drawn uniformly over all consumers,
or the first key with the same draw), starts the build on scale.py's consumers file under
`valgrind --tool=callgrind --cache-sim=yes` (a 64 KiB L1 and a 32 MiB last-level cache, as
this machine's), warms it for 3 s, then counts only while `wrk` runs for `--seconds`
(`callgrind_control -i on/off`). Threads are counted apart: the request-serving threads'
(those that ran hyper) totals are divided by the requests `wrk` made; the other threads
(mainly the limit sweeper, every 10 s) are reported on their own, since at valgrind's
speed the sweeper's scan weighs about thirty times more per request than at full speed.
The simulated caches have no prefetcher and no TLB.

Prints one JSON object. Needs valgrind and wrk; loopback only; every loop is bounded.
"""

import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scale  # noqa: E402
import seed  # noqa: E402


def totals(path):
    """Event names and totals of one callgrind output file, and whether it served requests."""
    events, tot, serving = [], None, False
    with open(path) as f:
        for line in f:
            if line.startswith("events:"):
                events = line.split()[1:]
            elif line.startswith("totals:"):
                tot = [int(x) for x in line.split()[1:]]
            elif line.startswith(("fn=", "cfn=")) and "hyper::proto" in line:
                serving = True
    return dict(zip(events, tot or [])), serving


def measure(binary, cfg, script, seconds, tmp):
    out = Path(tmp) / f"callgrind-{os.getpid()}.out"
    for f in glob.glob(f"{out}*"):
        os.remove(f)
    proc = subprocess.Popen(
        ["taskset", "-c", seed.GW_CPU, "valgrind", "--tool=callgrind", "--instr-atstart=no",
         "--cache-sim=yes", "--D1=65536,8,64", "--LL=33554432,16,64", "--separate-threads=yes",
         "--compress-strings=no", f"--callgrind-out-file={out}", str(binary), "run",
         "--config", str(cfg)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ, RUST_LOG="warn"))
    try:
        scale.wait_port(seed.GATEWAY, proc, timeout=600)
        scale.wrk(script, 3)
        subprocess.run(["callgrind_control", "-i", "on", str(proc.pid)], capture_output=True, check=True)
        reqs, _ = scale.wrk(script, seconds)
        subprocess.run(["callgrind_control", "-i", "off", str(proc.pid)], capture_output=True, check=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=300)
        seed.wait_port_free(seed.GATEWAY)
    work, other = {}, {}
    for f in glob.glob(f"{out}*"):
        t, serving = totals(f)
        dst = work if serving else other
        for k, v in t.items():
            dst[k] = dst.get(k, 0) + v
        os.remove(f)
    per = lambda d: {k: round(v / reqs, 1) for k, v in d.items()}  # noqa: E731
    return {"requests": reqs, "per_request": per(work), "other_threads_per_request": per(other)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("builds", nargs="+")
    ap.add_argument("--consumers", type=int, default=1_000_000)
    ap.add_argument("--seconds", type=int, default=10)
    args = ap.parse_args()
    for tool in ("valgrind", "callgrind_control", "wrk", "taskset"):
        if not shutil.which(tool):
            scale.die(f"needs {tool}")
    backend = scale.start_backend()
    out = {"consumers": args.consumers}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            scale.generate(args.consumers, tmp)
            cfg = scale.tollgate_config(tmp, Path(tmp) / "consumers.jsonl")
            scripts = scale.wrk_scripts(tmp)
            for b in args.builds:
                for kind, script in scripts.items():
                    r = measure(b, cfg, script, args.seconds, tmp)
                    out.setdefault(b, {})[kind] = r
                    print(f"{b} {kind}: {r}", file=sys.stderr)
    finally:
        scale.stop(backend)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    sys.exit(main())
