#!/usr/bin/env python3
"""Seed scenarios 1 (auth + authz, proxied) and 6 (401 at the edge) over TLS: tollgate,
nginx and HAProxy terminating TLS 1.3 with the same certificate, HTTP/1.1 with keep-alive
and HTTP/2, interleaved rounds.

    python3 bench/tls.py [--rounds 5] [--duration 5] [--scenarios 1,6] [--protocols h1,h2]
                         [--systems tollgate,nginx,haproxy] [--build LABEL=BINARY ...] [--out FILE.json]

`--build` adds another tollgate binary as a system of its own (named `tollgate:LABEL`), to
compare builds in the same interleaved rounds as the peers.

Each gateway is pinned to CPU 1 and proxies to the echo backend (`tollgate echo`, kept-alive
HTTP/1.1) on CPU 0, where the load generator h2load (nghttp2-client) runs too:
- `h1`: 50 connections, one request at a time on each (`h2load --h1 -c 50 -m 1`);
- `h2`: 10 connections with 5 streams each (`h2load -c 10 -m 5`): the same 50 in flight.
The configs are the seed scenario files with a TLS listener added (tollgate: `tls:`; nginx:
`listen ... ssl http2` and `keepalive_requests` raised from its 1,000 so that it keeps its
connections as the others do; HAProxy: `bind ... ssl crt ... alpn h2,http/1.1`). The gateway's CPU
(user + system, from /proc) over the run divided by the requests answered gives CPU µs per
request. Prints medians and ratios; with --out, writes every run as JSON.
"""

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import seed
from procs import die, stop, wait_port

ROOT = seed.ROOT
SYSTEMS = ["tollgate", "nginx", "haproxy"]
# Extra tollgate builds by system name (`tollgate:LABEL`), from --build.
BUILDS = {}
PROTOCOLS = {"h1": ["--h1", "-c", "50", "-m", "1"], "h2": ["-c", "10", "-m", "5"]}


def make_cert(tmp):
    """A self-signed certificate for 127.0.0.1 (RSA 2048, as certificates commonly are)."""
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    both = tmp / "both.pem"
    both.write_text(cert.read_text() + key.read_text())
    return cert, key, both


def configs(tmp, scenario, cert, key, both):
    n = scenario
    tg = (ROOT / f"examples/seed/scenario-{n}.yaml").read_text()
    tg = tg.replace("  - address: 127.0.0.1:8080\n",
                    f"  - address: 127.0.0.1:8080\n    tls: {{certificates: [{{cert: {cert}, key: {key}}}]}}\n", 1)
    if "tls:" not in tg:
        die(f"scenario {n}: no listener line to add TLS to")
    (tmp / f"tollgate-{n}.yaml").write_text(tg)
    ng = (ROOT / f"bench/peers/nginx/scenario-{n}.conf").read_text()
    ng = ng.replace("listen 127.0.0.1:8080 backlog=4096;",
                    f"listen 127.0.0.1:8080 ssl http2 backlog=4096;\n        ssl_certificate {cert};\n"
                    f"        ssl_certificate_key {key};\n        ssl_protocols TLSv1.2 TLSv1.3;\n"
                    # nginx closes a connection after 1,000 requests by default (HTTP/2 too):
                    # a new handshake each time, which the other two never pay.
                    f"        keepalive_requests 100000000;", 1)
    if "ssl_certificate" not in ng:
        die(f"scenario {n}: no nginx listen line to add TLS to")
    (tmp / f"nginx-{n}.conf").write_text(ng)
    hp = (ROOT / f"bench/peers/haproxy/scenario-{n}.cfg").read_text()
    hp = hp.replace("    bind 127.0.0.1:8080\n", f"    bind 127.0.0.1:8080 ssl crt {both} alpn h2,http/1.1\n", 1)
    if "ssl crt" not in hp:
        die(f"scenario {n}: no haproxy bind line to add TLS to")
    (tmp / f"haproxy-{n}.cfg").write_text(hp)


def start(system, scenario, tmp):
    n = scenario
    if system.startswith("tollgate"):
        cmd = [BUILDS.get(system, str(seed.BIN)), "run", "--config", str(tmp / f"tollgate-{n}.yaml")]
    elif system == "nginx":
        prefix = tmp / f"nginx-prefix-{n}"
        prefix.mkdir(exist_ok=True)
        cmd = ["nginx", "-p", str(prefix), "-c", str(tmp / f"nginx-{n}.conf")]
    else:
        cmd = ["haproxy", "-db", "-f", str(tmp / f"haproxy-{n}.cfg")]
    proc = subprocess.Popen(["taskset", "-c", seed.GW_CPU] + cmd, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={"RUST_LOG": "warn", "PATH": "/usr/sbin:/usr/bin:/bin"})
    wait_port(seed.GATEWAY, proc)
    return proc


