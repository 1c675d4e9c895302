#!/usr/bin/env python3
"""Load time and memory per consumer of two tollgate builds on bench/scale.py's million
consumers, interleaved: each build started on the small config and then on the big one,
its load time (until the listener answers) and settled PSS; medians of the rounds.

    python3 bench/scale_load.py OLD_BINARY NEW_BINARY [--rounds 3] [--consumers N] [--admin]

`--admin` adds an `admin:` section (the admin API may then give keys, so the config's
plain keys are indexed by digest).
"""
import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scale  # noqa: E402
import seed  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--consumers", type=int, default=1_000_000)
    ap.add_argument("--admin", action="store_true")
    args = ap.parse_args()
    n = args.consumers
    builds = {"old": Path(args.old), "new": Path(args.new)}
    res = {k: [] for k in builds}
    backend = scale.start_backend()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            scale.generate(n, tmp)
            big = scale.tollgate_config(tmp, Path(tmp) / "consumers.jsonl")
            small = scale.tollgate_config(tmp, None)
            if args.admin:
                (Path(tmp) / "admin.token").write_text("bench-token\n")
                for cfg in (big, small):
                    text = Path(cfg).read_text()
                    Path(cfg).write_text(text + f"admin: {{address: \"127.0.0.1:19947\", "
                                         f"token_file: {tmp}/admin.token}}\n")
            for rnd in range(args.rounds):
                for name in (("old", "new") if rnd % 2 == 0 else ("new", "old")):
                    b = builds[name]
                    p, _ = scale.start("tollgate", small, tmp, binary=b)
                    base = scale.settled_pss(p.pid)
                    scale.stop(p)
                    seed.wait_port_free(scale.GATEWAY)
                    p, load_s = scale.start("tollgate", big, tmp, binary=b)
                    pss = scale.settled_pss(p.pid)
                    scale.stop(p)
                    seed.wait_port_free(scale.GATEWAY)
                    r = (round(load_s, 2), round((pss - base) * 1024 / n))
                    res[name].append(r)
                    print(f"round {rnd + 1} {name}: load {r[0]} s, {r[1]} B/consumer", file=sys.stderr)
    finally:
        scale.stop(backend)
    for k, v in res.items():
        print(f"{k}: load median {statistics.median(x[0] for x in v)} s, "
              f"{statistics.median(x[1] for x in v)} B/consumer")


if __name__ == "__main__":
    sys.exit(main())
