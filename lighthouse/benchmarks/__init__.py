"""The pieces of `python -m lighthouse.bench` (see lighthouse/bench.py): `suite` (what runs),
`limits` (the machine's FMA peak and bandwidth), `measure` (what a child process measures),
`isolate` (child processes with timeouts), `report` (table, CSV, JSON, chart)."""