def h2load(url, proto, seconds):
    cmd = ["taskset", "-c", seed.LOAD_CPU, "h2load", "-D", str(seconds)] + PROTOCOLS[proto] + [url]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60).stdout
    m = re.search(r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded", out)
    codes = re.search(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", out)
    proto_line = re.search(r"Application protocol: (\S+)", out)
    if not m or not codes:
        die(f"h2load printed no summary:\n{out}")
    return int(m.group(3)), [int(c) for c in codes.groups()], proto_line.group(1) if proto_line else "?"


def one(system, scenario, proto, seconds, tmp):
    path, expect, _ = seed.SCENARIOS[scenario]
    url = f"https://{seed.GATEWAY}{path}"
    proc = start(system, scenario, tmp)
    try:
        pids = seed.process_tree(proc.pid)
        c0 = seed.cpu_seconds(pids)
        done, codes, alpn = h2load(url, proto, seconds)
        cpu = seed.cpu_seconds(pids) - c0
    finally:
        stop(proc)
        seed.wait_port_free(seed.GATEWAY)
    want = {"200": 0, "401": 2}[expect]
    # Requests cut off when the duration ends may count as done without a status.
    others = sum(c for i, c in enumerate(codes) if i != want)
    if others or codes[want] < done - 50 or done == 0:
        die(f"{system} scenario {scenario} {proto}: expected all {expect}, got {codes} of {done}")
    done = codes[want]
    if (proto == "h2") != (alpn == "h2"):
        die(f"{system} {proto}: negotiated {alpn}")
    # CPU and requests cover the same span, the 50 (or 10) handshakes included.
    return {"system": system, "scenario": scenario, "proto": proto, "requests": done,
            "rps": done / seconds, "cpu_us": cpu * 1e6 / done}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--duration", type=int, default=5)
    ap.add_argument("--scenarios", default="1,6")
    ap.add_argument("--protocols", default="h1,h2")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--build", action="append", default=[], metavar="LABEL=BINARY")
    ap.add_argument("--out")
    args = ap.parse_args()
    systems = args.systems.split(",")
    for b in args.build:
        label, _, path = b.partition("=")
        if not path or not Path(path).is_file():
            die(f"--build {b}: expected LABEL=BINARY with an existing binary")
        BUILDS[f"tollgate:{label}"] = path
        systems.append(f"tollgate:{label}")
    protocols = args.protocols.split(",")
    if any(p not in PROTOCOLS for p in protocols) or any(
            s not in SYSTEMS and s not in BUILDS for s in systems):
        die(f"protocols are {list(PROTOCOLS)}; systems are {SYSTEMS} and --build labels")
    for tool in ["h2load", "openssl", "taskset"] + [x for x in ("nginx", "haproxy") if x in systems]:
        if subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True).returncode:
            die(f"{tool} is needed (apt-get install nghttp2-client nginx haproxy openssl util-linux)")
    seed.build()
    runs = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cert, key, both = make_cert(tmp)
        scenarios = args.scenarios.split(",")
        for s in scenarios:
            configs(tmp, s, cert, key, both)
        backend = subprocess.Popen(["taskset", "-c", seed.LOAD_CPU, str(seed.BIN), "echo", "--listen", seed.BACKEND],
                                   stderr=subprocess.DEVNULL)
        wait_port(seed.BACKEND, backend)
        try:
            for r in range(args.rounds):
                order = systems if r % 2 == 0 else systems[::-1]
                for s in scenarios:
                    for proto in protocols:
                        for system in order:
                            res = one(system, s, proto, args.duration, tmp)
                            res["round"] = r
                            runs.append(res)
                            print(f"round {r} scenario {s} {proto} {system}: {res['rps']:.0f} req/s, "
                                  f"{res['cpu_us']:.1f} µs CPU/req", file=sys.stderr)
        finally:
            stop(backend)
    print("\n| scenario | protocol | system | req/s (median) | CPU µs/req (median) | CPU ÷ best peer (or first system) |")
    print("|---|---|---|---|---|---|")
    for s in args.scenarios.split(","):
        for proto in protocols:
            med = {}
            for system in systems:
                xs = [x for x in runs if x["system"] == system and x["scenario"] == s and x["proto"] == proto]
                med[system] = (statistics.median(x["rps"] for x in xs), statistics.median(x["cpu_us"] for x in xs))
            peers = [med[p][1] for p in ("nginx", "haproxy") if p in med]
            best = min(peers) if peers else med[systems[0]][1]
            for system in systems:
                rps, cpu = med[system]
                print(f"| {s} | {proto} | {system} | {rps:.0f} | {cpu:.1f} | {cpu / best:.2f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": runs, "args": vars(args)}, indent=1))


if __name__ == "__main__":
    main()
