"""The load lab behind load/compare: a small kit shared by the comparisons
(kit, flags, procs, db, servers, runners, cpu, report) and one module per
comparison in scenarios/."""
