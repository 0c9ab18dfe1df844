"""peers: nginx (proxy_cache + proxy_cache_lock) and Varnish, each in front of
a CACHE_STRATEGY=none postcache, beside postcache with its memory tier on and
off: stampedes on 1 and 3 nodes, the hit path under wrk beside bare axum
handlers, Redis commands per request under Zipf(1.1). Writes
load/results/<date>/peers.md and peers.svg."""

import asyncio
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

from .. import kit
from ..db import PEERS_DB, post_reads, prepare_database, psql, redis_commands
from ..flags import add_connections, add_rounds, add_seconds
from ..procs import free_port, stop_all, temp_dir
from ..report import bar_chart, quantile, write_results
from ..runners import build, example, find_or_install, find_wrk, wrk_run
from ..servers import serve, start_baseline, start_instances, start_nginx

# nginx caching a backend's answers, one load at a time per key: the rest
# of the http block after servers.NGINX_MAIN.
NGINX_CONF = """\
    proxy_cache_path {dir}/cache levels=1:2 keys_zone=posts:16m max_size=256m inactive=10m use_temp_path=off;
    upstream backend {{ server 127.0.0.1:{backend}; keepalive 64; }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_cache posts;
            proxy_cache_lock on;
            proxy_cache_lock_timeout 10s;
            proxy_cache_lock_age 10s;
            proxy_cache_valid 200 404 60s;
            proxy_read_timeout 30s;
        }}
    }}
"""


def add_parser(sub, common):
    s = sub.add_parser("peers", parents=[common], help="nginx and Varnish beside postcache: stampede and hit path",
                       description="nginx (proxy_cache + proxy_cache_lock) and Varnish, each in front of a "
                                   "CACHE_STRATEGY=none postcache, beside postcache with its memory tier on and "
                                   "off: a stampede on 1 and 3 nodes (database reads counted by PostgreSQL, "
                                   "latency after the load's release), the hit path under wrk (with bare axum "
                                   "handlers for reference), and Redis commands per request under a Zipf load. "
                                   "nginx-light, varnish and wrk are installed with apt-get when missing. Writes "
                                   "load/results/<date>/peers.md and peers.svg.")
    add_rounds(s, 3, what="rounds of each stampede and hit-path run")
    s.add_argument("--requests", type=int, default=300, help="stampede: requests released together (default 300)")
    add_seconds(s, 8)
    add_connections(s)
    s.add_argument("--zipf-warmup", type=int, default=30, help="seconds of Zipf load before the measured run (default 30)")
    s.set_defaults(run=run)


class Peers:
    """Starts the nodes of one contender; each node is one port to send requests to.
    postcache nodes share one KEY_PREFIX; nginx and Varnish nodes each have a cache of
    their own in front of a CACHE_STRATEGY=none postcache of their own."""

    BACKEND = dict(CACHE_STRATEGY="none", DB_MAX_CONNECTIONS="16", DB_STATEMENT_TIMEOUT="20s", LOCK_TTL="30s")
    POSTCACHE = dict(DB_MAX_CONNECTIONS="16", DB_STATEMENT_TIMEOUT="20s", WAIT_TIMEOUT="20s",
                     LOCK_TTL="30s", CACHE_TTL="60s")

    def __init__(self, binary, tools, tmp):
        self.binary, self.tools, self.tmp = binary, tools, tmp

    def start(self, kind, k):
        """Ports of k nodes of kind: nginx, varnish, postcache, postcache-redis (memory tier off)."""
        if kind in ("postcache", "postcache-redis"):
            extra = {} if kind == "postcache" else {"L1_MAX_BYTES": "0"}
            _, urls = start_instances(self.binary, PEERS_DB, k, f"peers:{kind}:{time.time_ns()}:",
                                      stderr=subprocess.DEVNULL, **self.POSTCACHE, **extra)
            return [int(u.rsplit(":", 1)[1]) for u in urls]
        ports = []
        for i in range(k):
            _, (backend,) = start_instances(self.binary, PEERS_DB, 1, f"peers:backend:{time.time_ns()}:",
                                            stderr=subprocess.DEVNULL, **self.BACKEND)
            backend_port = int(backend.rsplit(":", 1)[1])
            port = free_port()
            d = tempfile.mkdtemp(prefix=f"{kind}-{i}-", dir=self.tmp)
            os.chmod(d, 0o777)
            if kind == "nginx":
                start_nginx(self.tools["nginx"], NGINX_CONF, d, port, workers=os.cpu_count(), backend=backend_port)
            else:
                serve([self.tools["varnishd"], "-F", "-a", f"127.0.0.1:{port}",
                       "-b", f"127.0.0.1:{backend_port}", "-n", d, "-s", "malloc,256m",
                       "-p", "default_ttl=60", "-p", "first_byte_timeout=30"], port, kind)
            ports.append(port)
        return ports


