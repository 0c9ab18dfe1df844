"""missing-ids: 10,000 random ids that do not exist, over 2 instances, with
the existence guard on and off: statements (PostgreSQL's count), the guard's
build time and bytes for the table. Writes load/results/<date>/missing-ids.md."""

import collections
import concurrent.futures
import os
import random
import subprocess
import sys
import time
import urllib.error
import urllib.request

from .. import kit
from ..db import COLD_DB, ensure_seeded, transactions
from ..procs import stop
from ..report import write_results
from ..runners import build
from ..servers import metric_sums, start_instances


def add_parser(sub, common):
    s = sub.add_parser("missing-ids", parents=[common], help="random missing ids, existence guard on and off",
                       description="10,000 random ids that do not exist over 2 instances, with the existence "
                                   "guard on and off: statements, the guard's bytes and build time. Writes "
                                   "load/results/<date>/missing-ids.md.")
    s.add_argument("--ids", type=int, default=10_000, help="missing ids asked (default 10,000)")
    s.add_argument("--posts", type=int, default=1_000_000, help="posts seeded (default 1,000,000)")
    s.set_defaults(run=run)


def run(args):
    """Random ids that do not exist, spread over 2 instances, with the
    existence guard on and off (each a fresh KEY_PREFIX): statements counted
    by PostgreSQL, the guard's build read from the instances' metrics and
    logs."""
    binary = build(args)
    ensure_seeded(binary, COLD_DB, args.posts)
    rows = []
    rng = random.Random(7)
    ids = [rng.randrange(10 ** 12, 10 ** 15) for _ in range(args.ids)]
    for guard in ("on", "off"):
        kit.log(f"== existence guard {guard}")
        xact = transactions(COLD_DB)
        procs, urls = start_instances(binary, COLD_DB, 2, f"missing:{guard}:{time.time_ns()}:",
                                      stderr=subprocess.DEVNULL, EXISTENCE_GUARD=guard)
        built, took_ms = [], []
        if guard == "on":
            deadline = time.time() + 300
            for u in urls:
                while metric_sums(u)["postcache_guard_ids"] < args.posts:
                    if time.time() > deadline:
                        sys.exit("error: the existence guard was not built")
                    time.sleep(0.2)
                m = metric_sums(u)
                built.append(m["postcache_guard_bytes"])
                took_ms.append(round(m["postcache_guard_build_seconds"] * 1000))

        def get(at):
            try:
                urllib.request.urlopen(f"{urls[at % 2]}/posts/{ids[at]}", timeout=10).read()
                return 200
            except urllib.error.HTTPError as e:
                return e.code

        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            codes = collections.Counter(pool.map(get, range(len(ids))))
        stop(procs)
        statements = transactions(COLD_DB) - xact
        rows.append((guard, codes, statements, built, took_ms))
    lines = [f"# Random missing ids, {kit.DAY}", "",
             f"`load/compare missing-ids --ids {args.ids}`, {os.cpu_count()} cores. {args.posts:,} posts; "
             f"{args.ids:,} distinct random ids in 10^12..10^15 (none exists), alternately on 2 instances, "
             "32 at a time; statements are PostgreSQL's transaction counts for the run (the instances' "
             "start and the guard's build included).", "",
             "| existence guard | answers | statements | guard bytes per instance | bytes per id | build ms |",
             "|---|---|---|---|---|---|"]
    for guard, codes, statements, built, took_ms in rows:
        per_id = f"{built[0] / args.posts:.2f}" if built else "-"
        lines.append(f"| {guard} | {dict(codes)} | {statements} | "
                     f"{', '.join(f'{b:,.0f}' for b in built) or '-'} | {per_id} | "
                     f"{', '.join(map(str, took_ms)) or '-'} |")
    write_results("missing-ids.md", "\n".join(lines + [""]))
