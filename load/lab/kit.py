"""The lab's settings and shared state: where the project and the results
are, which PostgreSQL and Redis the helpers talk to, and what is running.

Every module refers to these as kit.NAME at the time of use, never through
`from kit import NAME`: use_servers() rebinds DB_SERVER and REDIS_URL (chaos
points everything at servers of its own), and the cleanup on exit must see
every process and undo action any module registered."""

import datetime
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOAD = os.path.join(ROOT, "load")
DB_SERVER = os.environ.get("DATABASE_SERVER", "postgres://postgres@127.0.0.1:5432")
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379")
# Plain connections to PostgreSQL unless asked otherwise: the comparisons
# measure the cache, and CI turns ssl on in the server of the README, where
# the client's default (prefer) would put TLS on every statement of `none`
# and of the loads, and make figures of different days incomparable.
os.environ.setdefault("PGSSLMODE", "disable")
SEEDED = 100_000
DAY = datetime.date.today().isoformat()
RESULTS = os.path.join(LOAD, "results", DAY)  # this run's results directory
RUNNING = []  # every process started here and not stopped yet
CLEANUPS = []  # undo actions for what is not a child process (a private PostgreSQL, temp dirs), run last first


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def use_servers(db_server, redis_url):
    """Points every helper (psql, redis_cli, prepare_database, start_instances)
    at other servers: chaos runs against private ones."""
    global DB_SERVER, REDIS_URL
    DB_SERVER, REDIS_URL = db_server, redis_url
