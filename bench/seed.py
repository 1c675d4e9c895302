#!/usr/bin/env python3
"""The seed benchmark: the reference run and scenarios 1-6 against tollgate, nginx and HAProxy.

    python3 bench/seed.py [--rounds 3] [--duration 5] [--connections 50]

Installs nothing: it checks for nginx, haproxy and taskset and says how to get them.
Pinning: the gateway under test on CPU 1; the echo backend and the load generator on CPU 0,
the same for every system. Systems are interleaved (A B C, A B C, ...) in every scenario,
for every round. For each run it records requests/s, p50/p99, failures and the gateway's CPU
microseconds per request (user+sys of the gateway's processes from /proc / requests served).

Writes bench/results/seed-<time>.json, docs/benchmarks.md and docs/benchmarks-chart.svg.
"""

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from procs import die, stop, wait_port

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / "target" / "release" / "tollgate"
GW_CPU, LOAD_CPU = "1", "0"
BACKEND = "127.0.0.1:1337"
GATEWAY = "127.0.0.1:8080"
CLK_TCK = os.sysconf("SC_CLK_TCK")

SCENARIOS = {
    "reference": ("/test/?max-age=0&apikey=t1", "200", "straight at the backend"),
    "1": ("/test/?max-age=0&apikey=t1", "200", "auth + authz"),
    "2": ("/test/?max-age=0&apikey=t1", "200", "+ 1 limit"),
    "3": ("/test/?max-age=0&apikey=t1", "200", "+ 2 limits"),
    "4": ("/test/?max-age=0&apikey=t1", "200", "+ method filter"),
    "5": ("/test/?apikey=t1", "200,429", "1 per 30 s: 429 at the edge"),
    "6": ("/test/?apikey=unknown", "401", "unknown key: 401 at the edge"),
    "7": ("/test/?max-age=0&apikey=t1", "200", "auth + cache hit"),
}
SYSTEMS = ["tollgate", "nginx", "haproxy", "tollgate-cluster"]
DEFAULT_SYSTEMS = ["tollgate", "nginx", "haproxy"]
REDIS = "127.0.0.1:6390"


def check_tools(systems):
    missing = [t for t in ["taskset"] if not shutil.which(t)]
    pkgs = {"nginx": "nginx", "haproxy": "haproxy", "tollgate-cluster": "redis-server"}
    missing_pkgs = [pkgs[s] for s in systems if s in pkgs and not shutil.which(pkgs[s])]
    if missing:
        die("needs taskset (Debian package util-linux)")
    if missing_pkgs:
        die(
            f"needs {' and '.join(missing_pkgs)} to compare against; install with\n"
            f"    sudo apt-get install {' '.join(missing_pkgs)}\n"
            f"or leave them out with --systems tollgate"
        )
    if (os.cpu_count() or 1) < 2:
        die("needs at least 2 CPUs (gateway on CPU 1; backend and load on CPU 0)")


def build():
    print("building tollgate (release)...", flush=True)
    subprocess.run(["cargo", "build", "--release", "--locked", "-q"], cwd=ROOT, check=True)


def wait_port_free(addr, timeout=15.0):
    host, port = addr.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, int(port)), timeout=0.2):
                time.sleep(0.05)
        except OSError:
            return
    die(f"{addr} is still in use after {timeout}s")


def process_tree(pid):
    """pid and all its descendants."""
    children = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def cpu_split(pids):
    """User and system CPU seconds of the processes."""
    user = system = 0
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        user += int(fields[11])  # utime
        system += int(fields[12])  # stime
    return user / CLK_TCK, system / CLK_TCK


def cpu_seconds(pids):
    """user+sys CPU seconds of the processes."""
    return sum(cpu_split(pids))


