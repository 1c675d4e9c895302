#!/usr/bin/env python3
"""The price of bearer tokens: scenario 1 with an API key against scenario 1 with a JWT.

    python3 bench/jwt.py [--rounds 5] [--duration 4] [--fresh 4000]

Part 1, a repeated token: the same binary serves examples/seed/scenario-1.yaml (key in the
query) and bench/scenario-1-jwt.yaml (`Authorization: Bearer`, RS256, the same consumer),
interleaved round by round, with the pinning of bench/seed.py; `tollgate bench` drives both.
Prints the gateway's CPU µs per request and requests/s, medians, and the JWT/key ratio.

Part 2, fresh tokens: a fresh gateway is sent --fresh requests, each with a token it has never
seen (RS256, distinct `jti`), then as many with one repeated token, from a pipelining
client; the difference in the gateway's CPU per request is the price of verifying a token
(signature, claims, remembering it). Rounds alternate the order. Needs Python's
`cryptography` (pip install cryptography). Writes nothing.
"""

import argparse
import base64
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import seed
from procs import die, stop, wait_port

try:
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import padding
except ImportError:
    die("needs Python's cryptography: pip install cryptography")

ROOT = Path(__file__).resolve().parent.parent
KEY = ROOT / "crates/gateway/tests/data/jwt/rsa-a.pem"
KEY_CONFIG = ROOT / "examples/seed/scenario-1.yaml"
JWT_CONFIG = ROOT / "bench/scenario-1-jwt.yaml"
PATH = "/test/?max-age=0"


def b64(b):
    return base64.urlsafe_b64encode(b).rstrip(b"=").decode()


def signer():
    key = serialization.load_pem_private_key(KEY.read_bytes(), password=None)
    header = b64(json.dumps({"alg": "RS256", "typ": "JWT", "kid": "example-2026"}).encode())

    def sign(jti):
        claims = {"sub": "consumer-1", "aud": "bench", "exp": int(time.time()) + 86400, "jti": jti}
        msg = f"{header}.{b64(json.dumps(claims).encode())}"
        sig = key.sign(msg.encode(), padding.PKCS1v15(), hashes.SHA256())
        return f"{msg}.{b64(sig)}"

    return sign


