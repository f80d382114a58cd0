"""`parrot-backend serve` for the harness, with what the benchmark must see or vary.

Runs the real `serve` command (`parrot_backend.cli.main(["serve", ...])`: same store,
manager, engine and routes) after two additions, neither of which changes how a request
is served:

- `--latency-capacity N`: the manager's `PolicyConfig.latency_capacity` (default 8), to
  test whether it is what queues latency calls.
- `GET /bench/engine`: the engine's own counters (`Engine.stats_now()`: tokens computed,
  generated, steps, token-cache hits) and its torch thread count; `GET /bench/steps?after=N`:
  one record per engine step (start, duration, sequences, tokens computed, decode rows,
  prefill tokens, priorities), kept in memory; `GET /bench/manager`: the manager's counts
  and ready -> dispatched delays. (`/metrics` has tokens computed too, but not the step
  log, and not prefill tokens of the in-process engine.)

The request-level baseline turns the engine's token-level prefix cache off with serve's
own `--no-prefix-cache`, passed through like every other serve option.

Usage: python benchmarks/appbench/serve.py [--latency-capacity N] [serve options...]
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from collections import deque


def _take(argv: list[str], flag: str) -> tuple[list[str], str | None]:
    """`argv` without `flag` and its value, and that value (None: not given)."""
    if flag not in argv:
        return argv, None
    i = argv.index(flag)
    return argv[:i] + argv[i + 2 :], argv[i + 1]


def _record_steps(engine, log: deque) -> None:
    """Wrap the engine's step so every step leaves a record (on the event loop thread).
    A private hook: when the engine no longer has `_step`, the log stays empty."""
    step = getattr(engine, "_step", None)
    if step is None:
        print("appbench: engine has no _step; /bench/steps stays empty", file=sys.stderr)
        return

    async def timed(work):
        began = time.perf_counter()
        out = await step(work)
        decode = sum(1 for w in work if w.n == 1 and w.samples)
        tokens = sum(w.n for w in work)
        log.append(
            {
                "t": began,
                "dt": time.perf_counter() - began,
                "seqs": len(work),
                "tokens": tokens,
                "decode": decode,
                "prefill": tokens - decode,
                # draft tokens the decode rows checked (`engine/speculate.py`)
                "drafts": sum(len(getattr(w, "draft", None) or ()) for w in work),
                "latency_rows": sum(1 for w in work if w.req.priority == 0),
                "threads": _threads(engine),
                # the count this step ran with (a probe's tried count included)
                "step_threads": _step_threads(engine),
                # it paused between layers for more urgent work (`engine/step_loop.py`):
                # `dt` is its time up to the pause, a later "resumed" record the rest
                "paused": type(out).__name__ == "Paused",
            }
        )
        return out

    engine._step = timed
    resume = getattr(engine, "_resume", None)
    if resume is None:
        return

    async def timed_resume(**kw):
        began = time.perf_counter()
        work = engine._paused.work
        await resume(**kw)
        tokens = sum(w.n for w in work)
        log.append(
            {
                "t": began,
                "dt": time.perf_counter() - began,
                "seqs": len(work),
                "tokens": tokens,
                "decode": 0,
                "prefill": tokens,
                "drafts": 0,
                "latency_rows": 0,
                "threads": _threads(engine),
                "step_threads": _step_threads(engine),
                "paused": engine._paused is not None,  # paused again
                "resumed": True,
            }
        )

    engine._resume = timed_resume


def _install(app, engine, native) -> None:
    from fastapi import Query

    steps: deque = deque(maxlen=500_000)
    base = [0]  # index of steps[0] in the whole log
    _record_steps(engine, steps)

    @app.get("/bench/engine", include_in_schema=False)
    async def engine_counters() -> dict:
        out = dataclasses.asdict(engine.stats_now())
        out["threads"] = _threads(engine)
        config = getattr(engine, "config", None)
        out["max_batched_tokens"] = getattr(config, "max_batched_tokens", None)
        out["max_num_seqs"] = getattr(config, "max_num_seqs", None)
        return out

    @app.get("/bench/steps", include_in_schema=False)
    async def step_log(after: int = Query(0, ge=0)) -> dict:
        total = base[0] + len(steps)
        start = max(after, base[0])
        rows = list(steps)[start - base[0] :]
        return {"next": total, "steps": rows}

    @app.post("/bench/forget", include_in_schema=False)
    async def forget() -> dict:
        """Drop what earlier runs left cached: the manager's idle shared prefixes (their
        engine contexts freed) and the engine's token-level cache of free blocks, so that
        a run of texts already run computes them again (the mixed-tenant workload runs
        its chain idle on the texts it ran under the batch: `modes.run_mixed`)."""
        m = getattr(native, "manager", None) if native is not None else None
        sharing = getattr(m, "sharing", None)
        if sharing is not None:
            await sharing.close()  # frees idle prefixes only; a held one stays
        pool = engine.pool
        cached = [b for b in pool.free if pool.block_hash[b] is not None]
        for b in cached:
            pool._forget(b)
        return {"blocks": len(cached), "prefixes": len(sharing.table) if sharing else None}

    @app.get("/bench/manager", include_in_schema=False)
    async def manager_counters() -> dict:
        if native is None:
            return {}
        m = getattr(native, "manager", None)
        try:
            delays = list(getattr(m, "dispatch_delays", ()))
            counts = m.counts() if hasattr(m, "counts") else {}
            capacity = m.config.policy.latency_capacity
        except AttributeError:
            return {}
        return {
            "counts": counts,
            "dispatch_delays": len(delays),
            "dispatch_delay_p50": statistics.median(delays) if delays else None,
            "dispatch_delay_max": max(delays) if delays else None,
            "latency_capacity": capacity,
        }


def _threads(engine) -> int | None:
    threads = getattr(engine, "threads", None)
    return getattr(threads, "current", None)


def _step_threads(engine) -> int | None:
    """The thread count the compute thread last applied (read after the step: its own)."""
    applied = getattr(getattr(engine, "threads", None), "_applied", None)
    return applied.get("threads") if isinstance(applied, dict) else None


def _set_latency_capacity(capacity: int) -> None:
    """Make every `ManagerConfig` the server builds carry this latency capacity (the
    manager's modules are being reorganised: patch the class wherever it is found)."""
    import importlib

    from parrot_backend.manager import policy

    patched = False
    for name in ("executor", "manager", "config", "runtime"):
        try:
            module = importlib.import_module(f"parrot_backend.manager.{name}")
        except ImportError:
            continue
        config_class = getattr(module, "ManagerConfig", None)
        if config_class is None or getattr(config_class, "_appbench", False):
            continue

        def manager_config(*a, _cls=config_class, **kw):
            kw.setdefault("policy", policy.PolicyConfig(latency_capacity=capacity))
            return _cls(*a, **kw)

        manager_config._appbench = True
        module.ManagerConfig = manager_config
        patched = True
    if not patched:
        print("appbench: ManagerConfig not found; --latency-capacity ignored", file=sys.stderr)


def main(argv: list[str]) -> int:
    argv, capacity = _take(argv, "--latency-capacity")
    if capacity is not None:
        _set_latency_capacity(int(capacity))
    import parrot_backend.server as server

    create_app = server.create_app

    def create_app_with_bench(engine, **kw):
        app = create_app(engine, **kw)
        _install(app, engine, kw.get("native"))
        return app

    server.create_app = create_app_with_bench
    from parrot_backend.cli import main as cli_main

    return cli_main(["serve", *argv])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
