"""staleness-flood: a flood of `PostCache-Max-Staleness: 0ms` on one post
beside cold readers, what it costs PostgreSQL, and what the readers see.
Writes load/results/<date>/staleness-flood.md (or --out)."""

import os
import subprocess
import sys
import time
import urllib.request

from .. import kit
from ..cpu import cpu_seconds
from ..db import CAPACITY_DB, prepare_database, psql
from ..flags import add_connections, add_out, add_rounds, add_seconds
from ..procs import spawn, stop_all
from ..report import spread, write_results
from ..runners import find_wrk, this_and_old, wrk_cmd, wrk_latency, wrk_rps, wrk_total
from ..servers import metric_sums, start_instances


def add_parser(sub, common):
    s = sub.add_parser("staleness-flood", parents=[common],
                       help="a PostCache-Max-Staleness: 0ms flood on one post beside cold readers",
                       description="A flood of `PostCache-Max-Staleness: 0ms` reads of one post (wrk -t1) beside "
                                   "cold readers (wrk -t1 -c16, every request a different post), against one "
                                   "instance with the replication feed; with --old, another binary in the same "
                                   "rounds. Reports the flood's answers, the rows and statements it cost "
                                   "PostgreSQL, and the cold readers' failures and p99. Writes "
                                   "load/results/<date>/staleness-flood.md (or --out).")
    s.add_argument("--old", help="another binary to run the same rounds with")
    add_out(s, "staleness-flood.md")
    add_rounds(s, 2)
    add_seconds(s, 6, what="seconds per run")
    add_connections(s, what="flood connections")
    s.set_defaults(run=run)


def non_2xx(out):
    """wrk's count of answers other than 2xx or 3xx, and of socket errors."""
    bad = 0
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("Non-2xx or 3xx responses:"):
            bad += int(line.split(":")[1])
        elif line.startswith("Socket errors:"):
            # connect N, read N, write N, timeout N
            bad += sum(int(part.split()[1]) for part in line.split(":", 1)[1].split(","))
    return bad


def counts(db):
    """Statements ended in db so far (each of the service's is a transaction
    of its own) and rows of posts fetched by index, once every backend of
    the service has exited (they flush their statistics then)."""
    deadline = time.time() + 20
    while int(psql(db, "select count(*) from pg_stat_activity where datname = current_database() "
                       "and application_name like 'postcache%' and pid <> pg_backend_pid()")) > 0:
        if time.time() > deadline:
            sys.exit("error: service backends did not exit")
        time.sleep(0.05)
    ended = int(psql(db, "select xact_commit + xact_rollback from pg_stat_database "
                         "where datname = current_database()"))
    rows = int(psql(db, "select coalesce(sum(coalesce(idx_tup_fetch, 0)), 0) from pg_stat_user_tables "
                        "where relname in ('posts', 'posts_data')"))
    return ended, rows