def start_gateway(system, scenario, tmp):
    n = scenario
    if system == "tollgate":
        cmd = [str(BIN), "run", "--config", str(ROOT / f"examples/seed/scenario-{n}.yaml")]
    elif system == "tollgate-cluster":
        # The same scenario, its limits shared through Redis.
        cfg = Path(tmp) / f"cluster-{n}.yaml"
        text = (ROOT / f"examples/seed/scenario-{n}.yaml").read_text()
        cfg.write_text(text + f"\ncluster:\n  redis: redis://{REDIS}/0\n  key_prefix: bench{time.time_ns()}\n")
        cmd = [str(BIN), "run", "--config", str(cfg)]
    elif system == "nginx":
        prefix = Path(tmp) / f"nginx-{n}"
        prefix.mkdir(exist_ok=True)
        cmd = ["nginx", "-p", str(prefix), "-c", str(ROOT / f"bench/peers/nginx/scenario-{n}.conf")]
    else:
        cmd = ["haproxy", "-db", "-f", str(ROOT / f"bench/peers/haproxy/scenario-{n}.cfg")]
    env = dict(os.environ, RUST_LOG="warn")
    proc = subprocess.Popen(
        ["taskset", "-c", GW_CPU] + cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    wait_port(GATEWAY, proc)
    return proc


def bench(url, expect, seconds, connections, extra=()):
    cmd = ["taskset", "-c", LOAD_CPU, str(BIN), "bench", "--json", "-c", str(connections),
           "-d", f"{seconds}s", "--expect", expect, *extra, url]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if not out.stdout.strip():
        die(f"bench failed: {out.stderr}")
    return json.loads(out.stdout)


def one_run(system, scenario, args, tmp):
    path, expect, _ = SCENARIOS[scenario]
    if scenario == "reference":
        url = f"http://{BACKEND}{path}"
        bench(url, expect, args.warmup, args.connections)
        r = bench(url, expect, args.duration, args.connections)
        return summarize(r, None)
    proc = start_gateway(system, scenario, tmp)
    try:
        url = f"http://{GATEWAY}{path}"
        bench(url, expect, args.warmup, args.connections)
        pids = process_tree(proc.pid)
        before = cpu_split(pids)
        r = bench(url, expect, args.duration, args.connections)
        after = cpu_split(pids)
    finally:
        stop(proc)
        wait_port_free(GATEWAY)
    n = max(r["requests"], 1)
    out = summarize(r, (sum(after) - sum(before)) * 1e6 / n)
    out["user_us"] = (after[0] - before[0]) * 1e6 / n
    return out


def summarize(r, cpu_us):
    lat = r.get("latency_ms") or {}
    return {
        "rps": r["requests_per_second"],
        "requests": r["requests"],
        "failed": r["failed"],
        "statuses": r["statuses"],
        "p50_ms": lat.get("p50"),
        "p99_ms": lat.get("p99"),
        "cpu_us": cpu_us,
    }


def timed(cmd):
    """Runs cmd; returns (stdout, CPU use of the process as a fraction of one CPU)."""
    start = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out = p.stdout.read() if p.stdout else ""
    _, _, usage = os.wait4(p.pid, 0)
    wall = time.monotonic() - start
    return out, (usage.ru_utime + usage.ru_stime) / wall if wall > 0 else 0.0


def compare_with_wrk(args):
    """tollgate bench against wrk on the echo backend, same pinning, interleaved."""
    if not shutil.which("wrk"):
        return None
    out = {"wrk": [], "tollgate bench": [], "wrk cpu": [], "tollgate bench cpu": []}
    for _ in range(max(5, args.rounds)):
        w, wcpu = timed(["taskset", "-c", LOAD_CPU, "wrk", "-t1", f"-c{args.connections}", f"-d{args.duration}s",
                         f"http://{GATEWAY}/"])
        rps = next((float(l.split()[1]) for l in w.splitlines() if l.startswith("Requests/sec")), None)
        out["wrk"].append(rps)
        out["wrk cpu"].append(wcpu)
        b, bcpu = timed(["taskset", "-c", LOAD_CPU, str(BIN), "bench", "--json", "-c", str(args.connections),
                         "-d", f"{args.duration}s", f"http://{GATEWAY}/"])
        out["tollgate bench"].append(json.loads(b)["requests_per_second"])
        out["tollgate bench cpu"].append(bcpu)
    return out


def machine():
    def run(cmd):
        try:
            p = subprocess.run(cmd, capture_output=True, text=True)
            return (p.stdout + p.stderr).strip().splitlines()[0]
        except (OSError, IndexError):
            return "not found"

    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    rev = run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"])
    # Only the code that is built counts; the harness's own edits do not change the binary.
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no",
                            "--", "crates", "Cargo.toml", "Cargo.lock"],
                           capture_output=True, text=True).stdout.strip()
    return {
        "cpu": model,
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "os": run(["sh", "-c", ". /etc/os-release && echo $PRETTY_NAME"]),
        "tollgate": rev + (" (with uncommitted changes)" if dirty else ""),
        "rustc": run(["rustc", "--version"]),
        "nginx": run(["nginx", "-v"]),
        "haproxy": run(["haproxy", "-v"]),
        "wrk": run(["wrk", "--version"]),
    }


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x, digits=1):
    return "–" if x is None else f"{x:,.{digits}f}"


