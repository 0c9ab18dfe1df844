"""One module per comparison. Each has add_parser(sub, common), which adds
its subcommand (common: the flags every subcommand takes) with run(args) as
what it runs, and its docstring says what it compares. A new comparison is
one module here plus its name in SCENARIOS (and a paragraph in load/compare's
docstring)."""

from . import (capacity, chaos, cold_storm, hit_ab, hit_instructions, hits, missing_ids, peers, readyz_flood,
               staleness_flood, strategies)

# In the order of the list of subcommands in load/compare --help.
SCENARIOS = [strategies, capacity, hit_ab, hits, hit_instructions, readyz_flood, staleness_flood, cold_storm,
             missing_ids, peers, chaos]
