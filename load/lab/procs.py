"""Processes: starting them (spawn, registered in kit.RUNNING), waiting for
them to come up, stopping them, and the undo actions of kit.CLEANUPS, all run
on exit, on errors, on Ctrl-C and on SIGTERM (guarded)."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from . import db, kit


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(cmd, **kw):
    p = subprocess.Popen(cmd, **kw)
    kit.RUNNING.append(p)
    return p


def stop(procs):
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        if p in kit.RUNNING:
            kit.RUNNING.remove(p)
    if procs:
        db.drop_fleet_slots()


def stop_all():
    stop(list(kit.RUNNING))


def kill(p):
    """SIGKILLs p (a fault to inject, not a clean stop) and forgets it."""
    p.kill()
    p.wait()
    kit.RUNNING.remove(p)


def wait_for(ready, proc, error, timeout=20, errors=(OSError,)):
    """Polls ready() every 50 ms until it returns true (one of errors raised
    counts as not yet); exits with error once proc has ended or timeout
    seconds have passed. Every server started here is waited for by this."""
    deadline = time.time() + timeout
    while True:
        try:
            if ready():
                return
        except errors:
            pass
        if proc.poll() is not None or time.time() > deadline:
            sys.exit(error)
        time.sleep(0.05)


def wait_up(url, proc):
    """Until url answers with a success, while proc runs."""
    def answers():
        urllib.request.urlopen(url, timeout=1).read()
        return True
    wait_for(answers, proc, f"error: {url} did not come up")


def wait_port(port, proc, what):
    """Until port of 127.0.0.1 takes connections, while proc runs."""
    def listens():
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    wait_for(listens, proc, f"error: {what} did not come up on :{port}")


def temp_dir(prefix, mode=None):
    """A temporary directory (mode: its permissions, for servers running as
    another user), removed on exit."""
    tmp = tempfile.mkdtemp(prefix=prefix)
    kit.CLEANUPS.append(lambda: shutil.rmtree(tmp, ignore_errors=True))
    if mode is not None:
        os.chmod(tmp, mode)
    return tmp


def run_cleanups():
    """Runs the registered undo actions, last registered first, each whatever the
    others do; Ctrl-C, SIGTERM and a pending alarm are ignored meanwhile (each
    action is bounded)."""
    signal.alarm(0)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    while kit.CLEANUPS:
        action = kit.CLEANUPS.pop()
        try:
            action()
        except Exception as e:  # noqa: BLE001 - the next cleanup must still run
            kit.log(f"cleanup failed: {e!r}")


def guarded(run, args):
    """run(args), then every process still running stopped and every cleanup
    run, whether it returns, fails, or is interrupted (Ctrl-C, SIGTERM,
    SIGHUP)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through the cleanup below
    signal.signal(signal.SIGHUP, lambda *_: sys.exit(129))
    try:
        run(args)
    except KeyboardInterrupt:
        sys.exit("interrupted")
    finally:
        stop_all()
        run_cleanups()
