"""Sessions and variable handles: programs built lazily, submitted on the first `get`.

Calling a semantic function adds a call to the current session and returns handles to its
outputs; nothing runs. The first `get` submits every call built so far as one open run;
later calls and inputs are added to the same run, so calls that depend on each other
always run server-side with no client round trip.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import threading
from typing import Any

from parrot_backend.program import CallSpec, Criterion, GenerationConfig, ProgramSpec, RunSpec

from .backend import Backend, run_async, run_sync


class SemanticVariable:
    """A handle to a semantic variable of a session's run.

    Pass it to another semantic function to connect calls; `get()` / `await aget()` submit
    what the session built and wait for the value. An input variable (`Session.variable`)
    gets its value with `set()` / `await aset()`.
    """

    __slots__ = ("name", "session", "is_input")

    def __init__(self, name: str, session: Session, is_input: bool = False) -> None:
        self.name = name
        self.session = session
        self.is_input = is_input

    def get(self, perf: Criterion = "latency") -> str:
        """The value (blocking). `perf`: does the caller need it fast, or only in bulk?"""
        return run_sync(self.session.backend, self.session.fetch(self.name, perf))

    async def aget(self, perf: Criterion = "latency") -> str:
        """The value, awaited."""
        return await run_async(self.session.backend, self.session.fetch(self.name, perf))

    def set(self, value: str) -> None:
        """Give an input variable its value (blocking)."""
        run_sync(self.session.backend, self.session.assign(self, value))

    async def aset(self, value: str) -> None:
        """Give an input variable its value."""
        await run_async(self.session.backend, self.session.assign(self, value))

    def __repr__(self) -> str:
        return f"SemanticVariable({self.name!r})"


class Session:
    """One run being built: calls and input values not yet sent, and the run id once sent.

    Use `with Session(backend):` to make it current; semantic functions called inside add
    their calls to it. A session's coroutines run on its backend's loop.
    """

    def __init__(self, backend: Backend | None = None, *, public: bool = False) -> None:
        self._backend = backend
        self.public = public
        self.run_id: str | None = None
        self._calls: list[CallSpec] = []
        self._inputs: dict[str, str] = {}
        self._names = itertools.count()
        self._guard = threading.Lock()  # building may happen on any thread
        self._submit: asyncio.Lock | None = None
        self._token: contextvars.Token[Session | None] | None = None

    @property
    def backend(self) -> Backend:
        """The backend this session submits to (the default one if none was given)."""
        backend = self._backend or _default_backend
        if backend is None:
            raise RuntimeError(
                "no backend: pass Session(backend) or call parrot_backend.client.set_backend()"
            )
        return backend

    def __enter__(self) -> Session:
        self._token = _current.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            _current.reset(self._token)
            self._token = None

    # ---- building (no I/O) ----
    def fresh_name(self, stem: str) -> str:
        """A call name unique in this session."""
        return f"{stem}-{next(self._names)}"

    def add_call(
        self, name: str, template: str, outputs: dict[str, GenerationConfig], constants: dict
    ) -> None:
        """Queue a call (and the constant inputs it introduces) for the next submission."""
        spec = CallSpec(name=name, template=template, outputs=outputs)
        with self._guard:
            self._calls.append(spec)
            self._inputs.update(constants)

    def variable(self, name: str | None = None) -> SemanticVariable:
        """A new input variable, to be given a value with `set()` (now or later)."""
        return SemanticVariable(name or self.fresh_name("input"), self, is_input=True)

    # ---- submission (on the backend's loop) ----
    async def flush(self, waits: dict[str, Criterion] | None = None) -> None:
        """Send what was built since the last submission. `waits`: variables the caller is
        about to wait for, and how (declared with the calls, so that they start with the
        objective the wait gives them rather than until the wait reaches the server)."""
        if self._submit is None:
            self._submit = asyncio.Lock()
        async with self._submit:
            with self._guard:
                calls, self._calls = self._calls, []
                inputs, self._inputs = self._inputs, {}
            try:
                if self.run_id is None:
                    if not calls:
                        self._inputs.update(inputs)  # no program yet: keep them
                        return
                    program = ProgramSpec(calls=calls, public=self.public)
                    spec = RunSpec(program=program, inputs=inputs, outputs=waits or {}, open=True)
                    self.run_id = await self.backend.create_run(spec)
                    return
                if calls:
                    await self.backend.add_calls(self.run_id, calls, waits)
                for name, value in inputs.items():
                    await self.backend.set_input(self.run_id, name, value)
            except BaseException:
                with self._guard:  # not sent: keep it for the next try
                    self._calls[:0] = calls
                    self._inputs.update(inputs)
                raise

    async def fetch(self, name: str, perf: Criterion) -> str:
        """Submit what is pending, then wait for variable `name`."""
        await self.flush({name: perf})
        if self.run_id is None:
            raise RuntimeError(f"variable {name!r} belongs to no call: nothing was submitted")
        return await self.backend.get(self.run_id, name, perf)

    async def assign(self, var: SemanticVariable, value: str) -> None:
        """Give input `var` its value (sent with the next submission, or now)."""
        if not var.is_input:
            raise ValueError(f"{var.name!r} is generated by a call; only inputs can be set")
        if not isinstance(value, str):
            raise TypeError(f"values are strings, got {type(value).__name__}")
        with self._guard:
            self._inputs[var.name] = value
        if self.run_id is not None:
            await self.flush()

    async def close(self) -> None:
        """Submit what is pending and close the run (it finishes when its calls do)."""
        await self.flush()
        if self.run_id is not None:
            await self.backend.close_run(self.run_id)


_default_backend: Backend | None = None
_default_session: Session | None = None
_current: contextvars.ContextVar[Session | None] = contextvars.ContextVar(
    "parrot_session", default=None
)


def set_backend(backend: Backend | None) -> None:
    """Make `backend` the default, and start a fresh default session on it."""
    global _default_backend, _default_session
    _default_backend = backend
    _default_session = None


def current_session() -> Session:
    """The session of the innermost `with Session(...)`, else the default session."""
    global _default_session
    session = _current.get()
    if session is not None:
        return session
    if _default_session is None:
        _default_session = Session()
    return _default_session


def as_value(arg: Any) -> str | SemanticVariable:
    """An argument of a semantic function: a handle, or a string constant."""
    if isinstance(arg, (str, SemanticVariable)):
        return arg
    raise TypeError(
        f"semantic function arguments are str or SemanticVariable, got {type(arg).__name__}"
    )
