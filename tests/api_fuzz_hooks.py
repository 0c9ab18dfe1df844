"""Schemathesis hooks for tests/api-fuzz: the headers of read your writes.

- A PostCache-Min-LSN past the database's WAL position is a documented 400
  that depends on the server's state, not on the schema. In the cases
  schemathesis means as valid, a position past the instance's own
  (`change_feed_position` in /readyz at the start, API_FUZZ_POSITION) is
  brought down to it, so every such request stays one the service must
  accept. The 400 itself is checked in tests/it/read_your_writes.rs.
- schemathesis 4.32 now and then fills a header of a case it means as
  valid with a value that its own schema's pattern refuses (`0` for
  PostCache-Min-LSN): such cases are dropped, since the service must refuse
  them. The invalid cases are left as drawn.
"""

import os
import re

import schemathesis

LSN = re.compile(r"^[0-9A-Fa-f]{1,8}/[0-9A-Fa-f]{1,8}$")
STALENESS = re.compile(r"^[0-9]{1,10}(ms|s)$")

CEILING = 0
if os.environ.get("API_FUZZ_POSITION"):
    high, low = os.environ["API_FUZZ_POSITION"].split("/")
    CEILING = (int(high, 16) << 32) | int(low, 16)


def _positive(case):
    meta = getattr(case, "meta", None)
    return meta is not None and meta.generation.mode.is_positive


def _ours(case):
    """The case's read-your-writes headers, by their lower-case names."""
    return {
        name.lower(): (name, value)
        for name, value in (case.headers or {}).items()
        if name.lower() in ("postcache-min-lsn", "postcache-max-staleness")
    }


@schemathesis.hook
def filter_case(ctx, case):
    if not _positive(case):
        return True
    for lower, (_, value) in _ours(case).items():
        pattern = LSN if lower == "postcache-min-lsn" else STALENESS
        if not isinstance(value, str) or not pattern.match(value):
            return False
    return True


@schemathesis.hook
def map_case(ctx, case):
    if not _positive(case):
        return case
    found = _ours(case).get("postcache-min-lsn")
    if found is None or not isinstance(found[1], str) or not LSN.match(found[1]):
        return case
    name, value = found
    high, low = value.split("/")
    if (int(high, 16) << 32) | int(low, 16) > CEILING:
        case.headers[name] = f"{CEILING >> 32:X}/{CEILING & 0xFFFFFFFF:X}"
    return case
