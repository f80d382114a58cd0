"""Application benchmarks: the paper's workloads run whole (Parrot) and call by call
(request-level, over the OpenAI-compatible API), side by side on one server.

`texts` makes the deterministic workload texts, `workloads` the applications as DAGs of
calls, `modes` runs them (parrot, request-level, transformers), `serve` starts the server
with the counters the harness reads, `report` writes the table and plots.
Entry point: `benchmarks/app_bench.py`.
"""
