"""`appbench/serve.py` with timing wrappers around the server's, manager's, store's and
engine's steps on the way of a run: one JSON line per call appended to $TRACE_FILE
(name, start and end on `time.perf_counter()`, the clock of the step log and the client).

    TRACE_FILE=trace.jsonl python traced_serve.py [--trace-submits] [serve options...]

What it wraps: the native runtime's `create_run` / `read_variable` / `tenant_id`, every
emitted manager event (`emit`, with its type) and its store write (`persist._write`),
the grouped value writes, the dispatcher's rendering, each `run_call`, the engine's
`fill` and `tokenize`, `Manager.get`, and every HTTP request (an ASGI middleware added
to each FastAPI app). The wrappers cost microseconds; the middleware adds to every
request, in both modes.
"""

import functools
import json
import os
import runpy
import sys
import time
from pathlib import Path

OUT = open(os.environ["TRACE_FILE"], "a", buffering=1)  # noqa: SIM115 (open for the run)


def record(name: str, t0: float, **extra) -> None:
    OUT.write(json.dumps({"n": name, "t0": t0, "t1": time.perf_counter(), **extra}) + "\n")


def wrap(owner, attr: str, label: str, tag=None) -> None:
    orig = getattr(owner, attr)

    @functools.wraps(orig)
    async def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return await orig(*a, **k)
        finally:
            record(label, t0, **(tag(*a, **k) if tag else {}))

    setattr(owner, attr, timed)


def wrap_sync(owner, attr: str, label: str) -> None:
    orig = getattr(owner, attr)

    @functools.wraps(orig)
    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            record(label, t0)

    setattr(owner, attr, timed)


def install() -> None:
    import fastapi

    from parrot_backend.engine import engine
    from parrot_backend.manager import call_task, dispatcher, manager, transitions
    from parrot_backend.server import runtime
    from parrot_backend.server.persist import persister

    rt = runtime.NativeRuntime
    wrap(rt, "create_run", "rt.create_run")
    wrap(rt, "read_variable", "rt.read_variable")
    wrap(rt, "tenant_id", "rt.tenant_id")

    def event_type(self, run, type, payload):
        return {"type": type}

    def write_type(self, run_id, meta, type, *a, **k):
        return {"type": type}

    wrap(transitions.RunTransitions, "emit", "emit", event_type)
    wrap(transitions.RunTransitions, "_deliver_values", "deliver_values")
    wrap(persister.StorePersister, "_write", "persist._write", write_type)
    wrap(dispatcher.Dispatcher, "_render", "dispatch.render")
    wrap(engine.Engine, "fill", "engine.fill")
    wrap_sync(engine.Engine, "tokenize", "engine.tokenize")
    wrap(manager.Manager, "get", "manager.get")
    wrap(call_task, "run_call", "run_call")
    dispatcher.run_call = call_task.run_call  # (imported by name there)

    init = fastapi.FastAPI.__init__

    def init_with_timing(self, *a, **k):
        init(self, *a, **k)

        @self.middleware("http")
        async def timing(request, call_next):
            t0 = time.perf_counter()
            response = await call_next(request)
            record("http", t0, path=request.url.path, method=request.method)
            return response

    fastapi.FastAPI.__init__ = init_with_timing


def trace_submits() -> None:
    """Also one line per request the engine's loop takes in (`submit`, with its kind)."""
    from parrot_backend.engine import step_loop

    submit = step_loop.StepLoop._submit

    def traced(self, req):
        record("submit", time.perf_counter(), kind=req.kind)
        return submit(self, req)

    step_loop.StepLoop._submit = traced


if __name__ == "__main__":
    install()
    if "--trace-submits" in sys.argv:
        sys.argv.remove("--trace-submits")
        trace_submits()
    serve = Path(__file__).resolve().parents[4] / "appbench" / "serve.py"
    sys.argv = [str(serve), *sys.argv[1:]]
    runpy.run_path(str(serve), run_name="__main__")
