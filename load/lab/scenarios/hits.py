"""hits: one warm post, postcache's memory tier and Redis tier beside nginx's
`return 200` and a plain hyper server of the same body (the ceilings), wrk
alternating round by round; requests/s and the server's CPU per request;
--pin for disjoint cores. Writes load/results/<date>/hits.md."""

import os
import statistics
import subprocess
import sys
import time
import urllib.request

from .. import kit
from ..cpu import children_cpu, pinning, tree_cpu
from ..db import CAPACITY_DB, prepare_database
from ..flags import add_connections, add_out, add_post, add_rounds, add_seconds
from ..procs import free_port, temp_dir
from ..report import write_results
from ..runners import build_with_example, find_or_install, find_wrk, rotated, wrk_run
from ..servers import serve, start_instances, start_nginx

# nginx answering the post's body, constant, to every request: the rest of
# the http block after servers.NGINX_MAIN.
NGINX_CONST = """\
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            default_type application/json;
            add_header x-cache hit;
            add_header x-cache-tier memory;
            add_header cache-control "public, max-age=59";
            add_header age 0;
            add_header etag '"c63a3b31eb35be46"';
            return 200 '{body}';
        }}
    }}
"""


def add_parser(sub, common):
    s = sub.add_parser("hits", parents=[common], help="hits against nginx's and hyper's constant body",
                       description="One warm post: postcache's memory tier and Redis tier beside nginx's `return "
                                   "200` and a plain hyper server (examples/ceiling.rs) answering the same body, "
                                   "wrk visiting each in turn round by round; requests/s and the server's CPU per "
                                   "request. Installs nginx-light with apt-get when missing. Writes "
                                   "load/results/<date>/hits.md (or --out).")
    add_rounds(s, 5)
    add_seconds(s, 5)
    add_connections(s)
    add_post(s)
    s.add_argument("--pin", action="store_true",
                   help="8 or more cores: the servers, Redis, PostgreSQL and wrk on disjoint cores (taskset)")
    add_out(s, "hits.md")
    s.set_defaults(run=run)


def run(args):
    """One warm post read over and over by wrk: postcache's memory tier and
    Redis tier beside the ceilings of an HTTP/1.1 server, nginx's `return
    200` and a plain hyper server (examples/ceiling.rs), each answering the
    same body with the same headers. Every server runs throughout; wrk
    visits them in turn, round by round, the order rotating. The server's
    CPU per request is its CPU time (and its children's) over the run ÷ the
    requests."""
    wrk = find_wrk()
    binary, ceiling = build_with_example(args, "ceiling")
    nginx = find_or_install("nginx", "nginx-light")
    pin, under = pinning(args.pin, "hits")
    workers = len(pin.groups["instance"]) if pin else os.cpu_count()
    threads = len(pin.groups["wrk"]) if pin else 2
    prepare_database(binary, CAPACITY_DB)
    tmp = temp_dir("hits-", mode=0o777)

    urls, pids = {}, {}
    for name, settings in (("postcache, memory tier", {}), ("postcache, Redis tier", {"L1_MAX_BYTES": "0"})):
        procs, (url,) = start_instances(binary, CAPACITY_DB, 1, f"hits:{time.time_ns()}:", under=under("instance"),
                                        stderr=subprocess.DEVNULL, CACHE_TTL="600s", L1_TTL="600s", **settings)
        urls[name], pids[name] = url + f"/posts/{args.post}", procs[0].pid
    body = urllib.request.urlopen(urls["postcache, memory tier"], timeout=10).read()
    if any(c in body for c in (b"'", b"$", b"\\")):
        sys.exit(f"error: post {args.post}'s body has a character nginx's return would need escaped: pick another")
    with open(os.path.join(tmp, "body.json"), "wb") as f:
        f.write(body)
    port = free_port()
    proc = serve([*under("instance"), ceiling, f"127.0.0.1:{port}", os.path.join(tmp, "body.json")], port,
                 "the hyper ceiling")
    urls["hyper, constant body"], pids["hyper, constant body"] = f"http://127.0.0.1:{port}/posts/{args.post}", proc.pid
    port = free_port()
    proc = start_nginx(nginx, NGINX_CONST, tmp, port, under=under("instance"), workers=workers, body=body.decode())
    urls["nginx, return 200"], pids["nginx, return 200"] = f"http://127.0.0.1:{port}/posts/{args.post}", proc.pid
    for name, url in urls.items():
        urllib.request.urlopen(url, timeout=10).read()  # the postcache ones: a miss, then hits
        with urllib.request.urlopen(url, timeout=10) as r:
            got = r.read()
            tier = r.headers.get("x-cache-tier")
        if got != body:
            sys.exit(f"error: {name} answered another body")
        if name.startswith("postcache") and tier != name.split(", ")[1].split()[0].lower():
            sys.exit(f"error: {name} answered from {tier}: warm it first")

    names = ["nginx, return 200", "hyper, constant body", "postcache, memory tier", "postcache, Redis tier"]
    rows = {name: [] for name in names}
    for r in range(args.rounds):
        for name in rotated(names, r):
            kit.log(f"== round {r + 1}: {name}")
            before, children = tree_cpu(pids[name]), os.times()
            rps, total = wrk_run(wrk, urls[name], args.seconds, args.connections, threads=threads,
                                 prefix=under("wrk"))
            after, done = tree_cpu(pids[name]), os.times()
            wrk_cpu = children_cpu(children, done)
            rows[name].append(dict(rps=rps, server=(after - before) * 1e6 / total, wrk=wrk_cpu * 1e6 / total))
    where = f"pinned: {pin.describe()}" if pin else f"every process sharing the {os.cpu_count()} cores"
    lines = [f"# Hits, {kit.DAY}", "",
             f"`load/compare hits --rounds {args.rounds} --seconds {args.seconds}{' --pin' if pin else ''}`, "
             f"{os.cpu_count()} cores, {where}. One warm post ({len(body)} bytes), wrk -t{threads} "
             f"-c{args.connections} for {args.seconds} s per run, the servers visited in turn round by round. "
             f"nginx: {workers} workers, `return 200` of the same body with the same headers; hyper: "
             "examples/ceiling.rs, the same. Server CPU: the process's CPU time (nginx's with its workers') over "
             "the run ÷ its requests; wrk's likewise.", "",
             "| server | requests/s by round | median | ÷ nginx (paired median) | server CPU µs per request | "
             "wrk CPU µs per request |", "|---|---|---|---|---|---|"]
    base = [row["rps"] for row in rows["nginx, return 200"]]
    for name in names:
        rps = [row["rps"] for row in rows[name]]
        ratio = statistics.median(row["rps"] / b for row, b in zip(rows[name], base))
        lines.append(f"| {name} | {', '.join(f'{v:,.0f}' for v in rps)} | {statistics.median(rps):,.0f} | "
                     f"{ratio:.2f} | {statistics.median(row['server'] for row in rows[name]):.1f} | "
                     f"{statistics.median(row['wrk'] for row in rows[name]):.1f} |")
    hyper = statistics.median(row["server"] for row in rows["hyper, constant body"])
    lines += ["", "Server CPU per request ÷ hyper's (medians): " + ", ".join(
        f"{name} {statistics.median(row['server'] for row in rows[name]) / hyper:.2f}" for name in names), ""]
    write_results(args.out or "hits.md", "\n".join(lines))
