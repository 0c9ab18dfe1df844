"""strategies (the default): every read strategy (none, naive, local, poll,
pubsub) side by side, K instances of the release binary per strategy against
the same PostgreSQL and Redis, stampede.js and expiry-storm.js under k6.
Writes load/results/<date>/summary.md and chart.svg."""

import json
import os
import subprocess
import sys
import time

from .. import kit
from ..db import STRATEGIES_DB, post_reads, prepare_database, redis_commands, restore_database, slow_database
from ..procs import stop, stop_all
from ..report import bar_chart, write_results
from ..runners import build, find_k6
from ..servers import start_instances


def add_parser(sub, common):
    s = sub.add_parser("strategies", parents=[common], help="every read strategy side by side under k6 (default)")
    s.add_argument("--instances", type=int, default=4, help="instances per strategy (default 4)")
    s.add_argument("--vus", type=int, default=1000, help="stampede: requests released together (default 1000)")
    s.add_argument("--storm-rate", type=int, default=500, help="expiry-storm: requests/s (default 500)")
    s.add_argument("--storm-seconds", type=int, default=20, help="expiry-storm: duration in s (default 20)")
    s.add_argument("--strategies", default="none,naive,local,poll,pubsub", help="comma-separated, in table order")
    s.add_argument("--load-ms", type=int, default=20,
                   help="how long each database load takes (a slow view; 0 = the plain table)")
    s.set_defaults(run=run)


def run(args):
    k6 = find_k6()
    binary = build(args)
    prepare_database(binary, STRATEGIES_DB)
    slow_database(STRATEGIES_DB, args.load_ms)
    raw_dir = os.path.join(kit.RESULTS, "raw")
    os.makedirs(raw_dir, exist_ok=True)
    rows = []
    try:
        for strategy in args.strategies.split(","):
            kit.log(f"== {strategy}")
            stampede = scenario(k6, binary, args, strategy, "stampede.js", {"VUS": str(args.vus)}, raw_dir)
            storm = scenario(k6, binary, args, strategy, "expiry-storm.js",
                             {"RATE": str(args.storm_rate), "DURATION": f"{args.storm_seconds}s"}, raw_dir)
            rows.append({"strategy": strategy, "stampede": stampede, "storm": storm})
    finally:
        stop_all()  # before the DDL, which would wait for their queries
        restore_database(STRATEGIES_DB)

    def mix(m):
        return " ".join(f"{k} {v}" for k, v in m.items() if v)

    lines = [
        f"# Strategy comparison, {kit.DAY}",
        "",
        f"{args.instances} instances, one PostgreSQL, one Redis, {os.cpu_count()} cores. "
        f"stampede: {args.vus} requests released together on one cold post. expiry-storm: "
        f"{args.storm_rate} requests/s for {args.storm_seconds} s on 20 hot posts with CACHE_TTL=2s. "
        f"Each database load takes {args.load_ms} ms (a slow view stands in for a heavier query). "
        "Database reads are PostgreSQL's own counts; Redis commands are INFO commandstats deltas. "
        "Absolute numbers are bound to this machine: the ratios are the point.",
        "",
        "| strategy | scenario | requests | errors | db reads | redis cmds | cmds/request | p50 ms | p95 ms | p99 ms | X-Cache |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for name in ["stampede", "storm"]:
            f = r[name]
            per = f["redis"] / f["requests"] if f["requests"] else 0
            lines.append(
                f"| {r['strategy']} | {name} | {f['requests']} | {f['errors']} | {f['db']} | {f['redis']} | "
                f"{per:.2f} | {f['p50']:.1f} | {f['p95']:.1f} | {f['p99']:.1f} | {mix(f['mix'])} |")
    lines += ["", "![database reads and p99 per strategy](chart.svg)", ""]
    chart(rows, os.path.join(kit.RESULTS, "chart.svg"))
    write_results("summary.md", "\n".join(lines))


def scenario(k6, binary, args, strategy, script, extra_env, raw_dir):
    """One k6 script against a fresh fleet of one strategy: its figures, database reads and Redis commands."""
    prefix = f"lab:{strategy}:{script}:{int(time.time() * 1000)}:"
    reads_before = post_reads(STRATEGIES_DB)
    procs, urls = start_instances(binary, STRATEGIES_DB, args.instances, prefix,
                                  CACHE_STRATEGY=strategy, CACHE_TTL="2s", DB_MAX_CONNECTIONS="16",
                                  REDIS_TIMEOUT="1s", WAIT_TIMEOUT="10s", FAILURE_TTL="0s")
    cmds_before = redis_commands()
    out_json = os.path.join(raw_dir, f"{strategy}-{script.replace('.js', '')}.json")
    summary = run_k6(k6, script, urls, out_json, extra_env)
    cmds = redis_commands() - cmds_before - 1  # the INFO of the first reading
    stop(procs)
    f = figures(summary)
    f["db"] = post_reads(STRATEGIES_DB) - reads_before
    f["redis"] = cmds
    return f


def run_k6(k6, script, urls, out_json, extra_env):
    env = dict(os.environ, BASE_URLS=",".join(urls), SUMMARY_JSON=out_json, MAX_ID=str(kit.SEEDED), **extra_env)
    r = subprocess.run([k6, "run", "--quiet", "--no-usage-report", os.path.join(kit.LOAD, script)],
                       env=env, capture_output=True, text=True, timeout=600)
    sys.stderr.write(r.stdout[-2000:])
    with open(out_json) as f:
        return json.load(f)


def figures(summary):
    m = summary["metrics"]
    d = m["post_req_duration"]["values"]
    failed = m["post_req_failed"]["values"]
    count = lambda name: int(m[name]["values"]["count"]) if name in m else 0
    return {
        "requests": int(failed["passes"] + failed["fails"]),
        "errors": int(failed["passes"]),  # a "pass" of this Rate is a failed request
        "p50": d["p(50)"], "p95": d["p(95)"], "p99": d["p(99)"],
        "mix": {t: count("xcache_" + t) for t in ["hit", "miss", "coalesced", "stale", "bypass"]},
    }


def chart(rows, path):
    """A two-panel bar chart (database reads, p99) per strategy, as plain SVG."""
    panels = [("stampede: database reads (log scale)", [r["stampede"]["db"] for r in rows], "{:.0f}", True),
              ("stampede: p99 latency (ms)", [r["stampede"]["p99"] for r in rows], "{:.1f}", False)]
    bar_chart(path, panels, [r["strategy"] for r in rows], [r["strategy"] == "pubsub" for r in rows], height=300)
