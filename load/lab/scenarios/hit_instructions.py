"""hit-instructions: the user-space instructions one hit costs, counted by
callgrind: postcache's memory tier and Redis tier (and another binary's, with
--old) beside the plain hyper server of examples/ceiling.rs. Unlike requests/s
on shared cores, the count does not move with the machine's noise, and it
carries over to other machines. Writes load/results/<date>/hit-instructions.md."""

import os
import subprocess
import sys
import time
import urllib.request

from .. import kit
from ..db import CAPACITY_DB, prepare_database
from ..flags import add_connections, add_post, add_seconds
from ..procs import free_port, stop, temp_dir
from ..report import write_results
from ..runners import build_with_example, find_or_install, find_wrk, wrk_run
from ..servers import metric_sums, serve, start_instances


def add_parser(sub, common):
    s = sub.add_parser("hit-instructions", parents=[common],
                       help="instructions per hit (callgrind) beside the hyper ceiling",
                       description="One warm post read by wrk (1 thread) from each server in turn, each run "
                                   "under callgrind: the instructions counted while wrk runs, less those of an "
                                   "idle window as long (the feed's beats, the probes), ÷ the requests answered. "
                                   "Installs valgrind with apt-get when missing. Writes "
                                   "load/results/<date>/hit-instructions.md.")
    s.add_argument("--old", help="another postcache binary, measured beside this build")
    add_seconds(s, 10, what="seconds of wrk per server")
    add_connections(s, 4)
    add_post(s)
    s.set_defaults(run=run)


def totals(path):
    """The instructions a callgrind dump counted."""
    with open(path) as f:
        for line in f:
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
    sys.exit(f"error: {path} holds no totals")


def settled(base):
    """Waits until the instance at base has built its existence guard: under
    callgrind the build takes seconds, and counted in a window it would be
    charged to the hits."""
    deadline = time.monotonic() + 300
    while metric_sums(base, timeout=30)["postcache_guard_ids"] <= 0:
        if time.monotonic() > deadline:
            sys.exit(f"error: {base} built no existence guard in 300 s")
        time.sleep(1)


def measure(args, wrk, callgrind_control, proc, url, dump):
    """Instructions per request of the server proc (running under callgrind,
    dumping to dump.N), warm, over a wrk run less an idle window as long."""
    for _ in range(3):
        urllib.request.urlopen(url, timeout=30).read()
    control = [callgrind_control]

    def zero_then_dump(window):
        subprocess.run([*control, "-z", str(proc.pid)], check=True, timeout=60,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        result = window()
        subprocess.run([*control, "-d", str(proc.pid)], check=True, timeout=60,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return result

    before = set(os.listdir(os.path.dirname(dump)))
    _, requests = zero_then_dump(lambda: wrk_run(wrk, url, args.seconds, args.connections, threads=1))
    zero_then_dump(lambda: time.sleep(args.seconds))
    dumps = sorted((f for f in os.listdir(os.path.dirname(dump)) if f not in before
                    and f.startswith(os.path.basename(dump) + ".")), key=lambda f: int(f.rsplit(".", 1)[1]))
    if len(dumps) != 2:
        sys.exit(f"error: expected two callgrind dumps, found {dumps}")
    busy, idle = (totals(os.path.join(os.path.dirname(dump), f)) for f in dumps)
    return (busy - idle) / requests, requests


def run(args):
    """Each server alone under callgrind (a valgrind runs one thread at a
    time, so this counts work, not time), one after the other: warmed, its
    counts zeroed, wrk for --seconds, a dump; zeroed again, as long idle, a
    dump. Instructions per request: (busy - idle) ÷ requests. The kernel's
    part (one read and one write per hit) is not counted, and is the same
    for every server."""
    wrk = find_wrk()
    binary, ceiling = build_with_example(args, "ceiling")
    valgrind = find_or_install("valgrind", "valgrind")
    callgrind_control = os.path.join(os.path.dirname(valgrind), "callgrind_control")
    prepare_database(binary, CAPACITY_DB)
    tmp = temp_dir("hit-instructions-", mode=0o777)
    binaries = [("this build", binary)]
    if args.old:
        old = os.path.abspath(args.old)
        if not os.access(old, os.X_OK):
            sys.exit(f"error: {old} is not an executable")
        binaries.append(("--old", old))

    rows, body = [], None
    for label, path in binaries:
        for tier, settings in (("memory tier", {}), ("Redis tier", {"L1_MAX_BYTES": "0"})):
            name = f"postcache ({label}), {tier}"
            dump = os.path.join(tmp, f"postcache-{len(rows)}")
            kit.log(f"== {name}")
            under = [valgrind, "--tool=callgrind", f"--callgrind-out-file={dump}"]
            procs, (url,) = start_instances(path, CAPACITY_DB, 1, f"hit-ir:{time.time_ns()}:", under=under,
                                            stderr=subprocess.DEVNULL, CACHE_TTL="600s", L1_TTL="600s",
                                            **settings)
            settled(url)
            url += f"/posts/{args.post}"
            body = urllib.request.urlopen(url, timeout=30).read()  # a miss, then hits
            with urllib.request.urlopen(url, timeout=30) as r:
                r.read()
                if r.headers.get("x-cache-tier") != tier.split()[0].lower():
                    sys.exit(f"error: {name} answered from {r.headers.get('x-cache-tier')}")
            rows.append((name, *measure(args, wrk, callgrind_control, procs[0], url, dump)))
            stop(procs)

    with open(os.path.join(tmp, "body.json"), "wb") as f:
        f.write(body)
    port = free_port()
    dump = os.path.join(tmp, "ceiling")
    kit.log("== hyper, constant body")
    proc = serve([valgrind, "--tool=callgrind", f"--callgrind-out-file={dump}", ceiling, f"127.0.0.1:{port}",
                  os.path.join(tmp, "body.json")], port, "the hyper ceiling")
    hyper, requests = measure(args, wrk, callgrind_control, proc, f"http://127.0.0.1:{port}/posts/{args.post}",
                              dump)
    stop([proc])
    rows.append(("hyper, constant body (examples/ceiling.rs)", hyper, requests))

    old = "--old BINARY " if args.old else ""
    lines = [f"# Instructions per hit, {kit.DAY}", "",
             f"`load/compare hit-instructions {old}--seconds {args.seconds} --connections {args.connections}`: "
             f"each server alone under callgrind, one warm post ({len(body)} bytes), wrk -t1 "
             f"-c{args.connections} for {args.seconds} s, less an idle window as long; user-space "
             "instructions only (the kernel's read and write per request are the same for every server).", "",
             "| server | requests in the window | instructions per request | ÷ hyper's |", "|---|---|---|---|"]
    for name, per_request, requests in rows:
        lines.append(f"| {name} | {requests:,} | {per_request:,.0f} | {per_request / hyper:.2f} |")
    write_results("hit-instructions.md", "\n".join(lines) + "\n")
