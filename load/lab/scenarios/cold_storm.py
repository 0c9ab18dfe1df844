"""cold-storm: cold misses of one instance, every request a distinct post of
a 1,000,000-post table (a permutation: no id twice): CACHE_STRATEGY=none (a
statement per request) against the default and naive, side by side round by
round. Writes load/results/<date>/cold-storm.md."""

import collections
import math
import os
import random
import subprocess
import time

from .. import kit
from ..cpu import children_cpu, cpu_seconds, pinning
from ..db import COLD_DB, drop_prefix, ensure_seeded, psql, redis_commandstats, transactions
from ..flags import add_connections, add_out, add_rounds, add_seconds
from ..procs import stop
from ..report import spread, write_results
from ..runners import build, find_wrk, rotated, wrk_cmd, wrk_latency, wrk_run, wrk_total
from ..servers import metric_sums, start_instances


def add_parser(sub, common):
    s = sub.add_parser("cold-storm", parents=[common], help="cold misses: none against the default and naive",
                       description="Cold misses of one instance (every request a distinct post, a permutation "
                                   "of --range ids; --uniform draws them at random): CACHE_STRATEGY=none against "
                                   "the default and naive, and with --old another binary's default, side by side "
                                   "round by round. Prints requests/s, statements, Redis round trips, commands "
                                   "and µs per request by command, and the CPU per request of each process. "
                                   "Writes load/results/<date>/cold-storm.md (or --out).")
    s.add_argument("--old", help="another binary whose default strategy runs beside")
    s.add_argument("--pin", action="store_true",
                   help="8 or more cores: PostgreSQL, Redis, the instance and wrk on disjoint cores (taskset)")
    s.add_argument("--uniform", action="store_true", help="ids drawn uniformly at random, not a permutation")
    s.add_argument("--batching-off", action="store_true", help="also the default with load batching off")
    add_out(s, "cold-storm.md")
    add_rounds(s, 3)
    add_seconds(s, 8, what="seconds per storm")
    s.add_argument("--latency-seconds", type=int, default=3, help="seconds one request at a time (default 3)")
    add_connections(s)
    s.add_argument("--posts", type=int, default=1_000_000, help="posts seeded (default 1,000,000)")
    s.add_argument("--range", type=int, default=0, help="ids asked, from 1 (default: every post)")
    s.set_defaults(run=run)


def coprime_step(n):
    """A step near n/φ coprime to n: i ↦ i*step mod n is a permutation of 0..n-1
    whose neighbours land far apart."""
    step = max(1, int(n / 1.6180339887))
    while math.gcd(step, n) != 1:
        step += 1
    return step


