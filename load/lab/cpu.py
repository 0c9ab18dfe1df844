"""CPU accounting from /proc (per process, per group of processes, the whole
machine) and --pin's disjoint cores."""

import collections
import contextlib
import os
import shutil
import sys

from . import kit

TICK = os.sysconf("SC_CLK_TCK")


def processes():
    """(pid, name, parent's pid, CPU seconds so far) of every process alive now."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        yield pid, name, fields[1], (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def cpu_seconds():
    """CPU seconds so far of the processes the cold storm splits the machine
    into: {"instance pid": s, "postgres": s, "redis": s, "all": s}. "postgres"
    sums every postgres process alive now (a backend that exits in between is
    lost: read before the instances stop), "redis" is redis-server, "all" the
    whole machine's busy time (/proc/stat), so all less the parts is wrk, the
    kernel's own work and anything else running."""
    got = collections.Counter()
    for pid, name, _, used in processes():
        if name == "postgres":
            got["postgres"] += used
        elif name == "redis-server":
            got["redis"] += used
        got[pid] = used
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    got["all"] = (sum(ticks[:8]) - ticks[3] - ticks[4]) / TICK  # less idle and iowait
    return got


def tree_cpu(pid):
    """CPU seconds so far of pid and its children (nginx's workers)."""
    return sum((used for p, _, parent, used in processes() if str(pid) in (p, parent)), 0.0)


def children_cpu(before, after):
    """CPU seconds of this process's waited-for children (wrk) between two os.times()."""
    return after.children_user + after.children_system - before.children_user - before.children_system


class Pinning:
    """--pin: disjoint cores (8 or more) for each group of processes. For a
    cold storm: PostgreSQL the first half, Redis one core, the instance a
    quarter, wrk the rest. For hits: the server under test a quarter (at
    least 2), Redis one core, PostgreSQL one, wrk the rest. The shared
    servers' processes (and their threads) are pinned with
    sched_setaffinity, PostgreSQL's backends through the postmaster they
    fork from; their masks are restored on exit. The servers started here
    and wrk run under taskset."""

    def __init__(self, layout="storm"):
        n = os.cpu_count()
        if n < 8:
            sys.exit(f"error: --pin needs 8 or more cores (this machine has {n})")
        if not shutil.which("taskset"):
            sys.exit("error: --pin needs taskset (util-linux)")
        cores = list(range(n))
        if layout == "storm":
            pg, instance = n // 2, n // 4
            self.groups = {"postgres": cores[:pg], "redis": cores[pg:pg + 1],
                           "instance": cores[pg + 1:pg + 1 + instance], "wrk": cores[pg + 1 + instance:]}
        else:
            server = max(2, n // 4)
            self.groups = {"instance": cores[:server], "redis": cores[server:server + 1],
                           "postgres": cores[server + 1:server + 2], "wrk": cores[server + 2:]}
        self.saved = {}
        kit.CLEANUPS.append(self.restore)
        for tid, group in self.server_threads():
            self.saved[tid] = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, self.groups[group])

    @staticmethod
    def server_threads():
        """(thread id, group) of every postgres and redis-server thread alive now."""
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/comm") as f:
                    name = f.read().strip()
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            group = {"postgres": "postgres", "redis-server": "redis"}.get(name)
            if group:
                yield from ((int(tid), group) for tid in tids)

    def under(self, group):
        return ["taskset", "-c", ",".join(map(str, self.groups[group]))]

    def describe(self):
        return ", ".join(f"{group} on cores {span(cores)}" for group, cores in self.groups.items())

    def restore(self):
        """Each pinned thread back to its mask; a postgres backend forked while
        pinned gets the postmaster's."""
        every = set(range(os.cpu_count()))
        for tid, group in self.server_threads():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, self.saved.get(tid, every))


def pinning(wanted, layout="storm"):
    """With --pin, a Pinning and its under(group); without, None and an
    under(group) that adds nothing to a command."""
    if not wanted:
        return None, lambda _group: []
    pin = Pinning(layout)
    return pin, pin.under


def span(cores):
    return f"{cores[0]}-{cores[-1]}" if len(cores) > 1 else str(cores[0])
