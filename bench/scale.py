#!/usr/bin/env python3
"""A million consumers: load time, memory per consumer, CPU per request with keys spread
over all of them, against nginx doing the same (`map` of the 1M keys + `limit_req`).

    python3 bench/scale.py [--consumers 1000000] [--rounds 5] [--duration 5]
                           [--cpu-only] [--without-limits]

Generates N consumers with one 32-character key each and one limit (1,000,000 per second,
so nothing is refused and every request goes through the limiter), as a tollgate
`consumers_file` (JSON lines) and as an nginx `map` include. Then, with the pinning of
bench/seed.py (gateway on CPU 1; echo backend and wrk on CPU 0):

1. load: seconds from start until the listener answers, for tollgate and nginx, and
   `tollgate check` on the config alone;
2. memory: resident memory (PSS summed over nginx's master and worker) with N consumers,
   minus the same server with 3 consumers, divided by N; for tollgate also after every
   consumer has called once (their counters made), and once those counters are retired;
3. CPU per request: `wrk` with a Lua script drawing a key uniformly over all N keys for
   each request, and sending it (uniform) or the first key instead (hot), so the load
   generator works the same in both; rounds interleaved, medians, ratio;
4. reload: a paced load (`tollgate bench --rate 2000`) while tollgate reloads the N
   consumers (SIGHUP): failures and p99 against the same load without a reload.

`--cpu-only` runs step 3 alone. `--without-limits` drops the limit from both systems (no
plan limit in tollgate, no `limit_req` in nginx), which leaves what finding the consumer
by its key costs: run with and without it to see which part of a cold consumer's cost is
the lookup and which the counting.

Prints one JSON object. Needs nginx and wrk; loopback only; every loop is bounded.
"""

import argparse
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import seed
from procs import die, stop, wait_port

ROOT = seed.ROOT
BIN = seed.BIN
GATEWAY = seed.GATEWAY
BACKEND = seed.BACKEND


def key_of(i):
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).hexdigest()


def generate(n, tmp):
    """The consumers file, the nginx map include and the wrk key list for n consumers."""
    d = Path(tmp)
    with open(d / "consumers.jsonl", "w") as jl, open(d / "keys.map", "w") as mp, \
            open(d / "keys.txt", "w") as kt:
        for i in range(n):
            k = key_of(i)
            jl.write(f'{{"name":"c{i}","plan":"basic","keys":["{k}"]}}\n')
            mp.write(f"{k} c{i};\n")
            kt.write(k + "\n")


def tollgate_config(tmp, consumers_file, limits=True):
    cf = f"consumers_file: {consumers_file}\n" if consumers_file else \
        "consumers:\n  - {name: c0, keys: [" + key_of(0) + "], plan: basic}\n" \
        "  - {name: c1, keys: [" + key_of(1) + "], plan: basic}\n" \
        "  - {name: c2, keys: [" + key_of(2) + "], plan: basic}\n"
    plan = "{limits: [{requests: 1000000, per: 1s, name: rate}]}" if limits else "{}"
    text = f"""server: {{watch_config: false}}
listeners: [{{address: "{GATEWAY}"}}]
upstreams: {{backend: {{targets: ["{BACKEND}"]}}}}
plans: {{basic: {plan}}}
{cf}routes:
  - {{name: test, path_prefix: /test/, upstream: backend, auth: {{query: [apikey]}}}}
"""
    path = Path(tmp) / ("scale.yaml" if consumers_file else "small.yaml")
    path.write_text(text)
    return path