def one_run(wrk, binary, r, secs, connections):
    """One instance on a fresh prefix: warm post 1, then the flood beside the
    cold readers. Returns the run's figures."""
    # PostgreSQL's counts are exact once the backends that made them exited:
    # read before the instance starts (its start and warm-up count too, a
    # few statements and scans against tens of thousands of requests).
    statements_before, rows_before = counts(CAPACITY_DB)
    procs, (url,) = start_instances(binary, CAPACITY_DB, 1, f"staleness:{time.time_ns()}:",
                                stderr=subprocess.DEVNULL, CACHE_TTL="600s", CHANGE_FEED="replication")
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            ready = urllib.request.urlopen(url + "/readyz", timeout=2).read().decode()
            if '"read_your_writes":"cache"' in ready:
                break
        except OSError:
            pass
        time.sleep(0.1)
    for _ in range(2):
        urllib.request.urlopen(url + "/posts/1", timeout=5).read()
    pid = str(procs[0].pid)
    cpu_before = cpu_seconds()
    flood = spawn(wrk_cmd(wrk, url + "/posts/1", secs, connections, "--latency", "-H",
                          "PostCache-Max-Staleness: 0ms", threads=1),
                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    cold = subprocess.run(wrk_cmd(wrk, url, secs, 16, "--latency", "-s", os.path.join(kit.LOAD, "wrk-cold.lua"),
                                  threads=1),
                          env=dict(os.environ, FIRST_ID=str(2 + r * 50_000)), capture_output=True, text=True,
                          timeout=secs + 60)
    flood_out = flood.communicate(timeout=secs + 60)[0]
    cpu_after = cpu_seconds()
    metrics = metric_sums(url)
    stop_all()
    ended, rows = counts(CAPACITY_DB)
    ended, rows = ended - statements_before, rows - rows_before
    cold_out = cold.stdout + cold.stderr
    flood_total, cold_total = wrk_total(flood_out) or 0, wrk_total(cold_out) or 0
    # Each cold read fetches one row (a different post each): the rest is
    # the flood's (and the warm-up's one). The flood's statements are its
    # rounds and its reads past the cache; statements are also counted in
    # all, cold reads' loads (batched) included.
    return {
        "flood_rps": wrk_rps(flood_out) or 0.0,
        "flood_total": flood_total,
        "flood_bad": non_2xx(flood_out),
        "flood_rows": max(rows - cold_total, 0),
        "statements": ended,
        "rounds": metrics.get("postcache_primary_position_reads_total", 0.0),
        "cold_rps": wrk_rps(cold_out) or 0.0,
        "cold_total": cold_total,
        "cold_bad": non_2xx(cold_out),
        "cold_p99": wrk_latency(cold_out).get("99%"),
        "instance_cpu": cpu_after.get(pid, 0.0) - cpu_before.get(pid, 0.0),
        "postgres_cpu": cpu_after["postgres"] - cpu_before["postgres"],
    }


def flood_statements(f):
    """The flood's statements: its rounds, and a statement per row it read
    past the cache (at most)."""
    return f["rounds"] + f["flood_rows"]


def run(args):
    """The flood beside cold readers, for this build and (--old) another,
    alternating which goes first, each run on a fresh KEY_PREFIX."""
    wrk = find_wrk()
    new, binaries = this_and_old(args)
    prepare_database(new, CAPACITY_DB)
    secs = args.seconds
    lines = [f"# A `PostCache-Max-Staleness: 0ms` flood on one post beside cold readers, {kit.DAY}", "",
             f"`load/compare staleness-flood --rounds {args.rounds} --seconds {secs}"
             f"{' --old <binary>' if args.old else ''}`, {os.cpu_count()} cores. One instance "
             f"(CHANGE_FEED=replication, CACHE_TTL=600s), {kit.SEEDED:,} posts, each run a fresh KEY_PREFIX. "
             f"The flood: wrk -t1 -c{args.connections} on `/posts/1` with `PostCache-Max-Staleness: 0ms`; beside "
             f"it, cold readers: wrk -t1 -c16, `wrk-cold.lua` (every request a different post), for {secs} s. "
             "Rows and statements are PostgreSQL's own counts (idx_tup_fetch of posts, pg_stat_database), read "
             "before the instance started and once its backends exited: its start and warm-up count too. The "
             "flood's rows: all rows less one per cold read. The flood's statements: its rounds (the primary's "
             "position, `postcache_primary_position_reads_total`) and its rows; statements in all: every "
             "statement of the run (cold loads included) per request of the run. CPU: the instance's and "
             "every postgres process's, per request (the flood's and the cold readers' together).", "",
             "| binary | round | flood req/s | flood not 200 | flood rows/s | rounds | flood statements per flood request | "
             "statements per request in all | "
             "cold reads/s | cold failures | cold p99 | instance CPU µs/req | postgres CPU µs/req |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    got = {name: [] for name, _ in binaries}
    for r in range(args.rounds):
        order = binaries if r % 2 == 0 else list(reversed(binaries))
        for name, binary in order:
            kit.log(f"== round {r + 1}: {name}")
            f = one_run(wrk, binary, r, secs, args.connections)
            got[name].append(f)
            reqs = max(f["flood_total"] + f["cold_total"], 1)
            lines.append(
                f"| {name} | {r + 1} | {f['flood_rps']:.0f} | {f['flood_bad']} of {f['flood_total']} | "
                f"{f['flood_rows'] / secs:.1f} | {f['rounds']:.0f} | "
                f"{flood_statements(f) / max(f['flood_total'], 1):.3f} | {f['statements'] / reqs:.3f} | "
                f"{f['cold_rps']:.0f} | {f['cold_bad']} | "
                f"{f['cold_p99'] if f['cold_p99'] is not None else float('nan'):.1f} ms | "
                f"{f['instance_cpu'] / reqs * 1e6:.0f} | {f['postgres_cpu'] / reqs * 1e6:.0f} |")
    lines += [""]
    for name, runs in got.items():
        lines.append(f"- {name}: rows/s {spread([x['flood_rows'] / secs for x in runs], '.1f')}, "
                     f"flood statements per flood request "
                     f"{spread([flood_statements(x) / max(x['flood_total'], 1) for x in runs], '.3f')}, "
                     f"statements per request in all "
                     f"{spread([x['statements'] / max(x['flood_total'] + x['cold_total'], 1) for x in runs], '.3f')}, "
                     f"cold p99 {spread([x['cold_p99'] or 0.0 for x in runs], '.1f')} ms")
    lines += [""]
    write_results(args.out or "staleness-flood.md", "\n".join(lines))
