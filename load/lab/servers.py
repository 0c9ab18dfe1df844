"""Servers started here: postcache instances, the small example servers and
nginx beside them, and a private PostgreSQL and Redis (chaos). Each is a
child process registered in kit.RUNNING or an undo action in kit.CLEANUPS,
and comes up through procs.wait_for's guards (the process still running, a
deadline)."""

import collections
import contextlib
import csv
import datetime
import glob
import os
import pwd
import re
import signal
import subprocess
import sys
import urllib.request

from . import db, kit
from .procs import free_port, kill, spawn, wait_for, wait_port, wait_up


# -- postcache -------------------------------------------------------------------------


def start_instances(binary, database, k, prefix, stderr=None, ports=None, stdout=subprocess.DEVNULL, under=(),
                    **settings):
    """Starts k instances sharing one KEY_PREFIX (settings: more environment), on
    free ports or on the given ones (a restart), their logs (stdout) discarded
    unless stdout says where, each under the command `under` (taskset, which
    execs it: the pid stays the instance's); returns their processes and base
    URLs once each answers /healthz."""
    procs, urls = [], []
    for i in range(k):
        port = ports[i] if ports else free_port()
        env = dict(os.environ, DATABASE_URL=f"{kit.DB_SERVER}/{database}", REDIS_URL=kit.REDIS_URL,
                   KEY_PREFIX=prefix, LISTEN_ADDR=f"127.0.0.1:{port}", NO_MIGRATE="true",
                   RUST_LOG="warn", **settings)
        procs.append(spawn([*under, binary, "serve"], env=env, stdout=stdout, stderr=stderr))
        urls.append(f"http://127.0.0.1:{port}")
    for proc, url in zip(procs, urls):
        wait_up(url + "/healthz", proc)
    return procs, urls


def metric_sums(url, timeout=10):
    """Each metric of url's /metrics summed over its labels."""
    sums = collections.Counter()
    for line in urllib.request.urlopen(url + "/metrics", timeout=timeout).read().decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            sums[name.split("{", 1)[0]] += float(value)
    return sums


# -- servers beside it -----------------------------------------------------------------


def serve(cmd, port, what):
    """Starts cmd, a server listening on port of 127.0.0.1, its output
    discarded; returns its process once the port takes connections."""
    proc = spawn(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port, proc, what)
    return proc


# The start of every nginx.conf here: what the comparisons set alike, up to
# the http block's own settings; each comparison's template goes on from there.
NGINX_MAIN = """\
{user}worker_processes {workers};
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
daemon off;
events {{ worker_connections 4096; }}
http {{
    access_log off;
"""


def start_nginx(nginx, http, d, port, under=(), **fields):
    """nginx in the directory d, its configuration NGINX_MAIN then http, the
    template of the rest of the http block (their {user}, {dir} and {port}
    filled in here, the other fields given: {workers} among them)."""
    conf = os.path.join(d, "nginx.conf")
    template = NGINX_MAIN + http + "}}\n"
    with open(conf, "w") as f:
        f.write(template.format(user="user root;\n" if os.geteuid() == 0 else "", dir=d, port=port, **fields))
    return serve([*under, nginx, "-c", conf, "-p", d], port, "nginx")


