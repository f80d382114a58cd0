"""Manager limits against a no-op engine: ingest + deduce + schedule throughput, and
scheduling-decision latency with many concurrent open runs.

    .venv/bin/python benchmarks/manager_bench.py [--runs 2000] [--repeat 3]
        [--open-runs 1000] [--calls 5000] [--gc-threshold 50000] [--gc-freeze] [--server-gc]

1. Throughput: create runs of a small map-reduce program (4 maps sharing a system prompt,
   1 reduce) and wait for all to finish. Every call is parsed, validated, deduced,
   rendered (segment-wise tokens, prefix keys), scheduled, dispatched and "generated" (the
   engine, `testing.fake_engine.NoopEngine`, does no work: it answers EOS at once and keeps
   only the set of live contexts, which must be empty at the end). Reported: calls per second, on
   one core (one event loop), for each of `--repeat` passes (a fresh manager each) and
   their median: one pass takes about half a second, so a shared machine's hiccups
   show in single passes.
2. Decision latency: open `--open-runs` runs, then add calls to random runs one at a time;
   each call is ready at once. Reported: percentiles of ready -> dispatched (the time a
   ready call waits for its scheduling decision), and of dispatcher round durations; then
   the same for a burst where every open run gets a call at once. In the burst, one
   coroutine ingests all the calls before the dispatcher gets the loop, so ready ->
   dispatched there is mostly ingestion time; the rounds (each places up to `max_batch`
   calls) are the decisions.

Garbage collection: by default Python's collector runs as it would in a server that was
never tuned; full collections walk every live object, including this benchmark's run specs
and everything imported. `--gc-freeze` calls `gc.freeze()` before each timed phase (after
the specs are built), as a server may do after start-up: what existed then is no longer
walked, while everything the manager makes is collected as usual. `--gc-threshold` raises
the gen-0 threshold. `--server-gc` applies `parrot_backend.manager.gctune.configure_gc()`
once at the start (before any phase builds its specs), as the server process does after
start-up: a collection, `gc.freeze()` of what is alive (imports and the like), and the
gen-0 threshold raised to `gctune.GEN0_THRESHOLD` (10,000); it excludes the other two.
None is on by default: compare figures made the same way, and report both the default
and the `--server-gc` figures.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import statistics
import sys
import time

from parrot_backend.manager.manager import Manager, ManagerConfig
from parrot_backend.program import CallSpec, RunSpec
from parrot_backend.testing.fake_engine import NoopEngine

SYSTEM = "You are a careful analyst. Summarize the text you are given in one sentence. "


def map_reduce(i: int) -> RunSpec:
    calls = [
        {
            "name": f"m{k}",
            "template": SYSTEM + f"Text: {{{{input:c{k}}}}} Summary: {{{{output:s{k}}}}}",
        }
        for k in range(4)
    ]
    calls.append(
        {
            "name": "r",
            "template": "Combine {{input:s0}} {{input:s1}} {{input:s2}} {{input:s3}}: "
            "{{output:total}}",
        }
    )
    return RunSpec.model_validate(
        {
            "program": {"calls": calls},
            "inputs": {f"c{k}": f"document {i} part {k}" for k in range(4)},
            "outputs": {"total": "throughput"},
        }
    )


def noop_engine() -> NoopEngine:
    return NoopEngine(model_name="noop")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def show(label: str, xs: list[float]) -> None:
    ms = [x * 1000 for x in xs]
    print(
        f"  {label}: n={len(ms)} p50={pct(ms, 0.5):.3f} ms p90={pct(ms, 0.9):.3f} ms "
        f"p99={pct(ms, 0.99):.3f} ms max={max(ms):.3f} ms mean={statistics.fmean(ms):.3f} ms"
    )


def freeze(on: bool) -> None:
    """`gc.freeze()` what is alive now (see the module doc), or undo it."""
    if on:
        gc.collect()
        gc.freeze()
    else:
        gc.unfreeze()


async def throughput(n_runs: int, gc_freeze: bool = False) -> float:
    """One pass: a fresh manager runs `n_runs` runs; returns calls per second."""
    specs = [map_reduce(i) for i in range(n_runs)]  # client-side JSON parsing not counted
    freeze(gc_freeze)
    engine = noop_engine()
    # The whole batch is submitted at once: the per-tenant limit (a fairness bound for
    # servers) must admit it.
    config = ManagerConfig(max_calls_per_tenant=5 * n_runs + 1)
    async with Manager({"e0": engine}, config=config) as m:
        start = time.perf_counter()
        ids = [await m.create_run(s) for s in specs]
        for rid in ids:
            async for _ in m.subscribe(rid):
                pass
        wall = time.perf_counter() - start
        calls = 5 * n_runs
        assert all(m.run_status(r).state == "finished" for r in ids)
    assert not engine.live, f"{len(engine.live)} engine contexts were never freed"
    freeze(False)
    print(f"throughput: {n_runs} runs, {calls} calls in {wall:.2f} s")
    print(f"  {calls / wall:,.0f} calls/s ingested + deduced + scheduled + run (goal >= 20,000)")
    return calls / wall


def decision_path(n_runs: int) -> None:
    """The same work without the event loop and the engine: build + check the program,
    deduce objectives, render and key each call, and schedule it (in rounds of 256)."""
    from parrot_backend.manager.ingest import CallBuilder
    from parrot_backend.manager.objectives import deduce_shared
    from parrot_backend.manager.policy import EngineSnapshot, PendingCall, schedule
    from parrot_backend.manager.render import PromptTokenizer, render_call

    engine = noop_engine()
    tokens = PromptTokenizer.for_engine(engine)
    builder = CallBuilder()
    specs = [map_reduce(i) for i in range(n_runs)]
    start = time.perf_counter()
    pending: list[PendingCall] = []
    for i, spec in enumerate(specs):
        program = builder.program(spec)
        deduction = deduce_shared(program, spec.outputs)  # as the manager does
        values = dict(spec.inputs)
        for name, call in program.calls.items():
            if not all(v in values for v in call.inputs):
                continue  # the reduce becomes ready later; counted as deduced only
            plan, prefixes = render_call(call, values, tokens, "noop", "t:")  # as the manager
            obj = deduction.calls[name]
            group = None if obj.group is None else f"{i}/{obj.group}"
            pending.append(
                PendingCall(f"{i}/{name}", obj.objective, plan.n_tokens, 0.0, prefixes[:1], group)
            )
    built = time.perf_counter()
    engines = [EngineSnapshot("e0", free_kv_tokens=1 << 30)]
    for k in range(0, len(pending), 256):
        schedule(pending[k : k + 256], engines, 0.0)
    done = time.perf_counter()
    calls = 5 * n_runs
    print(f"decision path (no event loop, no engine): {calls} calls")
    print(f"  build + deduce + render + prefix keys: {calls / (built - start):,.0f} calls/s")
    print(f"  schedule (rounds of 256 ready calls):  {len(pending) / (done - built):,.0f} calls/s")
    print(f"  together: {calls / (done - start):,.0f} calls/s")


async def latency(open_runs: int, n_calls: int, gc_freeze: bool = False) -> None:
    rng = random.Random(0)
    freeze(gc_freeze)
    async with Manager({"e0": noop_engine()}) as m:
        first = {"program": {"calls": [{"template": SYSTEM + "Start: {{output:x}}"}]}, "open": True}
        ids = [await m.create_run(RunSpec.model_validate(first)) for _ in range(open_runs)]
        while m.calls_dispatched < open_runs or any(m.runs[r].tasks for r in ids):
            await asyncio.sleep(0.01)  # the opening calls are done: measure from here
        m.dispatch_delays.clear()
        m.round_durations.clear()
        for i in range(n_calls):
            rid = rng.choice(ids)
            await m.add_calls(rid, [CallSpec(template=SYSTEM + f"Step {i}: {{{{output:y{i}}}}}")])
            await asyncio.sleep(0)  # a client's next request arrives a bit later
        while m.calls_dispatched < open_runs + n_calls:
            await asyncio.sleep(0.01)
        print(f"decision latency, steady arrivals, {open_runs} open runs, {n_calls} calls:")
        show("ready -> dispatched", list(m.dispatch_delays))
        show("dispatcher round", list(m.round_durations))
        m.dispatch_delays.clear()
        m.round_durations.clear()
        before = m.calls_dispatched
        for i, rid in enumerate(ids):
            await m.add_calls(rid, [CallSpec(template=SYSTEM + f"Burst {i}: {{{{output:b}}}}")])
        while m.calls_dispatched < before + open_runs:
            await asyncio.sleep(0.01)
        print(f"decision latency, burst: every one of {open_runs} open runs adds a call at once:")
        show("ready -> dispatched", list(m.dispatch_delays))
        show("dispatcher round", list(m.round_durations))
    freeze(False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--open-runs", type=int, default=1000)
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="throughput passes (each a fresh manager); the median is reported",
    )
    parser.add_argument(
        "--gc-threshold",
        type=int,
        default=0,
        help="gen-0 GC threshold (e.g. 50000, a common server setting); 0 keeps Python's",
    )
    parser.add_argument(
        "--gc-freeze",
        action="store_true",
        help="gc.freeze() before each timed phase (see the module doc); off by default",
    )
    parser.add_argument(
        "--server-gc",
        action="store_true",
        help="apply gctune.configure_gc() once at the start, as the server does (module doc)",
    )
    args = parser.parse_args()
    if args.server_gc and (args.gc_threshold or args.gc_freeze):
        parser.error("--server-gc sets the threshold and freezes: use it alone")
    if args.server_gc:
        from parrot_backend.manager.gctune import configure_gc

        configure_gc()
    if args.gc_threshold:
        # many small objects per call: the default threshold (700) collects constantly
        gc.set_threshold(args.gc_threshold, 20, 20)
    print("command:", " ".join([".venv/bin/python", *sys.argv]))
    # collect between phases: one phase's garbage must not pause the next one's timings
    rates = []
    for _ in range(args.repeat):
        rates.append(asyncio.run(throughput(args.runs, args.gc_freeze)))
        gc.collect()
    if args.repeat > 1:
        print(
            f"throughput, median of {args.repeat} passes: {statistics.median(rates):,.0f} calls/s"
            f" (min {min(rates):,.0f}, max {max(rates):,.0f}; goal >= 20,000)"
        )
    gc.collect()
    decision_path(args.runs)
    gc.collect()
    asyncio.run(latency(args.open_runs, args.calls, args.gc_freeze))


if __name__ == "__main__":
    main()