def start(config):
    proc = subprocess.Popen(["taskset", "-c", seed.GW_CPU, str(seed.BIN), "run", "--config", str(config)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(seed.GATEWAY, proc)
    return proc


def closed_loop(config, url, headers, args):
    proc = start(config)
    try:
        extra = [x for h in headers for x in ("-H", h)]
        seed.bench(url, "200", args.warmup, args.connections, extra)
        pids = seed.process_tree(proc.pid)
        before = seed.cpu_seconds(pids)
        r = seed.bench(url, "200", args.duration, args.connections, extra)
        after = seed.cpu_seconds(pids)
    finally:
        stop(proc)
        seed.wait_port_free(seed.GATEWAY)
    return (after - before) * 1e6 / max(r["requests"], 1), r["requests_per_second"]


def pipelined(tokens, conns=4, batch=64):
    """Sends one GET per token over `conns` keep-alive connections, `batch` at a time;
    returns the number of 200 answers."""
    host, port = seed.GATEWAY.rsplit(":", 1)
    ok = [0] * conns

    def run(i, mine):
        s = socket.create_connection((host, int(port)))
        buf = b""
        for at in range(0, len(mine), batch):
            chunk = mine[at:at + batch]
            s.sendall(b"".join(
                f"GET {PATH} HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer {t}\r\n\r\n".encode()
                for t in chunk))
            got = 0
            while got < len(chunk):
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    data = s.recv(1 << 16)
                    if not data:
                        die("the gateway closed a connection")
                    buf += data
                    continue
                head = buf[:end].decode("latin-1")
                length = 0
                for line in head.split("\r\n")[1:]:
                    name, _, value = line.partition(":")
                    if name.lower() == "content-length":
                        length = int(value)
                if len(buf) < end + 4 + length:
                    buf += s.recv(1 << 16)
                    continue
                ok[i] += head.startswith("HTTP/1.1 200")
                buf = buf[end + 4 + length:]
                got += 1
        s.close()

    threads = [threading.Thread(target=run, args=(i, tokens[i::conns])) for i in range(conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(ok)


def fresh_vs_repeated(tokens, repeated):
    """Gateway CPU µs per request: `tokens` all new, then as many of `repeated`."""
    proc = start(JWT_CONFIG)
    try:
        pids = seed.process_tree(proc.pid)
        pipelined([repeated] * 200)  # connections and the one token warm
        out = []
        for batch in (tokens, [repeated] * len(tokens)):
            before = seed.cpu_seconds(pids)
            ok = pipelined(batch)
            after = seed.cpu_seconds(pids)
            if ok != len(batch):
                die(f"{len(batch) - ok} of {len(batch)} requests not answered 200")
            out.append((after - before) * 1e6 / len(batch))
    finally:
        stop(proc)
        seed.wait_port_free(seed.GATEWAY)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--duration", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--connections", type=int, default=50)
    ap.add_argument("--fresh", type=int, default=4000)
    args = ap.parse_args()
    if not seed.BIN.exists():
        die(f"no {seed.BIN}: cargo build --release")
    sign = signer()
    repeated = sign("repeated")
    backend = subprocess.Popen(["taskset", "-c", seed.LOAD_CPU, str(seed.BIN), "echo", "--listen", seed.BACKEND],
                               stderr=subprocess.DEVNULL)
    wait_port(seed.BACKEND, backend)
    key_runs, jwt_runs, fresh_runs, same_runs = [], [], [], []
    try:
        for rnd in range(args.rounds):
            order = ["key", "jwt"] if rnd % 2 == 0 else ["jwt", "key"]
            for which in order:
                if which == "key":
                    r = closed_loop(KEY_CONFIG, f"http://{seed.GATEWAY}{PATH}&apikey=t1", [], args)
                    key_runs.append(r)
                else:
                    r = closed_loop(JWT_CONFIG, f"http://{seed.GATEWAY}{PATH}",
                                    [f"authorization: Bearer {repeated}"], args)
                    jwt_runs.append(r)
                print(f"round {rnd + 1} {which}: {r[1]:.0f} req/s, {r[0]:.2f} µs CPU/req", file=sys.stderr)
            tokens = [sign(f"r{rnd}-{i}") for i in range(args.fresh)]
            fresh, same = fresh_vs_repeated(tokens, repeated)
            fresh_runs.append(fresh)
            same_runs.append(same)
            print(f"round {rnd + 1} fresh tokens: {fresh:.2f} µs CPU/req, repeated: {same:.2f}", file=sys.stderr)
    finally:
        stop(backend)
    med = statistics.median
    kc, kr = med(r[0] for r in key_runs), med(r[1] for r in key_runs)
    jc, jr = med(r[0] for r in jwt_runs), med(r[1] for r in jwt_runs)
    print(f"{args.rounds} interleaved rounds, medians; gateway on CPU {seed.GW_CPU}\n")
    print("| scenario 1 with | µs CPU/req | req/s |")
    print("|---|---|---|")
    print(f"| API key (`?apikey=t1`) | {kc:.2f} | {kr:.0f} |")
    print(f"| JWT, repeated (RS256) | {jc:.2f} | {jr:.0f} |")
    print(f"| ratio JWT / key | {jc / kc:.3f} | {jr / kr:.3f} |\n")
    diffs = [f - s for f, s in zip(fresh_runs, same_runs)]
    print(f"fresh RS256 tokens ({args.fresh} a round, pipelined): {med(fresh_runs):.2f} µs CPU/req; "
          f"the same count of one repeated token: {med(same_runs):.2f}; "
          f"a fresh token's verification: {med(diffs):.1f} µs (rounds: "
          + ", ".join(f"{d:.1f}" for d in diffs) + ")")


if __name__ == "__main__":
    sys.exit(main())
