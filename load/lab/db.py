"""PostgreSQL and Redis helpers, against the servers kit.DB_SERVER and
kit.REDIS_URL name at the time of the call."""

import os
import shlex
import subprocess
import sys
import time

from . import kit

# The databases the comparisons use on the shared server (chaos has a server of its own).
STRATEGIES_DB = "postcache_loadlab"
CAPACITY_DB = "postcache_capacity"  # capacity, hit-ab, hits and readyz-flood
PEERS_DB = "postcache_peers"
COLD_DB = "postcache_coldstorm"  # cold-storm and missing-ids (1,000,000 posts, seeded once)
SHARED_DBS = (STRATEGIES_DB, CAPACITY_DB, PEERS_DB, COLD_DB)


# -- PostgreSQL ------------------------------------------------------------------------


def psql(db, sql):
    out = subprocess.run(["psql", f"{kit.DB_SERVER}/{db}", "-qAtc", sql],
                         capture_output=True, text=True, check=True, timeout=120)
    return out.stdout.strip()


def database_env(db):
    return dict(os.environ, DATABASE_URL=f"{kit.DB_SERVER}/{db}")


def migrate(binary, db):
    subprocess.run([binary, "migrate"], env=database_env(db), check=True, stdout=subprocess.DEVNULL, timeout=300)


def seed(binary, db, posts, timeout):
    subprocess.run([binary, "seed", "--posts", str(posts)], env=database_env(db), check=True,
                   stdout=subprocess.DEVNULL, timeout=timeout)


def prepare_database(binary, db, posts=kit.SEEDED):
    """Creates and migrates db, drops a slow view left behind, seeds posts 1..=posts."""
    migrate(binary, db)
    restore_database(db)
    seed(binary, db, posts, timeout=600)


def ensure_seeded(binary, db, posts):
    """Migrates db and seeds posts 1..=posts unless they are all there already
    (a large table is seeded once and kept across runs)."""
    migrate(binary, db)
    if psql(db, "select count(*) from posts where id between 1 and %d" % posts) != str(posts):
        kit.log(f"seeding {posts:,} posts")
        seed(binary, db, posts, timeout=1800)


def slow_database(db, load_ms):
    """Makes every load take load_ms: posts becomes a view over posts_data whose
    query sleeps (a stand-in for a heavier query); undone by restore_database."""
    restore_database(db)
    if load_ms > 0:
        psql(db, "alter table posts rename to posts_data; create view posts as select p.* from "
                 f"posts_data p cross join lateral (select pg_sleep({load_ms / 1000})) slow")


def restore_database(db):
    if psql(db, "select count(*) from pg_views where viewname = 'posts'") != "0":
        psql(db, "drop view posts; alter table posts_data rename to posts")


def post_reads(db):
    """Reads of the posts table so far (posts_data under the slow view), from
    PostgreSQL's statistics: exact once the service's backends have exited (they
    flush their statistics then), so this waits for them first."""
    deadline = time.time() + 20
    while int(psql(db, "select count(*) from pg_stat_activity where datname = current_database() "
                       "and application_name = 'postcache' and pid <> pg_backend_pid()")) > 0:
        if time.time() > deadline:
            sys.exit("error: service backends did not exit")
        time.sleep(0.05)
    return int(psql(db, "select coalesce(sum(coalesce(seq_scan,0)+coalesce(idx_scan,0)),0) "
                        "from pg_stat_user_tables where relname in ('posts','posts_data')"))


def transactions(db):
    """Transactions ended in db (committed plus rolled back): each load
    statement is one. Exact once the service's backends have exited."""
    post_reads(db)  # waits for them
    return int(psql(db, "select xact_commit + xact_rollback from pg_stat_database "
                        "where datname = current_database()"))


def drop_fleet_slots():
    """Drops the replication slots that stopped fleets left on the shared server.
    Each fleet (a database and a KEY_PREFIX) makes one under CHANGE_FEED=auto, and
    every run here starts fleets with fresh prefixes: left there, they keep WAL,
    and once the server's max_replication_slots are taken the next fleet's feed
    cannot start, so its memory tier stays off. A slot still streamed (a fleet
    still running) is left alone; one whose walsender has not ended yet goes on
    the next call."""
    dbs = ", ".join(f"'{d}'" for d in SHARED_DBS)
    deadline = time.time() + 2
    try:
        while time.time() < deadline and int(psql("postgres", "select count(*) from pg_replication_slots "
                                                              f"where active and database in ({dbs})")) > 0:
            time.sleep(0.1)
        psql("postgres", "select count(pg_drop_replication_slot(slot_name)) from pg_replication_slots "
                         f"where not active and database in ({dbs})")
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        kit.log(f"warning: could not drop the fleets' replication slots: {e}")


# -- Redis -----------------------------------------------------------------------------


def redis_host_port(url=None):
    """The host and port of url, kit.REDIS_URL by default."""
    host_port = (url or kit.REDIS_URL).split("//", 1)[1].split("/")[0].rsplit("@", 1)[-1]
    host, port = host_port.split(":")
    return host, port


def redis_cli(*args, url=None):
    """redis-cli's output for args, against url (kit.REDIS_URL by default)."""
    host, port = redis_host_port(url)
    out = subprocess.run(["redis-cli", "-h", host, "-p", port, *args],
                         capture_output=True, text=True, check=True, timeout=30)
    return out.stdout


def redis_commandstats():
    """INFO commandstats: {command: (calls, µs)}, scripts' inner commands
    counted as commands of their own (and in the script's µs too)."""
    got = {}
    for line in redis_cli("info", "commandstats").splitlines():
        if line.startswith("cmdstat_"):
            name, rest = line[len("cmdstat_"):].split(":", 1)
            fields = dict(kv.split("=", 1) for kv in rest.strip().split(","))
            got[name] = (int(fields["calls"]), float(fields["usec"]))
    return got


def redis_commands():
    return sum(calls for calls, _ in redis_commandstats().values())


def drop_prefix(prefix):
    """Unlinks every key under `prefix` on the shared Redis (a run's own
    KEY_PREFIX): a storm leaves millions of keys behind, which would slow
    every SCAN of that Redis (the tests' clean-ups) for their TTL."""
    host, port = redis_host_port()
    cli = f"redis-cli -h {shlex.quote(host)} -p {shlex.quote(port)}"
    subprocess.run(f"{cli} --scan --pattern {shlex.quote(prefix + '*')} | xargs -r -n 1000 {cli} unlink >/dev/null",
                   shell=True, check=False, timeout=600)