def start_baseline(baseline):
    """examples/baseline (an axum handler of a constant body at /const, one
    doing a Redis GET at /redis-get) on a free port; returns its base URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    wait_up(url + "/const", spawn([baseline, f"127.0.0.1:{port}", kit.REDIS_URL],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return url


# -- a private PostgreSQL and Redis ----------------------------------------------------


def as_postgres(cmd):
    """cmd, run as the postgres user when this runs as root (initdb and pg_ctl refuse root)."""
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


class PrivatePostgres:
    """A throwaway PostgreSQL: data, socket and logs in tmp, a free port of
    127.0.0.1, trust auth. After log_statements() every completed statement is
    logged with its duration and parameters, in csv (loads() reads them back)."""

    def __init__(self, tmp):
        found = glob.glob("/usr/lib/postgresql/*/bin/pg_ctl")
        if not found:
            sys.exit("error: no /usr/lib/postgresql/*/bin/pg_ctl: install the PostgreSQL server package")
        newest = max(found, key=lambda p: [int(x) for x in re.findall(r"\d+", p.split("/")[4])])
        self.bin = os.path.dirname(newest)
        self.tmp, self.data = tmp, os.path.join(tmp, "pgdata")
        self.port = free_port()
        self.server = f"postgres://postgres@127.0.0.1:{self.port}"
        self.csv = os.path.join(tmp, "log", "pg.csv")

    def run(self, tool, *args, timeout=60):
        r = subprocess.run(as_postgres([os.path.join(self.bin, tool), *args]), cwd=self.tmp,
                           capture_output=True, text=True, timeout=timeout, start_new_session=True)
        if r.returncode:
            raise RuntimeError(f"{tool} {args[-1]} failed: {(r.stderr or r.stdout).strip()[-1500:]}")

    def pg_ctl(self, action, *args, timeout=60):
        # -l always: without it the postmaster would inherit (and hold open) our pipes
        self.run("pg_ctl", "-D", self.data, "-l", os.path.join(self.tmp, "pg_ctl.log"), "-w", "-t",
                 str(timeout - 10), *args, action, timeout=timeout)

    def start(self):
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            os.chown(self.tmp, pw.pw_uid, pw.pw_gid)
        self.run("initdb", "-D", self.data, "-U", "postgres", "-A", "trust", "-E", "UTF8",
                 "--locale=C", "--no-sync", "--no-instructions")
        kit.CLEANUPS.append(self.stop)
        settings = ["listen_addresses=127.0.0.1", f"unix_socket_directories={self.tmp}",
                    "max_connections=200", "fsync=off", "synchronous_commit=off", "full_page_writes=off",
                    "logging_collector=on", "log_destination=csvlog", f"log_directory={self.tmp}/log",
                    "log_filename=pg.log", "log_rotation_age=0", "log_rotation_size=0", "log_timezone=UTC"]
        self.pg_ctl("start", "-o", " ".join([f"-p {self.port}"] + [f"-c {s}" for s in settings]))

    def log_statements(self, database):
        """Through database (kit.DB_SERVER must be this server)."""
        db.psql(database, "alter system set log_min_duration_statement = 0")  # kept across restarts
        db.psql(database, "select pg_reload_conf()")

    def restart(self):
        self.pg_ctl("restart", "-m", "fast")

    def stop(self):
        pidfile = os.path.join(self.data, "postmaster.pid")
        if not os.path.exists(pidfile):
            return
        with open(pidfile) as f:
            pid = int(f.readline())
        try:
            self.pg_ctl("stop", "-m", "immediate", timeout=30)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            kit.log(f"pg_ctl stop: {e}; killing the postmaster {pid}")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def loads(self):
        """(start, end, post id) of every completed load of a post, from the statement log:
        end is the log's timestamp (1 ms resolution), start end minus the logged duration."""
        out = []
        if not os.path.exists(self.csv):
            return out
        with open(self.csv, newline="") as f:
            for row in csv.reader(f):
                if len(row) < 15 or "execute" not in row[13] or "from posts where id = $1" not in row[13]:
                    continue
                d = re.match(r"duration: ([0-9.]+) ms", row[13])
                p = re.search(r"\$1 = '(-?\d+)'", row[14])
                if not (d and p):
                    continue
                end = datetime.datetime.strptime(row[0][:23], "%Y-%m-%d %H:%M:%S.%f").replace(
                    tzinfo=datetime.timezone.utc).timestamp()
                out.append((end - float(d.group(1)) / 1000, end, int(p.group(1))))
        return out


class PrivateRedis:
    """A throwaway redis-server on a free port of 127.0.0.1, no persistence; it can be
    killed (SIGKILL) and started again on the same port."""

    def __init__(self, tmp, logfile):
        self.port, self.tmp, self.logfile, self.proc = free_port(), tmp, logfile, None
        self.url = f"redis://127.0.0.1:{self.port}"

    def start(self):
        with open(self.logfile, "a") as out:
            self.proc = spawn(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--dir", self.tmp], stdout=out, stderr=subprocess.STDOUT)
        # Its own port: the first start comes before kit.REDIS_URL points here.
        wait_for(lambda: db.redis_cli("ping", url=self.url).strip() == "PONG", self.proc,
                 f"error: redis-server did not start on :{self.port} (see {self.logfile})",
                 timeout=10, errors=(subprocess.CalledProcessError,))

    def kill(self):
        kill(self.proc)