def span(xs, digits=1):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "–"
    return f"{fmt(statistics.median(xs), digits)} ({fmt(min(xs), digits)}–{fmt(max(xs), digits)})"


def render(results, info, args, wrk, chart_name):
    systems = [s for s in SYSTEMS if any(s in results[k] for k in results)]
    peers = [s for s in systems if s in ("nginx", "haproxy")]
    L = []
    L.append("# Benchmarks\n")
    cmd = f"python3 bench/seed.py --rounds {args.rounds} --duration {args.duration} --connections {args.connections}"
    if args.systems != ",".join(DEFAULT_SYSTEMS):
        cmd += f" --systems {args.systems}"
    if args.scenarios != ",".join(SCENARIOS):
        cmd += f" --scenarios {args.scenarios}"
    if args.out != "docs/benchmarks.md":
        cmd += f" --out {args.out}"
    L.append(f"Generated by `{cmd}` on {info['date']}. The tables are the run's"
             + ("; the notes at the end are written by hand (`bench/notes.md`)." if args.out == "docs/benchmarks.md" else ".")
             + "\n")
    L.append("## Machine and versions\n")
    for k in ["cpu", "cpus", "os", "kernel", "tollgate", "rustc", "nginx", "haproxy", "wrk", "redis"]:
        if k in info:
            L.append(f"- {k}: {info[k]}")
    L.append("")
    L.append("## Method\n")
    L.append(f"- Gateway under test pinned to CPU {GW_CPU}; the echo backend (`tollgate echo`) and the "
             f"load generator (`tollgate bench`) pinned to CPU {LOAD_CPU}; the same for every system.")
    L.append(f"- Closed loop, {args.connections} keep-alive connections, {args.warmup} s warm-up, "
             f"then {args.duration} s measured; {args.rounds} rounds, systems interleaved within each "
             "scenario in every round.")
    L.append("- CPU µs/request: user+sys of the gateway's processes (from `/proc/PID/stat`, all "
             "processes of the gateway) over the measured run ÷ requests served. It is the steadiest "
             "figure on a shared machine; requests/s move ±20% between runs here.")
    L.append("- Figures are medians of the rounds, with min–max in brackets.\n")
    L.append("## Results\n")
    L.append("| scenario | system | requests/s | p50 ms | p99 ms | failed | CPU µs/request |")
    L.append("|---|---|---|---|---|---|---|")
    for sc in results:
        label = f"{sc} ({SCENARIOS[sc][2]})"
        for sys_ in results[sc]:
            runs = results[sc][sys_]
            L.append(
                f"| {label} | {sys_ if sc != 'reference' else 'backend alone'} | {span([r['rps'] for r in runs], 0)} "
                f"| {fmt(med([r['p50_ms'] for r in runs]), 3)} | {fmt(med([r['p99_ms'] for r in runs]), 3)} "
                f"| {sum(r['failed'] for r in runs)} | {span([r['cpu_us'] for r in runs])} |"
            )
            label = ""
    L.append("")
    if peers and "tollgate" in systems:
        L.append("## tollgate ÷ peer (medians)\n")
        L.append("| scenario | " + " | ".join(f"CPU/request vs {p}" for p in peers) + " | "
                 + " | ".join(f"requests/s vs {p}" for p in peers) + " |")
        L.append("|---|" + "---|" * (2 * len(peers)))
        for sc in results:
            if sc == "reference" or "tollgate" not in results[sc]:
                continue
            t = results[sc]["tollgate"]
            tc, tr = med([r["cpu_us"] for r in t]), med([r["rps"] for r in t])
            cells = []
            for p in peers:
                pc = med([r["cpu_us"] for r in results[sc].get(p, [])])
                cells.append("–" if not pc or tc is None else f"{tc / pc:.2f}")
            for p in peers:
                pr = med([r["rps"] for r in results[sc].get(p, [])])
                cells.append("–" if not pr or tr is None else f"{tr / pr:.2f}")
            L.append(f"| {sc} | " + " | ".join(cells) + " |")
        L.append("")
        L.append("## Targets\n")
        L.append("| target | measured | verdict |")
        L.append("|---|---|---|")
        for sc in ["1", "2", "3", "4", "5", "6", "7"]:
            if sc not in results or "tollgate" not in results[sc]:
                continue
            tc = med([r["cpu_us"] for r in results[sc]["tollgate"]])
            pcs = {p: med([r["cpu_us"] for r in results[sc].get(p, [])]) for p in peers}
            pcs = {p: c for p, c in pcs.items() if c}
            if pcs and tc is not None:
                best = min(pcs, key=pcs.get)
                goal = 0.8 * pcs[best]
                verdict = "met" if tc <= goal else f"missed by {tc - goal:.1f} µs ({tc / goal - 1:+.0%})"
                L.append(f"| scenario {sc}: CPU ≤ 0.8 × {best} ({goal:.1f} µs) | {tc:.1f} µs | {verdict} |")
            if sc in "12347":
                tr = med([r["rps"] for r in results[sc]["tollgate"]])
                prs = {p: med([r["rps"] for r in results[sc].get(p, [])]) for p in peers}
                prs = {p: r for p, r in prs.items() if r}
                if prs and tr is not None:
                    best = max(prs, key=prs.get)
                    verdict = "met" if tr >= prs[best] else f"missed by {prs[best] - tr:,.0f} req/s ({tr / prs[best] - 1:+.0%})"
                    L.append(f"| scenario {sc}: requests/s ≥ {best} ({prs[best]:,.0f}) | {tr:,.0f} | {verdict} |")
        if "1" in results and "4" in results and "tollgate" in results["1"] and "tollgate" in results["4"]:
            c1 = med([r["cpu_us"] for r in results["1"]["tollgate"]])
            c4 = med([r["cpu_us"] for r in results["4"]["tollgate"]])
            if c1 is not None and c4 is not None:
                verdict = "met" if c4 - c1 <= 1.0 else f"missed by {c4 - c1 - 1.0:.1f} µs"
                L.append(f"| scenario 4 − scenario 1 ≤ 1 µs | {c4 - c1:+.1f} µs | {verdict} |")
        L.append("")
    if "tollgate-cluster" in systems and "tollgate" in systems:
        L.append("## Cluster mode against local mode\n")
        L.append("Same scenarios, limits shared through a local Redis (`cluster:` on, pinned with the "
                 "backend and the load on CPU 0); CPU is the gateway's own. Target: at most +10% CPU per "
                 "request in scenarios 2–4, and p99 unchanged.\n")
        L.append("| scenario | CPU µs/request local | cluster | change | p99 ms local | cluster |")
        L.append("|---|---|---|---|---|---|")
        for sc in results:
            if "tollgate" not in results[sc] or "tollgate-cluster" not in results[sc]:
                continue
            lc = med([r["cpu_us"] for r in results[sc]["tollgate"]])
            cc = med([r["cpu_us"] for r in results[sc]["tollgate-cluster"]])
            lp = med([r["p99_ms"] for r in results[sc]["tollgate"]])
            cp = med([r["p99_ms"] for r in results[sc]["tollgate-cluster"]])
            change = "–" if not lc or cc is None else f"{cc / lc - 1:+.1%}"
            L.append(f"| {sc} | {fmt(lc)} | {fmt(cc)} | {change} | {fmt(lp, 3)} | {fmt(cp, 3)} |")
        L.append("")
    L.append(f"![CPU µs per request and requests/s per scenario]({chart_name})\n")
    if wrk:
        L.append("## The load generator against wrk\n")
        L.append(f"Both against the echo backend (on CPU {GW_CPU}), each on CPU {LOAD_CPU}, "
                 f"{args.connections} connections, {args.duration} s per run, interleaved.\n")
        L.append("| tool | requests/s, median (min–max) | CPU use of the load generator's core |")
        L.append("|---|---|---|")
        for tool in ("wrk", "tollgate bench"):
            cpu = wrk.get(f"{tool} cpu") or []
            L.append(f"| {tool} | {span(wrk.get(tool, []), 0)} | {fmt(med(cpu) * 100 if cpu else None, 0)}% |")
        rounds = len(wrk.get("wrk", []))
        L.append(f"\n{rounds} rounds. The CPU column is each generator's user+sys time over the run's wall "
                 "time: both drive the same echo backend with their core nearly full.\n")
    notes = ROOT / "bench" / "notes.md"
    if notes.exists() and args.out == "docs/benchmarks.md":
        L.append(notes.read_text().rstrip() + "\n")
    return "\n".join(L)


