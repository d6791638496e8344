"""moeroute's benchmarks: `python -m bench --list` names them, `python -m bench <name>` runs one,
`python -m bench.report` renders docs/performance.md from bench/results/*.json."""
