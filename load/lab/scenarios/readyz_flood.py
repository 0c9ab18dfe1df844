"""readyz-flood: cold reads of one instance beside a /readyz flood, against
the same flood of /healthz. Writes load/results/<date>/readyz-flood.md."""

import os
import subprocess
import time

from .. import kit
from ..db import CAPACITY_DB, prepare_database
from ..flags import add_connections, add_rounds, add_seconds
from ..procs import spawn, stop_all
from ..report import spread, write_results
from ..runners import find_wrk, this_and_old, wrk_cmd, wrk_rps, wrk_run
from ..servers import start_instances


def add_parser(sub, common):
    s = sub.add_parser("readyz-flood", parents=[common], help="cold reads beside a /readyz flood, against /healthz",
                       description="Cold reads of one instance while /readyz is flooded, against the same flood "
                                   "of /healthz (each run a fresh KEY_PREFIX); with --old, another binary too. "
                                   "Writes load/results/<date>/readyz-flood.md.")
    s.add_argument("--old", help="another binary to run the same rounds with")
    add_rounds(s, 4)
    add_seconds(s, 5, what="seconds per run")
    add_connections(s, what="flood connections")
    s.add_argument("--db-connections", type=int, default=4, help="DB_MAX_CONNECTIONS (default 4)")
    s.set_defaults(run=run)


def run(args):
    """Cold reads of one instance while /readyz is flooded, against the same
    flood of /healthz: readiness must take no connection the loads need.
    Each round starts an instance on a fresh KEY_PREFIX (everything cold),
    floods one path with wrk while another wrk reads posts 1, 2, 3, ... once
    each; the floods alternate which goes first. With --old, the same for
    another binary."""
    wrk = find_wrk()
    new, binaries = this_and_old(args)
    prepare_database(new, CAPACITY_DB)
    secs = args.seconds
    lines = [f"# /readyz flood against /healthz flood, {kit.DAY}", "",
             f"`load/compare readyz-flood --rounds {args.rounds} --seconds {secs}"
             f"{' --old <binary>' if args.old else ''}`, {os.cpu_count()} cores. One instance "
             f"(DB_MAX_CONNECTIONS={args.db_connections}), {kit.SEEDED:,} posts; each run a fresh KEY_PREFIX. "
             f"A flood (wrk -t1 -c{args.connections}) of `/readyz` or `/healthz` beside a cold reader "
             f"(wrk -t1 -c16, `wrk-cold.lua`: every request a different post) for {secs} s.", ""]
    cold = os.path.join(kit.LOAD, "wrk-cold.lua")
    for name, binary in binaries:
        kit.log(f"== {name}")
        lines += [f"## {name}", "", "| round | flood | flood requests/s | cold reads/s |", "|---|---|---|---|"]
        got = {"/readyz": [], "/healthz": []}
        for r in range(args.rounds):
            order = ("/readyz", "/healthz") if r % 2 == 0 else ("/healthz", "/readyz")
            for path in order:
                _, (url,) = start_instances(binary, CAPACITY_DB, 1, f"flood:{time.time_ns()}:",
                                            stderr=subprocess.DEVNULL, CACHE_TTL="600s",
                                            DB_MAX_CONNECTIONS=str(args.db_connections))
                flood = spawn(wrk_cmd(wrk, url + path, secs, args.connections, threads=1),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                reads, _ = wrk_run(wrk, url, secs, 16, "-s", cold, threads=1,
                                   env=dict(os.environ, FIRST_ID=str(1 + r * 20_000)))
                flooded = wrk_rps(flood.communicate(timeout=secs + 60)[0])
                stop_all()
                got[path].append(reads)
                lines.append(f"| {r + 1} | `{path}` | {flooded or 0:.0f} | {reads:.0f} |")
        ratios = [a / b for a, b in zip(got["/readyz"], got["/healthz"])]
        lines += ["", "cold reads under the `/readyz` flood ÷ under the `/healthz` flood, paired by round: "
                      f"{spread(ratios)}", ""]
    write_results("readyz-flood.md", "\n".join(lines))
