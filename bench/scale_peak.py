#!/usr/bin/env python3
"""Peak memory of loading and reloading bench/scale.py's million consumers: what a host
must have free beyond the steady resident set.

    python3 bench/scale_peak.py [--binary target/release/tollgate] [--consumers 1000000]
                                [--rounds 3] [--reloads 3]

Each round starts the gateway on the N consumers, reads its resident set once settled and
its high-water mark (`VmHWM`: the peak of the load), then reloads a changed consumers file
(one consumer added, SIGHUP) `--reloads` times, reading the resident set once each reload
is done and settled and the high-water mark after all of them. The same for 3 consumers
gives the baseline. Medians of the rounds, in MiB. Loopback only; every wait is bounded.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scale  # noqa: E402
import seed  # noqa: E402
from procs import die, stop, wait_port  # noqa: E402


def status_kib(pid, field):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    die(f"no {field} for pid {pid}")


def wait_for(log, text, count, timeout=120.0):
    """Waits until `text` is in the log file `count` times."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if Path(log).read_text(errors="replace").count(text) >= count:
            return
        time.sleep(0.1)
    die(f"{text!r} not logged {count} times within {timeout} s: {Path(log).read_text()[-2000:]}")


def one(binary, cfg, tmp, consumers, reloads):
    """(settled RSS, load peak, [RSS after each reload], peak after the reloads), KiB."""
    log = Path(tmp) / "gateway.log"
    with open(log, "w") as err:
        p = subprocess.Popen(["taskset", "-c", seed.GW_CPU, str(binary), "run", "--config", str(cfg)],
                             stdout=subprocess.DEVNULL, stderr=err,
                             env=dict(os.environ, RUST_LOG="info", NO_COLOR="1"))
    try:
        wait_port(seed.GATEWAY, p, timeout=120)
        scale.settled_pss(p.pid)  # waits until memory stops moving
        rss = status_kib(p.pid, "VmRSS")
        load_peak = status_kib(p.pid, "VmHWM")
        after = []
        for i in range(reloads):
            if consumers:
                with open(consumers, "a") as f:
                    f.write(f'{{"name":"extra{i}-{time.monotonic_ns()}","plan":"basic",'
                            f'"keys":["extra-key-{i}-{time.monotonic_ns()}"]}}\n')
            else:
                cfg.write_text(cfg.read_text() + f"# reload {i}\n")
            p.send_signal(signal.SIGHUP)
            wait_for(log, "config reloaded", i + 1)
            scale.settled_pss(p.pid)
            after.append(status_kib(p.pid, "VmRSS"))
        peak = status_kib(p.pid, "VmHWM")
        return rss, load_peak, after, peak
    finally:
        stop(p)
        seed.wait_port_free(seed.GATEWAY)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default=str(seed.BIN))
    ap.add_argument("--consumers", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reloads", type=int, default=3)
    args = ap.parse_args()
    n = args.consumers
    backend = scale.start_backend()
    rows = {"small": [], "big": []}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            scale.generate(n, tmp)
            consumers = Path(tmp) / "consumers.jsonl"
            original = consumers.read_bytes()
            big = scale.tollgate_config(tmp, consumers)
            small = scale.tollgate_config(tmp, None)
            for rnd in range(args.rounds):
                for name, cfg in (("small", small), ("big", big)):
                    consumers.write_bytes(original)
                    r = one(args.binary, cfg, tmp, consumers if name == "big" else None,
                            args.reloads)
                    rows[name].append(r)
                    print(f"round {rnd + 1} {name}: RSS {r[0]} KiB, load peak {r[1]} KiB, "
                          f"after reloads {r[2]} KiB, peak {r[3]} KiB", file=sys.stderr)
    finally:
        stop(backend)

    def med(name, i):
        return statistics.median(r[i] for r in rows[name]) / 1024

    out = {}
    for name in rows:
        out[name] = {
            "rss_mib": round(med(name, 0), 1),
            "load_peak_mib": round(med(name, 1), 1),
            "rss_after_last_reload_mib": round(
                statistics.median(r[2][-1] for r in rows[name]) / 1024, 1) if args.reloads else None,
            "peak_with_reloads_mib": round(med(name, 3), 1),
        }
    b, s = out["big"], out["small"]
    out["consumers"] = n
    out["reloads"] = args.reloads
    out["peak_over_steady"] = {
        "load": round((b["load_peak_mib"] - s["load_peak_mib"]) / (b["rss_mib"] - s["rss_mib"]), 2),
        "reload": round((b["peak_with_reloads_mib"] - s["peak_with_reloads_mib"])
                        / (b["rss_mib"] - s["rss_mib"]), 2),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    sys.exit(main())
