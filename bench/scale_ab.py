#!/usr/bin/env python3
"""Two or more tollgate builds side by side on bench/scale.py's uniform-against-hot CPU step:
what a change does to the extra cost of a cold consumer, without the peer.

    python3 bench/scale_ab.py BIN [BIN ...] [--rounds 6] [--duration 3] [--consumers 1000000]

Each round starts every build once on scale.py's million consumers (the order of builds,
and of uniform and hot within a build, alternating from round to round) and measures the
gateway's CPU µs per request with keys drawn uniformly and with one hot key, as scale.py's
step 3 does. Prints each round as it goes, then per build the medians, their ratio, the
median of the rounds' ratios and the median extra µs of a cold consumer, as one JSON object.
Loopback only; every loop is bounded by --rounds.
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scale  # noqa: E402
import seed  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("builds", nargs="+")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--duration", type=int, default=3)
    ap.add_argument("--consumers", type=int, default=1_000_000)
    args = ap.parse_args()
    backend = scale.start_backend()
    kinds = ["uniform", "hot"]
    runs = {(b, k): [] for b in args.builds for k in kinds}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            scale.generate(args.consumers, tmp)
            cfg = scale.tollgate_config(tmp, Path(tmp) / "consumers.jsonl")
            scripts = scale.wrk_scripts(tmp)
            for r in range(args.rounds):
                flip = r % 2 == 1
                for b in (args.builds[::-1] if flip else args.builds):
                    proc, _ = scale.start("tollgate", cfg, tmp, binary=b)
                    try:
                        for k in (kinds[::-1] if flip else kinds):
                            x = scale.cpu_run(proc, scripts[k], args)
                            runs[(b, k)].append(x)
                            print(f"round {r + 1} {b} {k}: {x['cpu_us']:.2f} µs, "
                                  f"{x['rps']:.0f} req/s, busy {x['busy']:.2f}", file=sys.stderr, flush=True)
                    finally:
                        scale.stop(proc)
                        seed.wait_port_free(seed.GATEWAY)
    finally:
        scale.stop(backend)
    out = {"consumers": args.consumers, "rounds": args.rounds, "duration_s": args.duration}
    for b in args.builds:
        u, h = ([x["cpu_us"] for x in runs[(b, k)]] for k in kinds)
        out[b] = {
            "cpu_us_uniform": round(statistics.median(u), 2),
            "cpu_us_hot": round(statistics.median(h), 2),
            "uniform_over_hot": round(statistics.median(u) / statistics.median(h), 3),
            "uniform_over_hot_median_of_rounds":
                round(statistics.median(a / c for a, c in zip(u, h)), 3),
            "extra_us": round(statistics.median(a - c for a, c in zip(u, h)), 2),
        }
        for k in kinds:
            out[b][f"busy_{k}"] = round(statistics.median(x["busy"] for x in runs[(b, k)]), 3)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    sys.exit(main())
