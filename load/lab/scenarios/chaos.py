"""chaos: a chaos soak, 3 instances under a steady Zipf load (a stdlib
client) against a private PostgreSQL and a private Redis started for it,
while one fault at a time is injected (Redis paused, Redis killed, pub/sub
connections killed, PostgreSQL backends terminated, PostgreSQL restarted, an
instance SIGKILLed); per fault: 5xx, wrong ids, loads per key from
PostgreSQL's statement log, hit-ratio recovery; locks and subscriptions left
at the end. Writes load/results/<date>/chaos.md."""

import asyncio
import bisect
import collections
import csv
import datetime
import itertools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

from .. import kit
from ..db import prepare_database, psql, redis_cli, slow_database
from ..procs import free_port, kill, stop, temp_dir
from ..report import quantile, write_results
from ..runners import build
from ..servers import PrivatePostgres, PrivateRedis, metric_sums, start_instances


def add_parser(sub, common):
    s = sub.add_parser("chaos", parents=[common], help="3 instances under Zipf load while faults are injected",
                       description="A chaos soak: instances under a steady Zipf read load against a private "
                                   "PostgreSQL and a private Redis (started here, removed at the end) while one "
                                   "fault at a time is injected: Redis paused, Redis killed and restarted, pub/sub "
                                   "connections killed, the service's PostgreSQL backends terminated, PostgreSQL "
                                   "restarted, one instance SIGKILLed and restarted. Prints and writes "
                                   "load/results/<date>/chaos.md (raw logs in raw/chaos/); exits non-zero on a "
                                   "wrong answer or a lock or subscription left. About 2 minutes; bounded by "
                                   "--timeout. Builds the release binary only if it is older than the sources.")
    s.add_argument("--instances", type=int, default=3, help="instances (default 3)")
    s.add_argument("--rate", type=int, default=450, help="requests/s in all, round-robin (default 450)")
    s.add_argument("--posts", type=int, default=100,
                   help="posts seeded and requested (default 100: with more, a 10 s TTL keeps the steady "
                        "hit ratio under 95%%, the recovery mark)")
    s.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the ids (default 1.1)")
    s.add_argument("--cache-ttl", type=int, default=10, help="CACHE_TTL in s (default 10; TTL_JITTER is 0.3)")
    s.add_argument("--load-ms", type=int, default=10,
                   help="how long each database load takes (a slow view; default 10, so that concurrent "
                        "loads of one key show in the statement log; 0 = the plain table)")
    s.add_argument("--only", default="", help="comma-separated fault numbers 1-6 to run (default: all)")
    s.add_argument("--timeout", type=int, default=180,
                   help="bound on the whole run after the build, in s (default 180)")
    s.set_defaults(run=run)


CHAOS_DB = "postcache"
CHAOS_JITTER = 0.3  # TTL_JITTER: spreads the expiries of keys loaded together (after a fault)
BASELINE = (5.0, 11.0)  # the steady window, seconds after the load starts
FIRST_FAULT = 12.0  # seconds after the load starts
FAULT_SECONDS = 3.0  # how long a fault lasts, and the shortest window measured for one
RECOVERY_SECONDS = 9.0  # steady load between the end of a fault window and the next fault
HIT_TARGET = 0.95  # the hit ratio a fault's aftermath must get back above
# the last command of a subscriber connection that is not subscribed right now (it
# confirms a SUBSCRIBE with a PING; fred sends INFO when it connects)
PUBSUB_COMMANDS = {"subscribe", "unsubscribe", "ssubscribe", "sunsubscribe", "psubscribe", "punsubscribe",
                   "ping", "info"}