class HeldLoads:
    """Holds every load of posts back: a transaction holding an ACCESS EXCLUSIVE lock
    on the table, in a psql session of its own, until release()."""

    def __init__(self, db):
        self.proc = subprocess.Popen(["psql", f"{kit.DB_SERVER}/{db}", "-qAt"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.proc.stdin.write("begin; lock table posts in access exclusive mode; select 'locked';\n")
        self.proc.stdin.flush()
        if self.proc.stdout.readline().strip() != "locked":
            sys.exit("error: could not lock the posts table")

    def release(self):
        self.proc.stdin.write("commit;\n")
        self.proc.stdin.flush()
        released = time.monotonic()
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        return released


def blocked_loads(db):
    return int(psql(db, "select count(*) from pg_stat_activity where datname = current_database() "
                        "and wait_event_type = 'Lock' and pid <> pg_backend_pid()"))


async def stampede_requests(ports, n, post, db, expected_loads):
    """n requests for one cold post over the ports (round-robin), each on a connection of
    its own, sent while the loads are held; returns (statuses, seconds from the release
    to each answer, sorted)."""
    conns = []
    for i in range(n):
        conns.append(await asyncio.open_connection("127.0.0.1", ports[i % len(ports)]))
    held = HeldLoads(db)
    request = f"GET /posts/{post} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode()
    for _, writer in conns:
        writer.write(request)
    await asyncio.gather(*(w.drain() for _, w in conns))
    deadline = time.monotonic() + 20
    while blocked_loads(db) < expected_loads and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.5)  # every request read by its node and waiting
    released = held.release()

    async def answer(reader, writer):
        head = await asyncio.wait_for(reader.readline(), 30)
        done = time.monotonic()
        await reader.read()
        writer.close()
        parts = head.split()
        return (int(parts[1]) if len(parts) > 1 else 0), done - released

    out = await asyncio.gather(*(answer(r, w) for r, w in conns), return_exceptions=True)
    statuses = [o[0] if isinstance(o, tuple) else 0 for o in out]
    after = sorted(o[1] for o in out if isinstance(o, tuple))
    return statuses, after


def median(xs):
    """The upper median (the middle value of an odd count)."""
    return sorted(xs)[len(xs) // 2]


def mean(xs):
    return sum(xs) / len(xs)


def run(args):
    wrk = find_wrk()
    tools = {"nginx": find_or_install("nginx", "nginx-light"), "varnishd": find_or_install("varnishd", "varnish")}
    binary = build(args, "--example", "baseline")
    baseline = example("baseline")
    prepare_database(binary, PEERS_DB)
    tmp = temp_dir("postcache-peers-", mode=0o755)
    nodes = Peers(binary, tools, tmp)
    kinds = ["nginx", "varnish", "postcache-redis", "postcache"]
    names = {"nginx": "nginx proxy_cache + lock", "varnish": "Varnish",
             "postcache-redis": "postcache, Redis only (L1_MAX_BYTES=0)", "postcache": "postcache, memory tier"}

    # Stampedes: fresh nodes each time (cold caches); database reads from PostgreSQL.
    stampedes = {}
    post = 1000
    for k in (1, 3):
        for kind in kinds:
            for r in range(args.rounds):
                post += 1
                kit.log(f"== stampede: {kind}, {k} node(s), round {r + 1}")
                before = post_reads(PEERS_DB)
                ports = nodes.start(kind, k)
                loads = 1 if kind.startswith("postcache") else k
                statuses, after = asyncio.run(stampede_requests(ports, args.requests, post, PEERS_DB, loads))
                stop_all()
                reads = post_reads(PEERS_DB) - before
                row = stampedes.setdefault((kind, k), {"reads": [], "p50": [], "p99": [], "errors": 0})
                row["reads"].append(reads)
                row["p50"].append(quantile(after, 0.5) * 1e3)
                row["p99"].append(quantile(after, 0.99) * 1e3)
                row["errors"] += sum(1 for s in statuses if s != 200)

    # The hit path: one node each, warm, wrk alternating between contenders.
    kit.log("== hit path")
    targets = {}
    for kind in kinds:
        (port,) = nodes.start(kind, 1)
        targets[kind] = f"http://127.0.0.1:{port}/posts/1"
    bare = start_baseline(baseline)
    targets["axum-redis-get"] = bare + "/redis-get"
    targets["axum-const"] = bare + "/const"
    for url in targets.values():
        for _ in range(3):
            urllib.request.urlopen(url, timeout=10).read()

    hits = {name: [] for name in targets}
    for r in range(args.rounds):
        for name, url in targets.items():
            kit.log(f"   round {r + 1}: {name}")
            hits[name].append(wrk_run(wrk, url, args.seconds, args.connections)[0])
    stop_all()

    # Zipf(1.1) over the seeded posts: Redis commands per request, memory tier on and off.
    kit.log("== zipf: redis commands per request")
    zipf = {}
    for kind in ("postcache-redis", "postcache"):
        (port,) = nodes.start(kind, 1)
        url = f"http://127.0.0.1:{port}"
        wrk_run(wrk, url, args.zipf_warmup, args.connections, "-s", os.path.join(kit.LOAD, "wrk-zipf.lua"))
        before = redis_commands()
        rps, total = wrk_run(wrk, url, args.seconds, args.connections, "-s", os.path.join(kit.LOAD, "wrk-zipf.lua"))
        cmds = redis_commands() - before - 1
        zipf[kind] = (rps, total, cmds)
        stop_all()

    lines = [f"# Peers, {kit.DAY}", "",
             f"`load/compare peers --rounds {args.rounds} --requests {args.requests} --seconds {args.seconds} "
             f"--connections {args.connections}`, {os.cpu_count()} cores, one PostgreSQL, one Redis; wrk and the "
             "stampede's client on the same cores as the servers. nginx (proxy_cache, proxy_cache_lock) and "
             "Varnish (its default VCL: request coalescing) each cache in front of a CACHE_STRATEGY=none "
             "postcache that queries per request. Absolute numbers are bound to this machine: the ratios "
             "are the point.", "",
             f"## Stampede: {args.requests} requests for one cold post, released together", "",
             "The loads are held by a lock on the table until every request is in; database reads are "
             "PostgreSQL's own counts; latency runs from the lock's release to each answer's status line "
             f"(client included). Median of {args.rounds} rounds (reads: every round).", "",
             "| contender | nodes | database reads | p50 ms | p99 ms | errors |", "|---|---|---|---|---|---|"]
    for k in (1, 3):
        for kind in kinds:
            row = stampedes[(kind, k)]
            lines.append(f"| {names[kind]} | {k} | {' '.join(map(str, row['reads']))} | {median(row['p50']):.1f} | "
                         f"{median(row['p99']):.1f} | {row['errors']} |")
    fastest_peer = max(mean(hits["nginx"]), mean(hits["varnish"]))
    lines += ["", f"## Hit path: one warm post, one node, wrk -t2 -c{args.connections} -d{args.seconds}s", "",
              f"Mean of {args.rounds} rounds, the contenders alternating.", "",
              "| handler | requests/s | rounds | × the faster peer |", "|---|---|---|---|"]
    hit_names = dict(names, **{"axum-redis-get": "bare axum handler, one Redis GET",
                               "axum-const": "bare axum handler, constant body (ceiling)"})
    for name in ["nginx", "varnish", "postcache", "postcache-redis", "axum-redis-get", "axum-const"]:
        lines.append(f"| {hit_names[name]} | {mean(hits[name]):.0f} | {' '.join(f'{v:.0f}' for v in hits[name])} | "
                     f"{mean(hits[name]) / fastest_peer:.2f} |")
    memory_ratio = mean(hits["postcache"]) / fastest_peer
    redis_ratio = mean(hits["postcache-redis"]) / mean(hits["axum-redis-get"])
    lines += ["", "## Budget", "", "| target | measured | goal |", "|---|---|---|",
              f"| memory-tier hits ÷ the faster of nginx and Varnish | {memory_ratio:.2f} | ≥ 1.30 |",
              f"| Redis-tier hits ÷ a bare axum handler doing one Redis GET | {redis_ratio:.2f} | ≥ 0.90 |"]
    for kind in ("postcache-redis", "postcache"):
        rps, total, cmds = zipf[kind]
        label = "on" if kind == "postcache" else "off"
        lines.append(f"| Redis commands per request, Zipf(1.1) over {kit.SEEDED:,} posts, memory tier {label} "
                     f"({total} requests, {cmds} commands, {rps:.0f} req/s) | {cmds / total:.3f} | "
                     f"{'≤ 0.2' if label == 'on' else '(reference)'} |")
    lines += ["", f"The Zipf runs follow a {args.zipf_warmup} s warm-up on the same instance (CACHE_TTL=60s).",
              "", "![stampede and hit path, per contender](peers.svg)", ""]
    chart(kinds, names, stampedes, hits, os.path.join(kit.RESULTS, "peers.svg"))
    write_results("peers.md", "\n".join(lines))


def chart(kinds, names, stampedes, hits, path):
    """Three panels: database reads and p99 after the release on 3 nodes, hit requests/s."""
    panels = [("stampede on 3 nodes: database reads", [median(stampedes[(k, 3)]["reads"]) for k in kinds], "{:.0f}",
               False),
              ("stampede on 3 nodes: p99 after the release (ms)", [median(stampedes[(k, 3)]["p99"]) for k in kinds],
               "{:.1f}", False),
              ("hit path: requests/s, one node", [sum(hits[k]) / len(hits[k]) for k in kinds], "{:.0f}", False)]
    labels = []
    for kind in kinds:
        label = names[kind].split(",")[0] if kind != "postcache-redis" else "postcache (Redis only)"
        labels.append("postcache (memory)" if kind == "postcache" else label)
    bar_chart(path, panels, labels, [kind == "postcache" for kind in kinds], height=260)