def run(args):
    """Cold misses: CACHE_STRATEGY=none against the default and naive (and,
    with --old, another binary's default), one instance at a time on a fresh
    KEY_PREFIX, the order rotating round by round. By default every request
    of a round is a distinct id (a permutation of the range, `wrk-distinct.lua`),
    so every request is a cold miss; --uniform draws them at random instead.
    Statements are counted by PostgreSQL (transactions of the database),
    Redis round trips by the instance (postcache_redis_calls_total), Redis
    commands and their µs by Redis (INFO commandstats, scripts' inner
    commands included), CPU by the kernel (/proc) per process."""
    wrk = find_wrk()
    new = build(args)
    pin, under = pinning(args.pin)
    configs = [("none", new, {"CACHE_STRATEGY": "none"}), ("default", new, {}),
               ("naive", new, {"CACHE_STRATEGY": "naive"})]
    if args.batching_off:
        configs.append(("default, batching off", new, {"LOAD_BATCH_MAX": "1", "LOAD_STATEMENTS": "16"}))
    if args.old:
        configs.append(("old default", os.path.abspath(args.old), {}))
    ensure_seeded(new, COLD_DB, args.posts)
    psql(COLD_DB, "vacuum analyze posts")
    secs, conns = args.seconds, args.connections
    span_ids = args.range or args.posts
    if args.uniform:
        script, wenv = os.path.join(kit.LOAD, "wrk-random.lua"), dict(os.environ, FIRST_ID="1", RANGE=str(span_ids))
    else:
        script = os.path.join(kit.LOAD, "wrk-distinct.lua")
        wenv = dict(os.environ, FIRST_ID="1", RANGE=str(span_ids), STEP=str(coprime_step(span_ids)),
                    THREADS="2")
    rows = {name: [] for name, _, _ in configs}
    for r in range(args.rounds):
        for name, binary, settings in rotated(configs, r):
            kit.log(f"== round {r + 1}: {name}")
            xact = transactions(COLD_DB)
            stats = redis_commandstats()
            prefix = f"cold:{time.time_ns()}:"
            procs, (url,) = start_instances(binary, COLD_DB, 1, prefix, under=under("instance"),
                                            stderr=subprocess.DEVNULL, CACHE_TTL="600s",
                                            CHANGE_FEED="off", **settings)
            # Each run its own stretch of the permutation (the pages PostgreSQL
            # reads differ run by run as well as the keys).
            run_env = dict(wenv, OFFSET=str(random.randrange(span_ids)))
            before, children, t0 = cpu_seconds(), os.times(), time.monotonic()
            rps, total = wrk_run(wrk, url, secs, conns, "-s", script, env=run_env, prefix=under("wrk"))
            wall, after, done = time.monotonic() - t0, cpu_seconds(), os.times()
            if not args.uniform and total > span_ids:
                kit.log(f"warning: {total:,} requests over {span_ids:,} ids: some ids were asked twice")
            pid = str(procs[0].pid)
            cpu = {part: after[part] - before[part] for part in ("postgres", "redis", "all")}
            cpu["instance"] = after[pid] - before[pid]
            cpu["wrk"] = children_cpu(children, done)
            cpu["rest"] = cpu["all"] - cpu["instance"] - cpu["postgres"] - cpu["redis"] - cpu["wrk"]
            storm_stats = redis_commandstats()
            m = metric_sums(url)
            # One request at a time, on ids the storm did not ask.
            one = subprocess.run(wrk_cmd(wrk, url, args.latency_seconds, 1, "--latency", "-s", script, threads=1,
                                         prefix=under("wrk")),
                                 env=dict(run_env, REVERSE="1", THREADS="1"),
                                 capture_output=True, text=True, timeout=args.latency_seconds + 60).stdout
            stop(procs)
            statements = transactions(COLD_DB) - xact
            drop_prefix(prefix)
            commands = {c: (calls - stats.get(c, (0, 0))[0], us - stats.get(c, (0, 0))[1])
                        for c, (calls, us) in storm_stats.items()}
            rows[name].append(dict(rps=rps, total=total, statements=statements, wall=wall,
                                   loads=m["postcache_db_loads_total"],
                                   calls=m["postcache_redis_calls_total"],
                                   commands={c: v for c, v in commands.items() if v[0] > 0},
                                   one=wrk_latency(one), cpu=cpu, one_total=wrk_total(one) or 0))
    ids = ("a post drawn uniformly from" if args.uniform
           else "a distinct post (a permutation of") + f" {span_ids:,} ids" + ("" if args.uniform else ")")
    where = (f"pinned: {pin.describe()}" if pin else "every process sharing the cores")
    lines = [f"# Cold storm, {kit.DAY}", "",
             f"`load/compare cold-storm --rounds {args.rounds} --seconds {secs}"
             f"{' --uniform' if args.uniform else ''}{' --pin' if pin else ''}"
             f"{' --batching-off' if args.batching_off else ''}{' --old <binary>' if args.old else ''}`, "
             f"{os.cpu_count()} cores, {where}. One instance, CHANGE_FEED=off, {args.posts:,} posts; each run a "
             f"fresh KEY_PREFIX and wrk -t2 -c{conns} for {secs} s, every request {ids}, then "
             f"{args.latency_seconds} s one request at a time (wrk -c1, ids the storm did not ask). Statements: "
             "transactions of the database counted by PostgreSQL (the latency run's included) per request of "
             "both runs; Redis round trips: commands and scripts the instance sent; Redis commands: "
             "INFO commandstats (the storm's), scripts' inner commands included.", "",
             "| configuration | round | requests/s | ÷ none | statements per request | "
             "Redis round trips per request | Redis commands per request | one at a time p50 / p99 ms |",
             "|---|---|---|---|---|---|---|---|"]
    base = [row["rps"] for row in rows["none"]]
    for name, _, _ in configs:
        for r, row in enumerate(rows[name]):
            lat = row["one"]
            all_requests = row["total"] + row["one_total"]
            commands = sum(calls for calls, _ in row["commands"].values())
            lines.append(f"| {name} | {r + 1} | {row['rps']:.0f} | {row['rps'] / base[r]:.2f} | "
                         f"{row['statements'] / all_requests:.3f} | {row['calls'] / all_requests:.2f} | "
                         f"{commands / row['total']:.2f} | {lat.get('50%', 0):.2f} / {lat.get('99%', 0):.2f} |")
    lines += ["", "CPU per request of the storm (µs of CPU time over the wrk run ÷ its requests): the "
              "instance, every postgres process, redis-server, wrk, and the rest of the machine's busy time "
              "(the kernel's own work, anything else). Busy cores: each part's CPU time ÷ the run's wall time."
              + ("" if pin else f" Every part shares the machine's {os.cpu_count()} cores, so at saturation a "
                 f"configuration serves about {os.cpu_count() * 1_000_000} ÷ its `all` requests/s."), "",
              "| configuration | round | instance | postgres | redis | wrk | rest | all | busy cores: "
              "instance / postgres / redis / wrk |", "|---|---|---|---|---|---|---|---|---|"]
    for name, _, _ in configs:
        for r, row in enumerate(rows[name]):
            per = {part: used * 1e6 / row["total"] for part, used in row["cpu"].items()}
            busy = {part: used / row["wall"] for part, used in row["cpu"].items()}
            lines.append(f"| {name} | {r + 1} | {per['instance']:.0f} | {per['postgres']:.0f} | "
                         f"{per['redis']:.0f} | {per['wrk']:.0f} | {per['rest']:.0f} | {per['all']:.0f} | "
                         f"{busy['instance']:.2f} / {busy['postgres']:.2f} / {busy['redis']:.2f} / "
                         f"{busy['wrk']:.2f} |")
    lines += ["", "Redis commands per request of the storm, by command (all rounds summed; calls, and the µs "
              "Redis spent in them, from INFO commandstats; a script's µs include its inner commands'):", ""]
    for name, _, _ in configs:
        total = sum(row["total"] for row in rows[name])
        summed = collections.Counter()
        for row in rows[name]:
            for c, (calls, us) in row["commands"].items():
                summed[c, "calls"] += calls
                summed[c, "us"] += us
        parts = sorted({c for c, _ in summed}, key=lambda c: -summed[c, "calls"])
        shown = ", ".join(f"{c} {summed[c, 'calls'] / total:.2f} ({summed[c, 'us'] / total:.1f} µs)"
                          for c in parts if summed[c, "calls"] / total >= 0.005)
        lines.append(f"- {name}: {shown or 'none'}")
    lines.append("")
    base_cpu = [row["cpu"]["all"] / row["total"] for row in rows["none"]]
    for name, _, _ in configs[1:]:
        ratios = [row["rps"] / b for row, b in zip(rows[name], base)]
        lines.append(f"{name} ÷ none, cold requests/s paired by round: {spread(ratios)}  ")
        ratios = [b / (row["cpu"]["all"] / row["total"]) for row, b in zip(rows[name], base_cpu)]
        lines.append(f"none's CPU per request ÷ {name}'s, paired by round: {spread(ratios)}  ")
    lines.append("")
    write_results(args.out or "cold-storm.md", "\n".join(lines))