def chart(results):
    """A grouped bar chart (SVG): CPU µs/request and requests/s per scenario and system."""
    colors = {"tollgate": "#2b6cb0", "nginx": "#38a169", "haproxy": "#dd6b20",
              "tollgate-cluster": "#805ad5", "backend alone": "#718096"}
    scen = [s for s in results]
    W, H, pad, gap = 900, 560, 60, 30
    panel_h = (H - 3 * pad) / 2
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>']

    def panel(y0, title, key, digits):
        vals = []
        for sc in scen:
            for sys_, runs in results[sc].items():
                v = med([r[key] for r in runs])
                if v is not None:
                    vals.append(v)
        top = max(vals) * 1.15 if vals else 1
        out.append(f'<text x="{pad}" y="{y0 - 10}" font-size="14" font-weight="bold">{title}</text>')
        out.append(f'<line x1="{pad}" y1="{y0 + panel_h}" x2="{W - pad}" y2="{y0 + panel_h}" stroke="#333"/>')
        group_w = (W - 2 * pad) / len(scen)
        for i, sc in enumerate(scen):
            systems = list(results[sc].keys())
            bw = (group_w - gap) / max(len(systems), 1)
            for j, sys_ in enumerate(systems):
                v = med([r[key] for r in results[sc][sys_]])
                if v is None:
                    continue
                h = panel_h * v / top
                x = pad + i * group_w + gap / 2 + j * bw
                name = sys_ if sc != "reference" else "backend alone"
                out.append(f'<rect x="{x:.1f}" y="{y0 + panel_h - h:.1f}" width="{bw - 2:.1f}" height="{h:.1f}" fill="{colors[name]}"/>')
                label = f"{v / 1000:.0f}k" if v >= 10_000 else f"{v:,.{digits}f}"
                out.append(f'<text x="{x + bw / 2:.1f}" y="{y0 + panel_h - h - 3:.1f}" text-anchor="middle" font-size="10">{label}</text>')
            out.append(f'<text x="{pad + i * group_w + group_w / 2:.1f}" y="{y0 + panel_h + 15:.1f}" text-anchor="middle">{sc}</text>')

    panel(pad, "Gateway CPU µs per request (lower is better)", "cpu_us", 1)
    panel(2 * pad + panel_h, "Requests per second (higher is better)", "rps", 0)
    lx = W - pad - len(colors) * 120
    for k, (name, c) in enumerate(colors.items()):
        out.append(f'<rect x="{lx + k * 120}" y="{H - 22}" width="12" height="12" fill="{c}"/>')
        out.append(f'<text x="{lx + k * 120 + 16}" y="{H - 12}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=int, default=5, help="measured seconds per run")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up seconds per run")
    ap.add_argument("--connections", type=int, default=50)
    ap.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                    help=f"any of {','.join(SYSTEMS)} (tollgate-cluster: limits shared through a local Redis)")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--no-build", action="store_true", help="use target/release/tollgate as it is")
    ap.add_argument("--no-docs", action="store_true", help="write only the JSON results")
    ap.add_argument("--no-wrk", action="store_true", help="skip the comparison of the load generator with wrk")
    ap.add_argument("--out", default="docs/benchmarks.md", help="where to write the report")
    ap.add_argument("--wrk-into", metavar="RESULTS_JSON",
                    help="re-run only the comparison with wrk into saved results, then rewrite the report")
    ap.add_argument("--render", metavar="RESULTS_JSON",
                    help="only rewrite the report from a saved bench/results/*.json (e.g. after editing bench/notes.md)")
    args = ap.parse_args()
    if args.wrk_into:
        # Re-run only the load-generator comparison into saved results, then re-render.
        raw = json.loads(Path(args.wrk_into).read_text())
        echo = subprocess.Popen(["taskset", "-c", GW_CPU, str(BIN), "echo", "--listen", GATEWAY],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_port(GATEWAY, echo)
            raw["wrk"] = compare_with_wrk(args)
        finally:
            stop(echo)
        Path(args.wrk_into).write_text(json.dumps(raw, indent=2))
        args.render = args.wrk_into
    if args.render:
        raw = json.loads(Path(args.render).read_text())
        saved = argparse.Namespace(**raw["args"])
        saved.out = args.out
        write_docs(raw["results"], raw["machine"], saved, raw.get("wrk"))
        return
    systems = [s for s in args.systems.split(",") if s]
    scenarios = [s for s in args.scenarios.split(",") if s]
    for s in systems:
        if s not in SYSTEMS:
            die(f"unknown system {s!r}; choose from {', '.join(SYSTEMS)}")
    for s in scenarios:
        if s not in SCENARIOS:
            die(f"unknown scenario {s!r}; choose from {', '.join(SCENARIOS)}")
    if args.rounds < 1 or args.duration < 1:
        die("--rounds and --duration must be at least 1")
    check_tools(systems)
    if not args.no_build:
        build()
    if not BIN.exists():
        die(f"{BIN} is missing; build it with cargo build --release")
    wait_port_free(BACKEND, timeout=1)
    wait_port_free(GATEWAY, timeout=1)

    info = machine()
    info["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    backend = subprocess.Popen(["taskset", "-c", LOAD_CPU, str(BIN), "echo", "--listen", BACKEND],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results = {sc: {} for sc in scenarios}
    wrk = None
    redis = None
    if "tollgate-cluster" in systems:
        host, port = REDIS.split(":")
        redis = subprocess.Popen(["taskset", "-c", LOAD_CPU, "redis-server", "--port", port, "--bind", host,
                                  "--save", "", "--appendonly", "no"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(REDIS, redis)
        info["redis"] = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.strip()
    try:
        wait_port(BACKEND, backend)
        total = args.rounds * sum(1 if sc == "reference" else len(systems) for sc in scenarios)
        done = 0
        for rnd in range(args.rounds):
            for sc in scenarios:
                order = ["backend"] if sc == "reference" else systems[rnd % len(systems):] + systems[:rnd % len(systems)]
                for sys_ in order:
                    with tempfile.TemporaryDirectory() as tmp:
                        r = one_run(sys_, sc, args, tmp)
                    results[sc].setdefault(sys_, []).append(r)
                    done += 1
                    cpu = "" if r["cpu_us"] is None else f", {r['cpu_us']:.1f} µs/request"
                    print(f"[{done}/{total}] round {rnd + 1} scenario {sc:9} {sys_:8} "
                          f"{r['rps']:>9,.0f} req/s, p99 {r['p99_ms'] or 0:.3f} ms, failed {r['failed']}{cpu}",
                          flush=True)
        # The load generator against wrk, with the echo backend on the gateway's CPU.
        stop(backend)
        wait_port_free(BACKEND)
        backend = subprocess.Popen(["taskset", "-c", GW_CPU, str(BIN), "echo", "--listen", GATEWAY],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(GATEWAY, backend)
        if not args.no_wrk:
            wrk = compare_with_wrk(args)
    finally:
        stop(backend)
        if redis is not None:
            stop(redis)

    # Keep the order of the systems list within each scenario.
    for sc in results:
        results[sc] = {s: results[sc][s] for s in ["backend"] + SYSTEMS if s in results[sc]}
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    raw = {"machine": info, "args": vars(args), "results": results, "wrk": wrk}
    (out_dir / f"seed-{stamp}.json").write_text(json.dumps(raw, indent=2))
    print(f"wrote bench/results/seed-{stamp}.json")
    if not args.no_docs:
        write_docs(results, info, args, wrk)


def write_docs(results, info, args, wrk):
    out = ROOT / args.out
    svg = out.with_name(out.stem + "-chart.svg")
    (ROOT / "docs").mkdir(exist_ok=True)
    out.write_text(render(results, info, args, wrk, svg.name))
    svg.write_text(chart(results))
    print(f"wrote {out} and {svg}")


if __name__ == "__main__":
    # SIGTERM unwinds like Ctrl-C, so the servers started here are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    main()
