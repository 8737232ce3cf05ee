"""`kvwrite bench`: latency and bandwidth of every store op against the same-run copy bandwidth
and the usual alternatives. cases.py (what to store), timing.py (how to time), run.py (the
sweep), report.py (table, JSON, markdown, plot); the command is kvwrite/cli/bench.py."""