class Fleet:
    """k instances of postcache serve on fixed ports (an instance restarts on its own
    port), each logging into its own file."""

    def __init__(self, binary, prefix, k, log_dir, settings):
        self.binary, self.prefix, self.settings = binary, prefix, settings
        self.ports = [free_port() for _ in range(k)]
        self.logs = [os.path.join(log_dir, f"instance-{i + 1}.log") for i in range(k)]
        for path in self.logs:
            open(path, "w").close()
        self.procs = [None] * k
        for i in range(k):
            self.start(i)

    def start(self, i):
        with open(self.logs[i], "a") as out:
            (self.procs[i],), _ = start_instances(self.binary, CHAOS_DB, 1, self.prefix, stdout=out,
                                                  stderr=subprocess.STDOUT, ports=[self.ports[i]],
                                                  LOG_FORMAT="json", **self.settings)

    def kill(self, i):
        kill(self.procs[i])

    def gauges(self, *names):
        """{name: [value per instance]} from each instance's /metrics."""
        out = {n: [] for n in names}
        for port in self.ports:
            try:
                sums = metric_sums(f"http://127.0.0.1:{port}", timeout=5)
            except OSError:
                sums = {}  # an instance not answering: its values show as absent
            for n in names:
                out[n].append(sums[n] if n in sums else None)
        return out


