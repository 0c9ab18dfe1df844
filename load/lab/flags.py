"""The flags several comparisons take, each defined and worded here once:
how many rounds, how long each run, how many connections, which post, where
the results go. Each adds its flag to a subcommand's parser s; `what` says
what the number counts in that comparison, and the help ends with the
default."""


def add_rounds(s, default, what="rounds"):
    s.add_argument("--rounds", type=int, default=default, help=f"{what} (default {default})")


def add_seconds(s, default, what="seconds per wrk run"):
    s.add_argument("--seconds", type=int, default=default, help=f"{what} (default {default})")


def add_connections(s, default=64, what="wrk connections"):
    s.add_argument("--connections", type=int, default=default, help=f"{what} (default {default})")


def add_post(s):
    s.add_argument("--post", type=int, default=1, help="the post read (default 1)")


def add_out(s, default):
    s.add_argument("--out", help=f"the results file's name (default {default})")