def nginx_config(tmp, map_file, limits=True):
    maps = f"include {map_file};" if map_file else \
        " ".join(f"{key_of(i)} c{i};" for i in range(3))
    text = f"""worker_processes 1;
daemon off;
pid nginx.pid;
error_log stderr warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    map_hash_max_size 4194304;
    map_hash_bucket_size 128;
    map $arg_apikey $consumer {{ default ""; {maps} }}
    {"limit_req_zone $consumer zone=perconsumer:256m rate=1000000r/s;" if limits else ""}
    limit_req_status 429;
    upstream backend {{ server {BACKEND}; keepalive 256; }}
    server {{
        listen {GATEWAY} backlog=4096;
        location /test/ {{
            if ($consumer = "") {{ return 401 '{{"status":401,"error":"unknown API key"}}'; }}
            {"limit_req zone=perconsumer burst=1000 nodelay;" if limits else ""}
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header X-Consumer $consumer;
        }}
    }}
}}
"""
    name = "nginx-scale.conf" if map_file else "nginx-small.conf"
    path = Path(tmp) / name
    path.write_text(text)
    return path


def start(system, cfg, tmp, binary=BIN):
    """Starts `system` on `cfg` pinned to the gateway CPU (tollgate from `binary`); returns
    (process, seconds to ready)."""
    if system == "tollgate":
        cmd = [str(binary), "run", "--config", str(cfg)]
    else:
        prefix = Path(tmp) / "nginx"
        prefix.mkdir(exist_ok=True)
        cmd = ["nginx", "-p", str(prefix), "-c", str(cfg)]
    t0 = time.monotonic()
    proc = subprocess.Popen(["taskset", "-c", seed.GW_CPU] + cmd, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=dict(os.environ, RUST_LOG="warn"))
    wait_port(GATEWAY, proc, timeout=120)
    return proc, time.monotonic() - t0


def pss_kib(pids):
    total = 0
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


def settled_pss(pid, seconds=10.0):
    """PSS of the process tree once it has not moved for a second (at most `seconds`)."""
    deadline = time.monotonic() + seconds
    last, since = pss_kib(seed.process_tree(pid)), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = pss_kib(seed.process_tree(pid))
        if abs(now - last) > 64:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= 1.0:
            break
    return last


def wrk_script(tmp, keys_file, hot):
    """wrk's request script: a key drawn uniformly from `keys_file` each request, or (hot)
    the same draw with the first key sent every time, so that both cost the load generator
    the same and only the gateway's side differs. Every request is built once, when the
    script loads: building it per request (a new Lua string each time for uniform, the same
    interned one for hot) cost `wrk` more in the uniform arm, enough that it, not the
    gateway, set the pace there, and a gateway that waits pays more per request."""
    path = Path(tmp) / ("hot.lua" if hot else "uniform.lua")
    path.write_text(f"""
local reqs = {{}}
for line in io.lines("{keys_file}") do
  reqs[#reqs + 1] = "GET /test/?apikey=" .. line .. " HTTP/1.1\\r\\nHost: {GATEWAY}\\r\\n\\r\\n"
end
math.randomseed(os.time())
local hot = {"true" if hot else "false"}
request = function()
  local r = reqs[math.random(#reqs)]
  -- the hot arm reads the drawn request's first and last bytes too (the two cache lines
  -- `wrk` would copy), so that the load generator's memory traffic is the same in both.
  if hot and string.byte(r, 1) + string.byte(r, -1) > 0 then return reqs[1] end
  return r
end
""")
    return path


def wrk_scripts(tmp):
    """The two arms of the CPU step, over `generate`'s keys: uniform over all, and one hot key."""
    keys = Path(tmp) / "keys.txt"
    return {"uniform": wrk_script(tmp, keys, False), "hot": wrk_script(tmp, keys, True)}


def start_backend():
    """The echo backend, pinned to the load CPU and answering."""
    backend = subprocess.Popen(["taskset", "-c", seed.LOAD_CPU, str(BIN), "echo", "--listen", BACKEND],
                               stderr=subprocess.DEVNULL)
    wait_port(BACKEND, backend)
    return backend