class Load:
    """An open-loop load on a thread of its own: `rate` GET /posts/{id} per second,
    round-robin over the ports, ids Zipf(s) over 1..posts, on keep-alive
    connections (stdlib asyncio, raw HTTP/1.1). Every request becomes a record:
    (sent at, instance, id, status or "conn" / "timeout" / "shed", X-Cache, the
    body's id is the requested one (200 only), seconds taken)."""

    def __init__(self, ports, posts, rate, s, timeout=5.0, max_in_flight=2000):
        self.ports, self.rate, self.timeout, self.max_in_flight = ports, rate, timeout, max_in_flight
        self.ids = list(range(1, posts + 1))
        self.cum = list(itertools.accumulate(k ** -s for k in self.ids))
        self.rng = random.Random(42)
        self.records = []
        self.t0 = None
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self.run()), daemon=True)

    def start(self):
        self.thread.start()
        while self.t0 is None:
            time.sleep(0.01)

    def stop(self):
        self.stopping.set()
        self.thread.join(self.timeout + 10)

    async def run(self):
        idle = [[] for _ in self.ports]
        tasks = set()
        self.t0 = time.time()
        sent = 0
        while not self.stopping.is_set():
            due = int((time.time() - self.t0) * self.rate) - sent
            for _ in range(due):
                i, post = sent % len(self.ports), self.rng.choices(self.ids, cum_weights=self.cum)[0]
                sent += 1
                if len(tasks) >= self.max_in_flight:  # the generator's own bound: never hit in a sane run
                    self.records.append((time.time(), i, post, "shed", "", None, 0.0))
                    continue
                t = asyncio.create_task(self.request(i, post, idle))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            await asyncio.sleep(0.004)
        if tasks:
            await asyncio.wait(list(tasks))
        for conns in idle:
            for _, w in conns:
                w.close()

    async def request(self, i, post, idle):
        t = time.time()
        try:
            status, cache, ok = await asyncio.wait_for(self.exchange(i, post, idle), self.timeout)
        except asyncio.TimeoutError:
            status, cache, ok = "timeout", "", None
        except (OSError, asyncio.IncompleteReadError, ValueError):
            status, cache, ok = "conn", "", None
        self.records.append((t, i, post, status, cache, ok, time.time() - t))

    async def exchange(self, i, post, idle):
        for attempt in (0, 1):
            reused = bool(idle[i])
            reader, writer = idle[i].pop() if reused else await asyncio.open_connection("127.0.0.1", self.ports[i])
            keep = False
            try:
                writer.write(f"GET /posts/{post} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
                await writer.drain()
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (OSError, asyncio.IncompleteReadError) as e:
                    nothing = not isinstance(e, asyncio.IncompleteReadError) or not e.partial
                    if reused and attempt == 0 and nothing:
                        continue  # a kept-alive connection the server had closed: once more on a new one
                    raise
                lines = head.decode("latin-1").split("\r\n")
                status = int(lines[0].split()[1])
                headers = {k.strip().lower(): v.strip() for k, v in
                           (line.split(":", 1) for line in lines[1:] if ":" in line)}
                if headers.get("transfer-encoding", "").lower() == "chunked":
                    body = b""
                    while True:
                        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                        body += (await reader.readexactly(size + 2))[:size]
                        if size == 0:
                            break
                else:
                    body = await reader.readexactly(int(headers.get("content-length", "0")))
                keep = headers.get("connection", "").lower() != "close"
                ok = None
                if status == 200:
                    try:
                        ok = json.loads(body).get("id") == post
                    except ValueError:
                        ok = False
                return status, headers.get("x-cache", ""), ok
            finally:
                if keep:
                    idle[i].append((reader, writer))
                else:
                    writer.close()
        raise ConnectionResetError("closed twice")


def run(args):
    if args.instances < 2 or args.rate < 50 or args.posts < 1:
        sys.exit("error: needs --instances >= 2, --rate >= 50, --posts >= 1")
    binary = build(args, only_if_stale=True)

    def out_of_time(*_):
        raise SystemExit(f"error: the run passed its bound of {args.timeout} s: stopped")
    signal.signal(signal.SIGALRM, out_of_time)
    signal.alarm(args.timeout)  # from here on (the build is not counted)
    try:
        chaos_run(args, binary)
    finally:
        signal.alarm(0)


def chaos_run(args, binary):
    k = args.instances
    raw = os.path.join(kit.RESULTS, "raw", "chaos")
    os.makedirs(raw, exist_ok=True)
    tmp = temp_dir("postcache-chaos-")
    pg = PrivatePostgres(tmp)
    kit.CLEANUPS.append(lambda: os.path.exists(pg.csv) and shutil.copyfile(pg.csv, os.path.join(raw, "postgres.csv")))
    pg.start()  # registers its stop: run before the copy and the removal
    with open(os.path.join(raw, "redis.log"), "w"):
        pass
    redis = PrivateRedis(tmp, os.path.join(raw, "redis.log"))
    redis.start()
    kit.use_servers(pg.server, redis.url)
    kit.log(f"== private PostgreSQL ({os.path.basename(os.path.dirname(pg.bin))}) on :{pg.port}, "
            f"Redis on :{redis.port}, in {tmp}")
    prepare_database(binary, CHAOS_DB, posts=args.posts)
    slow_database(CHAOS_DB, args.load_ms)
    pg.log_statements(CHAOS_DB)
    prefix = f"chaos:{time.time_ns()}:"
    settings = dict(CACHE_TTL=f"{args.cache_ttl}s", TTL_JITTER=str(CHAOS_JITTER))
    fleet = Fleet(binary, prefix, k, raw, settings)
    victim = 1  # the instance SIGKILLed

    def pause():
        redis_cli("client", "pause", str(int(FAULT_SECONDS * 1000)), "all")
        return f"{FAULT_SECONDS:.0f} s", time.time() + FAULT_SECONDS

    def redis_kill():
        redis.kill()
        time.sleep(FAULT_SECONDS)
        redis.start()
        return "restarted empty", time.time()

    def pubsub_kill():
        # CLIENT KILL TYPE pubsub only matches connections subscribed right now; the
        # instances' shared subscriber connections are idle most of the time (a waiter
        # holds a channel for one load), so those are found by their last command.
        clients = [dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
                   for line in redis_cli("client", "list").splitlines()]
        subscribed = [c for c in clients if int(c["sub"]) + int(c["psub"]) + int(c.get("ssub", 0)) > 0]
        idle = [c for c in clients if c not in subscribed and c["cmd"] in PUBSUB_COMMANDS]
        for c in subscribed + idle:
            redis_cli("client", "kill", "id", c["id"])
        return f"{len(subscribed) + len(idle)} connections, {len(subscribed)} of them subscribed", time.time()

    def terminate():
        n = psql(CHAOS_DB, "select count(pg_terminate_backend(pid)) from pg_stat_activity "
                           "where application_name = 'postcache'")
        return f"{n} backends", time.time()

    def pg_restart():
        t = time.time()
        pg.restart()
        return f"took {time.time() - t:.1f} s", time.time()

    def instance_kill():
        fleet.kill(victim)
        time.sleep(FAULT_SECONDS)
        fleet.start(victim)
        return f"instance {victim + 1} of {k}", time.time()

    # (name, what it does, Redis down: the fleet bypasses it meanwhile)
    faults = [("Redis paused (CLIENT PAUSE ALL)", pause, True),
              ("Redis killed (SIGKILL), restarted", redis_kill, True),
              ("pub/sub connections killed (CLIENT KILL)", pubsub_kill, False),
              ("PostgreSQL backends terminated (pg_terminate_backend)", terminate, False),
              ("PostgreSQL restarted (pg_ctl restart -m fast)", pg_restart, False),
              ("one instance SIGKILLed, restarted", instance_kill, False)]
    if args.only:
        faults = [f for i, f in enumerate(faults) if str(i + 1) in args.only.split(",")]

    load = Load(fleet.ports, args.posts, args.rate, args.zipf)
    kit.log(f"== {k} instances on {', '.join(map(str, fleet.ports))}; {args.rate} requests/s; faults follow")
    load.start()
    t0 = load.t0

    def until(t):
        time.sleep(max(0.0, t - time.time()))

    windows = [dict(name="baseline (no fault)", detail="", start=t0 + BASELINE[0], end=t0 + BASELINE[1],
                    heal=None, redis_down=False)]
    at = t0 + FIRST_FAULT
    try:
        for name, inject, redis_down in faults:
            until(at)
            kit.log(f"== {name}")
            start = time.time()
            detail, heal = inject()
            end = max(heal, start + FAULT_SECONDS)
            until(end)
            windows.append(dict(name=name, detail=detail, start=start, end=end, heal=heal, redis_down=redis_down))
            at = end + RECOVERY_SECONDS
        until(at)
    finally:
        load.stop()
    t_end = time.time()
    kit.log("== load stopped; checking what is left in 2 s")
    time.sleep(2)
    locks = redis_cli("--scan", "--pattern", f"{prefix}lock:*").split()
    channels = redis_cli("pubsub", "channels", f"{prefix}ready:*").split()
    numsub = redis_cli("pubsub", "numsub", *channels).split() if channels else []
    subscribers = sum(int(n) for n in numsub[1::2])
    gauges = fleet.gauges("postcache_subscribed_channels", "postcache_flights_in_progress")
    stop(list(fleet.procs))
    loads = pg.loads()
    with open(os.path.join(raw, "requests.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["sent_s", "instance", "id", "status", "x_cache", "id_ok", "seconds"])
        for r in load.records:
            w.writerow([f"{r[0] - t0:.4f}", r[1] + 1, r[2], r[3], r[4], r[5], f"{r[6]:.4f}"])

    end_state = dict(locks=len(locks), channels=len(channels), subscribers=subscribers, gauges=gauges)
    text, failed = chaos_report(args, windows, load.records, loads, t0, t_end, end_state, fleet, prefix)
    write_results("chaos.md", text)
    if failed:
        sys.exit("chaos: FAILED: " + "; ".join(failed))


def hit_ratio(rs):
    """The share of `hit` among the 200s of records rs, and how many 200s."""
    ok = [r for r in rs if r[3] == 200]
    return (sum(1 for r in ok if r[4] == "hit") / len(ok), len(ok)) if ok else (None, 0)


def recovery(in_range, heal, limit):
    """Seconds from heal to the start of the first 1 s window whose hit ratio is
    above HIT_TARGET (windows start every 0.1 s)."""
    s = heal
    while s + 1 <= limit:
        ratio, n = hit_ratio(in_range(s, s + 1))
        if ratio is not None and n >= 20 and ratio > HIT_TARGET:
            return f"{s - heal:.1f} s"
        s += 0.1
    return f"not within {limit - heal:.0f} s"


def concurrency(intervals, tol=0.001):
    """Most overlapping loads, counting an overlap only past the log's 1 ms resolution."""
    events = []
    for a, b in intervals:
        if b - a > 2 * tol:
            events += [(a + tol, 1), (b - tol, -1)]
    best = cur = 0
    for _, d in sorted(events, key=lambda e: (e[0], e[1])):
        cur += d
        best = max(best, cur)
    return best


def is_wrong(r):
    """A 200 whose body is another post, or a 4xx, for a seeded post."""
    return (r[3] == 200 and r[5] is False) or (isinstance(r[3], int) and 400 <= r[3] < 500)


def chaos_window(args, w, rs, after, loads, nxt, t0, in_range):
    """One fault's window: its row of the table, its row of the X-Cache mix, and
    its warnings."""
    k = args.instances
    statuses = collections.Counter(r[3] for r in rs)
    five = {s: c for s, c in statuses.items() if isinstance(s, int) and s >= 500}
    five_after = collections.Counter(r[3] for r in after if isinstance(r[3], int) and r[3] >= 500)
    wrong = sum(1 for r in rs + after if is_wrong(r))
    ratio, _ = hit_ratio(rs)
    wl = [(a, b, p) for a, b, p in loads if w["start"] <= a < w["end"]]
    per_key = collections.Counter(p for _, _, p in wl)
    most = max(per_key.values(), default=0)
    if args.load_ms > 0:
        conc = max((concurrency([(a, b) for a, b, q in wl if q == p]) for p in per_key), default=0)
    else:
        conc = None
    short = w["end"] - w["start"] < args.cache_ttl * (1 - CHAOS_JITTER)
    count_bound = 1 if not w["redis_down"] and short else None
    conc_bound = k if w["redis_down"] else 1
    rec = recovery(in_range, w["heal"], nxt) if w["heal"] is not None else "—"

    def fmt5(c):
        keys = sorted(set(c) | {503, 504})
        return ", ".join(f"{s}: {c.get(s, 0)}" for s in keys)
    conn, timeouts = statuses.get("conn", 0), statuses.get("timeout", 0) + statuses.get("shed", 0)
    span = f"{w['start'] - t0:.1f}–{w['end'] - t0:.1f} s"
    name = w["name"] + (f": {w['detail']}" if w["detail"] else "")
    row = (f"| {name} | {span} | {len(rs)} | {fmt5(five)} | {fmt5(five_after)} | "
           f"{conn} | {timeouts} | {wrong} | {'—' if ratio is None else f'{100 * ratio:.1f}%'} | {rec} | "
           f"{most} ({'≤ 1' if count_bound else 'no bound: bypass reads once per request'}) | "
           f"{'—' if conc is None else conc} (≤ {conc_bound}) |")
    mix = collections.Counter(r[4] for r in rs if r[3] == 200)
    lat = sorted(r[6] for r in rs if isinstance(r[3], int))
    q = lambda p: 1000 * quantile(lat, p)
    mix_row = (f"| {w['name']} | " + " | ".join(str(mix.get(c, 0)) for c in
                                                ("hit", "miss", "coalesced", "stale", "bypass")) +
               f" | {len(wl)} | {q(0.5):.1f} | {q(0.99):.1f} | {1000 * lat[-1] if lat else float('nan'):.0f} |")

    warnings = []
    if wrong:
        warnings.append(f"'{w['name']}': {wrong} wrong answers in the window or after it")
    if count_bound and most > count_bound:
        top = [f"{p}×{c}" for p, c in per_key.most_common() if c > count_bound]
        warnings.append(f"'{w['name']}': a key loaded more than once in the window ({', '.join(top[:8])})")
    if conc is not None and conc > conc_bound:
        warnings.append(f"'{w['name']}': {conc} concurrent loads of one key (bound {conc_bound})")
    unexpected = [r for r in rs + after if isinstance(r[3], int) and r[3] >= 500
                  and not (r[3] == 503 and "PostgreSQL" in w["name"])]
    if unexpected:
        by_status = collections.Counter(r[3] for r in unexpected)
        by_post = collections.Counter(r[2] for r in unexpected).most_common(6)
        by_inst = collections.Counter(r[1] + 1 for r in unexpected)
        first, last = unexpected[0][0] - t0, unexpected[-1][0] - t0
        warnings.append(
            f"'{w['name']}': {len(unexpected)} responses {dict(by_status)} where the failure table promises none "
            f"(during: {dict(five)}, after: {dict(five_after)}), sent {first:.1f}–{last:.1f} s, "
            f"by post {', '.join(f'{p}×{c}' for p, c in by_post)}, by instance {dict(sorted(by_inst.items()))}")
    if rec.startswith("not"):
        warnings.append(f"'{w['name']}': the hit ratio was not back above {HIT_TARGET:.0%} before the next step")
    return row, mix_row, warnings


def chaos_report(args, windows, records, loads, t0, t_end, end_state, fleet, prefix):
    k = args.instances
    records = sorted(records)
    sent = [r[0] for r in records]

    def in_range(a, b):
        return records[bisect.bisect_left(sent, a):bisect.bisect_left(sent, b)]

    rows, mix_rows, warnings, failed = [], [], [], []
    for n, w in enumerate(windows):
        nxt = windows[n + 1]["start"] if n + 1 < len(windows) else t_end
        row, mix_row, said = chaos_window(args, w, in_range(w["start"], w["end"]), in_range(w["end"], nxt),
                                          loads, nxt, t0, in_range)
        rows.append(row)
        mix_rows.append(mix_row)
        warnings += said

    es = end_state
    if es["locks"]:
        failed.append(f"{es['locks']} locks left")
    if es["channels"] or es["subscribers"]:
        failed.append(f"{es['channels']} ready channels with {es['subscribers']} subscribers left")
    if any(es["gauges"]["postcache_subscribed_channels"]):
        failed.append(f"instances still count subscribed channels: {es['gauges']['postcache_subscribed_channels']}")

    total = len(records)
    conns = sum(1 for r in records if r[3] == "conn")
    wrong_all = sum(1 for r in records if is_wrong(r))
    five_all = collections.Counter(r[3] for r in records if isinstance(r[3], int) and r[3] >= 500)
    if wrong_all:
        failed.append(f"{wrong_all} wrong answers in the whole run")
    lines = [
        f"# Chaos soak, {kit.DAY}", "",
        f"`load/compare chaos` (--rate {args.rate} --posts {args.posts} --cache-ttl {args.cache_ttl} "
        f"--load-ms {args.load_ms}): {k} instances of the release binary against a private PostgreSQL "
        f"(initdb in a temporary directory) and a private Redis, {os.cpu_count()} cores shared with the load. "
        f"{args.rate} requests/s round-robin over the instances for {t_end - t0:.0f} s, ids Zipf({args.zipf}) over "
        f"posts 1..{args.posts} (all seeded), CACHE_TTL={args.cache_ttl}s with TTL_JITTER={CHAOS_JITTER}, "
        f"each load made to take {args.load_ms} ms (a slow view), other settings at their defaults "
        "(REDIS_TIMEOUT 250ms, LOCK_TTL 5s, WAIT_TIMEOUT 3s, FAILURE_TTL 2s, MAX_STALE 1h). "
        f"One fault at a time, {RECOVERY_SECONDS:.0f} s of steady load between them; "
        f"{total} requests in all: {wrong_all} wrong answers, 5xx {dict(sorted(five_all.items())) or 0}, "
        f"{conns} refused or cut before an answer.", "",
        "| fault | window | requests | 5xx by status | 5xx after, until the next fault | connection errors "
        "| timeouts (5 s) | wrong ids | hit ratio | back above 95% hits after | loads of one key, max (bound) "
        "| concurrent loads of one key, max (bound) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows, "",
        f"At the end (load stopped, 2 s later, instances still running): **{es['locks']} locks left** "
        f"(`--scan --pattern '{prefix}lock:*'`), **{es['channels']} ready channels with {es['subscribers']} "
        "subscribers left** (`PUBSUB CHANNELS`, `PUBSUB NUMSUB`); per instance, "
        f"`postcache_subscribed_channels` {fmt_list(es['gauges']['postcache_subscribed_channels'])} and "
        f"`postcache_flights_in_progress` {fmt_list(es['gauges']['postcache_flights_in_progress'])}.", "",
        "How to read it:", "",
        "- window: from the fault's injection to its end (at least "
        f"{FAULT_SECONDS:.0f} s, so that instantaneous faults are watched for a while), seconds after the "
        "load started. Requests are counted by the time they were sent.",
        "- 5xx after: responses with a 5xx to requests sent after the window, until the next fault.",
        "- connection errors: refused or cut before an answer (a kept-alive connection the server closed "
        "is retried once on a new one first); only the killed instance should have any.",
        "- wrong ids: a 200 whose body is another post, or a 4xx, for a seeded post (every requested id "
        "is seeded); counted in the window and after it. Must be 0.",
        "- hit ratio: X-Cache `hit` among the 200s of the window. back above 95%: from the fault's end to "
        "the start of the first 1 s window (sliding by 0.1 s) whose hit ratio is above 95%.",
        "- loads of one key: the most completed reads of one post in the window, from PostgreSQL's "
        "statement log (every statement logged with its parameters). With Redis up, a key is loaded once "
        f"for the fleet per lifetime, and every window is shorter than the shortest lifetime "
        f"({args.cache_ttl * (1 - CHAOS_JITTER):.0f} s), so the bound is 1. With Redis down every request "
        "is served from PostgreSQL (`bypass`), so there is no bound on the count, only on concurrency.",
        f"- concurrent loads of one key: the most reads of one post overlapping in time (start = log time − "
        f"duration; an overlap counts only past the log's 1 ms resolution, so this is a lower bound). "
        f"With Redis down each instance still runs one load per key at a time: at most {k}.",
        "- the failure table (docs/operations/failure-behaviour.md) says what each fault should do: Redis paused or killed, pub/sub "
        "connections killed, an instance killed: no 5xx (fail open, re-subscribe, the lock expires); "
        "PostgreSQL down: 503 unless a fail-safe copy exists (then `stale`).", "",
        "X-Cache mix of the 200s, database loads and latency (ms) of the answered requests, per window:", "",
        "| window | hit | miss | coalesced | stale | bypass | db loads | p50 | p99 | max |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *mix_rows, "",
    ]
    lines += service_warnings(fleet.logs, windows, t0)
    if warnings:
        lines += ["Warnings:", ""] + [f"- {w}" for w in warnings] + [""]
    lines += [f"Result: {'FAILED: ' + '; '.join(failed) if failed else 'passed (no wrong ids, nothing left)'}.", ""]
    return "\n".join(lines), failed


def fmt_list(values):
    return "[" + ", ".join("absent" if v is None else f"{v:g}" for v in values) + "]"


def service_warnings(paths, windows, t0):
    """The instances' warn and error lines (LOG_FORMAT=json), counted by message and
    fields (numbers folded) and by fault."""
    by_msg = collections.Counter()
    per_window = collections.Counter()
    for path in paths:
        with open(path, errors="replace") as f:
            for line in f:
                try:
                    e = json.loads(line)
                except ValueError:
                    if line.strip():
                        by_msg["(not json) " + line.strip()[:150]] += 1
                    continue
                if e.get("level") not in ("WARN", "ERROR"):
                    continue
                fields = ", ".join(f"{k}={v}" for k, v in e.items()
                                   if k not in ("timestamp", "level", "message", "target", "span", "spans")
                                   and not k.startswith("log."))
                text = f"{e.get('level')} {e.get('target', '')}: {e.get('message', '')}" + (f" ({fields})" if fields else "")
                text = re.sub(r"\bfred-\w+", "fred-…", text)  # a client's random name
                by_msg[re.sub(r"\b\d+(?:\.\d+)?(?:ms|s|µs)?\b", "N", text)[:300]] += 1
                try:
                    t = datetime.datetime.fromisoformat(e["timestamp"][:26].rstrip("Z") + "+00:00").timestamp()
                except (KeyError, ValueError):
                    continue
                for n, w in enumerate(windows[1:], 1):
                    if w["start"] <= t < (windows[n + 1]["start"] if n + 1 < len(windows) else float("inf")):
                        per_window[w["name"]] += 1
    if not by_msg:
        return ["The instances logged no warnings or errors (RUST_LOG=warn).", ""]
    out = ["Warnings and errors the instances logged (RUST_LOG=warn; raw logs in `raw/chaos/`, not "
           "committed), by fault, from its start to the next one's: " +
           ", ".join(f"{name}: {per_window.get(name, 0)}" for name in [w["name"] for w in windows[1:]]) + ".",
           "", "| lines | level, target: message (fields; numbers folded to N) |", "|---|---|"]
    out += [f"| {c} | {msg.replace('|', '/')} |" for msg, c in by_msg.most_common(15)]
    return out + [""]


