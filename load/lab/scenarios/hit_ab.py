"""hit-ab: the hit path (memory tier, then Redis tier) of the release build
against another binary (--old), both running at once, wrk alternating between
them round by round. Writes load/results/<date>/hit-ab.md."""

import os
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from .. import kit
from ..cpu import tree_cpu
from ..db import CAPACITY_DB, prepare_database
from ..flags import add_connections, add_out, add_rounds, add_seconds
from ..procs import stop_all
from ..report import spread, write_results
from ..runners import build, find_wrk, wrk_run
from ..servers import start_instances


def add_parser(sub, common):
    s = sub.add_parser("hit-ab", parents=[common], help="the hit path of this build against another binary",
                       description="The hit path (memory tier, then Redis tier) of the release build against "
                                   "another postcache binary (--old), both running at once, wrk alternating "
                                   "between them. Writes load/results/<date>/hit-ab.md.")
    s.add_argument("--old", required=True, help="the binary to compare against")
    add_rounds(s, 6, what="rounds per tier")
    add_seconds(s, 5)
    add_connections(s)
    s.add_argument("--together", action="store_true",
                   help="load both at once (a wrk of one thread each) instead of in turn: both then share "
                        "every moment of the machine's noise, which the CPU per request's ratio cancels")
    add_out(s, "hit-ab.md")
    s.set_defaults(run=run)


def run(args):
    """The hit path of two binaries side by side: the memory tier, then the
    Redis tier (L1_MAX_BYTES=0), one instance of each binary running at once,
    wrk alternating between them round by round (A B, then B A), so that both
    share the machine's drift. Prints each round and the ratio new/old."""
    wrk = find_wrk()
    new = build(args)
    old = os.path.abspath(args.old)
    if not os.access(old, os.X_OK):
        sys.exit(f"error: {old} is not an executable")
    prepare_database(new, CAPACITY_DB)
    how = ("both loaded at once in every round, by a wrk of one thread and half the connections each"
           if args.together else
           "wrk (2 threads) alternates between them (old first in odd rounds, new first in even ones)")
    lines = [f"# Hit path A/B, {kit.DAY}", "",
             f"`load/compare hit-ab --old <binary> --rounds {args.rounds} --seconds {args.seconds} "
             f"--connections {args.connections}{' --together' if args.together else ''}`, {os.cpu_count()} "
             f"cores, wrk on the same cores; both binaries run at once, {how}. `GET /posts/1`, warm.", ""]
    for tier, settings in (("memory tier", {}), ("Redis tier (L1_MAX_BYTES=0)", {"L1_MAX_BYTES": "0"})):
        kit.log(f"== {tier}")
        urls, pids = {}, {}
        for name, binary in (("old", old), ("new", new)):
            procs, (url,) = start_instances(binary, CAPACITY_DB, 1, f"ab:{name}:{time.time_ns()}:",
                                            stderr=subprocess.DEVNULL, CACHE_TTL="600s",
                                            DB_MAX_CONNECTIONS="8", **settings)
            urls[name], pids[name] = url + "/posts/1", procs[0].pid
            for _ in range(3):
                urllib.request.urlopen(urls[name], timeout=10).read()
        lines += [f"## {tier}", "", "| round | old requests/s | new requests/s | new / old | "
                  "old / new CPU µs per request |", "|---|---|---|---|---|"]
        ratios, cpu = [], {"old": [], "new": []}
        for r in range(args.rounds):
            order = ("old", "new") if r % 2 == 0 else ("new", "old")
            got = {}
            if args.together:
                before = {name: tree_cpu(pids[name]) for name in order}
                with ThreadPoolExecutor(2) as pool:
                    runs = {name: pool.submit(wrk_run, wrk, urls[name], args.seconds, args.connections // 2,
                                              threads=1) for name in order}
                    done = {name: run.result() for name, run in runs.items()}
                for name in order:
                    got[name], total = done[name]
                    cpu[name].append((tree_cpu(pids[name]) - before[name]) * 1e6 / total)
            for name in order if not args.together else ():
                before = tree_cpu(pids[name])
                got[name], total = wrk_run(wrk, urls[name], args.seconds, args.connections)
                cpu[name].append((tree_cpu(pids[name]) - before) * 1e6 / total)
            ratios.append(got["new"] / got["old"])
            lines.append(f"| {r + 1} | {got['old']:.0f} | {got['new']:.0f} | {ratios[-1]:.3f} | "
                         f"{cpu['old'][-1]:.2f} / {cpu['new'][-1]:.2f} |")
        cpu_ratios = [n / o for n, o in zip(cpu["new"], cpu["old"])]
        lines += ["", f"new / old: {spread(ratios, '.3f')}; the instance's CPU per request, "
                      f"new / old: {spread(cpu_ratios, '.3f')}", ""]
        stop_all()
    write_results(args.out or "hit-ab.md", "\n".join(lines))