def wrk(script, seconds, connections=50):
    out = subprocess.run(["taskset", "-c", seed.LOAD_CPU, "wrk", "-t1", f"-c{connections}",
                          f"-d{seconds}s", "-s", str(script), f"http://{GATEWAY}/"],
                         capture_output=True, text=True)
    reqs = 0
    non2xx = 0
    for line in out.stdout.splitlines():
        parts = line.split()
        if "requests in" in line:
            reqs = int(parts[0])
        if line.strip().startswith("Non-2xx"):
            non2xx = int(parts[-1])
    if reqs == 0:
        die(f"wrk failed: {out.stdout}{out.stderr}")
    return reqs, non2xx


def cpu_run(proc, script, args):
    wrk(script, 1)
    pids = seed.process_tree(proc.pid)
    before = seed.cpu_seconds(pids)
    reqs, non2xx = wrk(script, args.duration)
    after = seed.cpu_seconds(pids)
    # The share of one CPU the gateway used while loaded: near 1 when it, not the load
    # generator, sets the pace, which the uniform and hot arms need for a fair comparison.
    busy = (after - before) / args.duration
    return {"cpu_us": (after - before) * 1e6 / reqs, "rps": reqs / args.duration, "non2xx": non2xx,
            "busy": busy}


def every_key_once(n, keys_file):
    """Each of the n keys once (wrk would take long to cover them all at random)."""
    subprocess.run(["taskset", "-c", seed.LOAD_CPU, str(BIN), "bench", "--json", "-n", "1", "-c", "1",
                    f"http://{GATEWAY}/test/?apikey=x"], capture_output=True)
    script = Path(keys_file).with_suffix(".seq.lua")
    script.write_text(f"""
local keys = {{}}
for line in io.lines("{keys_file}") do keys[#keys + 1] = line end
local i = 0
request = function()
  i = i + 1
  if i > #keys then i = 1 end
  return wrk.format("GET", "/test/?apikey=" .. keys[i])
end
""")
    seconds = max(5, n // 20000)
    wrk(script, seconds)


def paced(seconds, during=None):
    """A paced load; `during` is called 1 s in. Its summary."""
    p = subprocess.Popen(["taskset", "-c", seed.LOAD_CPU, str(BIN), "bench", "--json", "--rate", "2000",
                          "-c", "20", "-d", f"{seconds}s", "--expect", "200",
                          f"http://{GATEWAY}/test/?apikey={key_of(0)}"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if during:
        time.sleep(1)
        during()
    out, err = p.communicate(timeout=seconds + 60)
    if not out.strip():
        die(f"bench failed: {err}")
    r = json.loads(out)
    lat = r.get("latency_ms") or {}
    return {"requests": r["requests"], "failed": r["failed"], "p99_ms": lat.get("p99"),
            "max_ms": lat.get("slowest")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--consumers", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--duration", type=int, default=5)
    ap.add_argument("--cpu-only", action="store_true", help="only the CPU per request (step 3)")
    ap.add_argument("--without-limits", action="store_true",
                    help="no limit in either system: the key lookup alone")
    args = ap.parse_args()
    limits = not args.without_limits
    for tool in ("nginx", "wrk", "taskset"):
        if not shutil.which(tool):
            die(f"needs {tool}")
    if not BIN.exists():
        die("build first: cargo build --release")
    n = args.consumers
    out = {"consumers": n, "limits": limits}
    backend = start_backend()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            t = time.monotonic()
            generate(n, tmp)
            print(f"generated {n} consumers in {time.monotonic() - t:.1f}s", file=sys.stderr)
            big = {"tollgate": tollgate_config(tmp, Path(tmp) / "consumers.jsonl", limits),
                   "nginx": nginx_config(tmp, Path(tmp) / "keys.map", limits)}
            small = {"tollgate": tollgate_config(tmp, None, limits),
                     "nginx": nginx_config(tmp, None, limits)}
            t = time.monotonic()
            chk = subprocess.run([str(BIN), "check", "--config", str(big["tollgate"])], capture_output=True)
            out["tollgate_check_s"] = round(time.monotonic() - t, 2)
            if chk.returncode != 0:
                die(f"check failed: {chk.stderr.decode()}")
            scripts = wrk_scripts(tmp)
            for system in ("tollgate", "nginx"):
                out[system] = {}
                if args.cpu_only:
                    continue
                proc, _ = start(system, small[system], tmp)
                base = settled_pss(proc.pid)
                stop(proc)
                seed.wait_port_free(GATEWAY)
                proc, load_s = start(system, big[system], tmp)
                loaded = settled_pss(proc.pid)
                r = {"load_s": round(load_s, 2), "pss_small_kib": base, "pss_kib": loaded,
                     "bytes_per_consumer": round((loaded - base) * 1024 / n)}
                if system == "tollgate":
                    every_key_once(n, Path(tmp) / "keys.txt")
                    called = settled_pss(proc.pid)
                    r["pss_after_all_called_kib"] = called
                    r["bytes_per_consumer_after_all_called"] = round((called - base) * 1024 / n)
                    # Counters of a 1 s window are retired by the sweeper within ~10 s.
                    time.sleep(15)
                    swept = settled_pss(proc.pid)
                    r["pss_after_sweep_kib"] = swept
                    r["bytes_per_consumer_after_sweep"] = round((swept - base) * 1024 / n)
                    r["reload_without"] = paced(6)
                    r["reload_during"] = paced(6, lambda: proc.send_signal(signal.SIGHUP))
                stop(proc)
                seed.wait_port_free(GATEWAY)
                out[system] = r
                print(f"{system}: {r}", file=sys.stderr)
            cpu = {(s, k): [] for s in ("tollgate", "nginx") for k in scripts}
            for rnd in range(args.rounds):
                for system in (("tollgate", "nginx") if rnd % 2 == 0 else ("nginx", "tollgate")):
                    proc, _ = start(system, big[system], tmp)
                    try:
                        order = ("uniform", "hot") if rnd % 2 == 0 else ("hot", "uniform")
                        for k in order:
                            res = cpu_run(proc, scripts[k], args)
                            cpu[(system, k)].append(res)
                            print(f"round {rnd + 1} {system} {k}: {res['rps']:.0f} req/s "
                                  f"{res['cpu_us']:.2f} µs CPU/req, busy {res['busy']:.2f}, "
                                  f"non-2xx {res['non2xx']}",
                                  file=sys.stderr)
                    finally:
                        stop(proc)
                        seed.wait_port_free(GATEWAY)
            for system in ("tollgate", "nginx"):
                med = {k: statistics.median(r["cpu_us"] for r in cpu[(system, k)]) for k in scripts}
                rps = {k: statistics.median(r["rps"] for r in cpu[(system, k)]) for k in scripts}
                out[system]["cpu_us_uniform"] = round(med["uniform"], 2)
                out[system]["cpu_us_hot"] = round(med["hot"], 2)
                out[system]["uniform_over_hot"] = round(med["uniform"] / med["hot"], 3)
                # Each round's two arms run back to back, so their ratio is less exposed to
                # the machine's drift over the whole run than the ratio of the medians.
                per_round = [u["cpu_us"] / h["cpu_us"] for u, h in zip(cpu[(system, "uniform")], cpu[(system, "hot")])]
                out[system]["uniform_over_hot_per_round"] = [round(r, 3) for r in per_round]
                out[system]["uniform_over_hot_median_of_rounds"] = round(statistics.median(per_round), 3)
                out[system]["rps_uniform"] = round(rps["uniform"])
                out[system]["rps_hot"] = round(rps["hot"])
                for k in scripts:
                    out[system][f"busy_{k}"] = round(statistics.median(r["busy"] for r in cpu[(system, k)]), 3)
                out[system]["non2xx"] = sum(r["non2xx"] for k in scripts for r in cpu[(system, k)])
    finally:
        stop(backend)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    sys.exit(main())
