"""capacity: hit-path requests/s of one instance beside a minimal axum
handler (constant body: the ceiling here) and one doing a Redis GET (the
baseline example), then requests/s and database reads from 1 to N instances
under a Zipf load (wrk-zipf.lua). Writes load/results/<date>/capacity.md."""

import os
import subprocess
import sys
import time
import urllib.request

from .. import kit
from ..db import CAPACITY_DB, post_reads, prepare_database
from ..flags import add_connections, add_seconds
from ..procs import spawn, stop, stop_all
from ..report import write_results
from ..runners import build, example, find_wrk, wrk_cmd, wrk_rps, wrk_run
from ..servers import start_baseline, start_instances


def add_parser(sub, common):
    s = sub.add_parser("capacity", parents=[common], help="hit-path ceiling and 1..N instances under wrk")
    add_seconds(s, 10)
    add_connections(s, what="wrk connections in all")
    s.add_argument("--instances", type=int, default=4, help="scale out from 1 to this many (default 4)")
    s.set_defaults(run=run)


def run(args):
    wrk = find_wrk()
    secs, conns = args.seconds, args.connections
    if secs < 1 or conns < max(2, args.instances):
        sys.exit("error: needs --seconds >= 1 and --connections >= max(2, --instances)")
    binary = build(args, "--example", "baseline")
    baseline = example("baseline")
    prepare_database(binary, CAPACITY_DB)
    env = dict(os.environ, MAX_ID=str(kit.SEEDED))

    def requests_per_s(output):
        rps = wrk_rps(output)
        if rps is None:
            sys.exit(f"error: no Requests/sec in wrk's output:\n{output[-2000:]}")
        return int(rps)

    def rps(url):
        return int(wrk_run(wrk, url, secs, conns, env=env)[0])

    lines = [f"# Capacity, {kit.DAY}", "",
             f"`load/compare capacity --seconds {secs} --connections {conns} --instances {args.instances}`, "
             f"{os.cpu_count()} cores, "
             "wrk on the same cores as the servers. Absolute numbers are bound to this machine: "
             "the ratios are the point.", "",
             f"## Hit path, one process, {conns} connections, {secs}s each (wrk, 2 threads)", "",
             "| handler | requests/s | relative |", "|---|---|---|"]
    kit.log("== hit path")
    bare = start_baseline(baseline)
    const = rps(bare + "/const")
    redis_get = rps(bare + "/redis-get")
    _, (url,) = start_instances(binary, CAPACITY_DB, 1, f"cap:hit:{time.time_ns()}:", stderr=subprocess.DEVNULL,
                                CACHE_TTL="60s", DB_MAX_CONNECTIONS="8")
    urllib.request.urlopen(url + "/posts/1", timeout=10).read()
    hit = rps(url + "/posts/1")
    stop_all()
    for name, v in [("axum, constant body (ceiling)", const), ("axum, one Redis GET", redis_get),
                    ("postcache GET /posts/1 (hit)", hit)]:
        lines.append(f"| {name} | {v} | {v / const:.2f} |")

    lines += ["", f"## Scaling out: Zipf(1.1) over {kit.SEEDED:,} posts, CACHE_TTL=5s, {secs}s, "
                  f"{conns} connections in all", "",
              "| instances | requests/s | database reads | reads per 1000 requests |", "|---|---|---|---|"]
    for k in range(1, args.instances + 1):
        kit.log(f"== {k} instance(s)")
        before = post_reads(CAPACITY_DB)
        procs, urls = start_instances(binary, CAPACITY_DB, k, f"cap:scale:{k}:{time.time_ns()}:",
                                      stderr=subprocess.DEVNULL, CACHE_TTL="5s", DB_MAX_CONNECTIONS="8")
        loads = [spawn(wrk_cmd(wrk, u, secs, conns // k, "-s", os.path.join(kit.LOAD, "wrk-zipf.lua"), threads=1),
                       env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for u in urls]
        total = sum(requests_per_s(p.communicate(timeout=secs + 60)[0]) for p in loads)
        stop(loads + procs)
        db = post_reads(CAPACITY_DB) - before
        lines.append(f"| {k} | {total} | {db} | {1000 * db / max(1, total * secs):.1f} |")
    write_results("capacity.md", "\n".join(lines + [""]))
