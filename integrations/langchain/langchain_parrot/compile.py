"""`compile_chain`: run a whole LCEL chain as one Parrot program on the server.

```python
from langchain_parrot import ChatParrot, compile_chain

chain = prompt | ChatParrot(temperature=0) | StrOutputParser()
fast = compile_chain(chain)          # the same input and output as `chain`
fast.invoke({"topic": "parrots"})    # one request: every LLM step runs server-side
```

Each LLM step of the chain becomes a call of one run; the text between semantic
variables stays literal in its template, so the server sees shared prefixes, deduces
objectives over the whole chain and runs dependent calls without a round trip. Steps it
cannot lower (arbitrary Python, other output parsers, branches, retrievers, tools) run on
the client at their place, with the values they need; the run continues after them
(`langchain_parrot/_lower.py`). `batch` runs all inputs in one run. `plan()` says what
runs where.

Outputs equal the plain chain's: prompts are rendered as the chain renders them and
tokenized as one text by the server, exactly as the request-level path does (greedy
decoding gives the same tokens). Unset sampling settings take the values the server's
OpenAI-compatible routes default to.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from langchain_core.callbacks import AsyncCallbackManager, CallbackManager
from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_core.outputs import ChatGeneration, Generation, LLMResult
from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.runnables.base import coerce_to_runnable
from langchain_core.runnables.config import patch_config

from ._lower import (
    AIMsg,
    ClientStep,
    Lowering,
    ModelStep,
    Text,
    Var,
    concrete,
    gather_all,
    model_of,
    variables,
)
from ._native import RunSession
from .chat_models import ChatParrot
from .errors import ParrotError

_CONFIG_KEYS = frozenset(
    {
        "stop",
        "max_tokens",
        "temperature",
        "top_p",
        "seed",
        "top_k",
        "frequency_penalty",
        "presence_penalty",
    }
)
_CONTEXT: dict[str, int | None] = {}  # base URL -> the served model's context length


class Scheduler:
    """Walkers of one run, and when to send what they gathered: once every walker is
    waiting for server values (or done), the calls and inputs gathered so far go in one
    request, closing the run when nothing can add calls after it."""

    def __init__(self, session: RunSession) -> None:
        self.session = session
        self.active = 0  # walkers that may still gather calls
        self.waiting: list[bool] = []  # per waiting walker: may it add calls later?
        self.wanted: set[str] = set()  # variables waiting walkers need
        self._lock = asyncio.Lock()

    async def walker(self, coro: Any) -> Any:
        """Run a walker counted in `active` (the caller counted it already)."""
        try:
            return await coro
        finally:
            self.active -= 1
            await self._maybe_flush()

    async def gather(self, coros: list[Any]) -> list[Any]:
        """Child walkers (parallel branches, map items); the caller waits for them and so
        gathers nothing meanwhile."""
        self.active += len(coros) - 1  # children counted before the parent steps aside
        try:
            return await gather_all([self.walker(c) for c in coros])
        finally:
            self.active += 1

    async def resolve(self, names: set[str], *, more_calls_later: bool) -> None:
        """Wait for these variables' values (sending what was gathered when no walker can
        gather more)."""
        self.waiting.append(more_calls_later)
        self.wanted |= names
        try:
            await self._maybe_flush()
            await asyncio.gather(*(self.session.value(n) for n in names))
        finally:
            self.waiting.remove(more_calls_later)

    async def _maybe_flush(self) -> None:
        async with self._lock:
            s = self.session
            if self.active > 0 and len(self.waiting) == self.active and s.dirty:
                for name in self.wanted:  # a client waits for these: latency
                    s.outputs.setdefault(name, "latency")
                await s.flush(close=not any(self.waiting))


class Tracer:
    """LLM-step callbacks built from the run's events (`on_llm_start`/`new_token`/`end`,
    or `on_chat_model_start` for chat models), children of the compiled chain's run."""

    def __init__(
        self,
        manager: CallbackManager | AsyncCallbackManager | None,
        lowering: Lowering,
        session: RunSession,
    ) -> None:
        self.manager = manager
        self.lowering = lowering
        self.session = session
        self.runs: dict[str, Any] = {}
        self.texts: dict[str, list[str]] = {}
        self.listeners: list[asyncio.Queue] = []

    async def _call(self, method: Any, *args: Any, **kw: Any) -> Any:
        out = method(*args, **kw)
        if asyncio.iscoroutine(out):
            out = await out
        return out

    async def on_event(self, kind: str, payload: dict[str, Any]) -> None:
        call = payload.get("call")
        for q in self.listeners:
            q.put_nowait((kind, payload))
        if kind == "token":
            self.texts.setdefault(call, []).append(payload.get("text", ""))
        low = self.lowering
        if call not in low.models or self.manager is None:
            if kind == "call_finished" and call in low.models:
                self._meta(call, payload)
            return
        model = low.models[call]
        if kind == "call_started" and call not in self.runs:
            prompt = concrete(low.prompts[call], self.session.values, low.meta)
            serialized = model.model.to_json() if hasattr(model.model, "to_json") else {}
            if isinstance(model.model, ChatParrot):
                runs = await self._call(
                    self.manager.on_chat_model_start,
                    serialized,
                    [prompt.to_messages()],
                    name=model.model.get_name(),
                )
            else:
                runs = await self._call(
                    self.manager.on_llm_start,
                    serialized,
                    [prompt.to_string()],
                    name=model.model.get_name(),
                )
            self.runs[call] = runs[0]
        elif kind == "token" and call in self.runs:
            await self._call(self.runs[call].on_llm_new_token, payload.get("text", ""))
        elif kind == "call_finished":
            meta = self._meta(call, payload)
            run = self.runs.pop(call, None)
            if run is not None:
                text = "".join(self.texts.get(call, []))
                gen: Generation = (
                    ChatGeneration(message=AIMessage(content=text, **meta))
                    if isinstance(model.model, ChatParrot)
                    else Generation(text=text)
                )
                await self._call(run.on_llm_end, LLMResult(generations=[[gen]]))
        elif kind == "call_failed":
            run = self.runs.pop(call, None)
            if run is not None:
                await self._call(run.on_llm_error, ParrotError(str(payload.get("error"))))

    def _meta(self, call: str, payload: dict[str, Any]) -> dict[str, Any]:
        model = self.lowering.models[call].model
        reasons = payload.get("finish_reasons") or {}
        meta: dict[str, Any] = {
            "response_metadata": {
                "model_name": model.model,
                "finish_reason": next(iter(reasons.values()), None),
            }
        }
        prompt, completion = payload.get("prompt_tokens"), payload.get("completion_tokens")
        if isinstance(prompt, int) and isinstance(completion, int):
            meta["usage_metadata"] = {
                "input_tokens": prompt,
                "output_tokens": completion,
                "total_tokens": prompt + completion,
            }
        self.lowering.meta[call] = meta
        return meta


@dataclass
class _Run:
    """One invoke/batch: its session, lowering and the final symbolic outputs."""

    session: RunSession
    lowering: Lowering
    scheduler: Scheduler
    tracer: Tracer
    outputs: list[Any] = field(default_factory=list)


class CompiledChain(Runnable[Any, Any]):
    """A chain whose LLM steps run as one server-side Parrot program (`compile_chain`)."""

    def __init__(self, chain: Runnable, *, objective: str = "latency") -> None:
        if objective not in ("latency", "throughput"):
            raise ValueError(f"objective must be 'latency' or 'throughput', got {objective!r}")
        self.chain = coerce_to_runnable(chain)  # a dict literal is a RunnableParallel
        self.objective = objective
        self.models = _models(self.chain)
        if not self.models:
            raise ValueError("the chain has no ChatParrot or ParrotLLM step to compile")
        endpoints = {m.model._endpoint.url("") for m in self.models}
        if len(endpoints) != 1:
            raise ValueError(
                f"the chain's Parrot models use several servers {endpoints}: "
                "a compiled chain runs on one"
            )
        self.endpoint = self.models[0].model._endpoint
        self.last_requests = 0  # HTTP requests of the last invoke/batch (tests, plan())

    @property
    def InputType(self) -> Any:  # noqa: N802  (LangChain's name)
        return self.chain.InputType

    @property
    def OutputType(self) -> Any:  # noqa: N802
        return self.chain.OutputType

    def get_name(self, suffix: str | None = None, *, name: str | None = None) -> str:
        return name or f"Compiled{self.chain.get_name()}" + (suffix or "")

    # ------------------------------------------------------------------ plan
    def plan(self) -> dict[str, Any]:
        """Which steps run on the server and which on the client, and how many times an
        invoke waits for the server before it can go on (round trips at most)."""
        steps: list[dict[str, Any]] = []
        trips = _plan(self.chain, False, steps)[1]
        # a round trip costs a request when server work follows it (else the request
        # before it closed the run)
        follow = sum(
            1
            for i, st in enumerate(steps)
            if st.get("round_trip") and any(x["where"] == "server" for x in steps[i + 1 :])
        )
        return {"steps": steps, "round_trips": trips, "requests": 1 + follow}

    # ------------------------------------------------------------------ running
    def invoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        return self._call_with_config(
            lambda x, run_manager, config: _run_sync(self._arun([x], config, run_manager))[0],
            input,
            config,
            run_type="chain",
        )

    async def ainvoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        async def go(x: Any, run_manager: Any, config: RunnableConfig) -> Any:
            return (await self._arun([x], config, run_manager))[0]

        return await self._acall_with_config(go, input, config, run_type="chain")

    def batch(
        self,
        inputs: list[Any],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[Any]:
        if not inputs:
            return []
        return _run_sync(self.abatch(inputs, config, return_exceptions=return_exceptions))

    async def abatch(
        self,
        inputs: list[Any],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[Any]:
        """Every input in one run: shared prefixes filled once, one request."""
        if not inputs:
            return []
        one = config[0] if isinstance(config, list) else config
        try:
            return await self._acall_with_config(
                lambda xs, run_manager, config: self._arun(xs, config, run_manager),
                list(inputs),
                one,
                run_type="chain",
            )
        except Exception as exc:
            if return_exceptions:
                return [exc] * len(inputs)
            raise

    def stream(
        self, input: Any, config: RunnableConfig | None = None, **kwargs: Any
    ) -> Iterator[Any]:
        yield from _iterate_sync(self.astream(input, config))

    async def astream(
        self, input: Any, config: RunnableConfig | None = None, **kwargs: Any
    ) -> AsyncIterator[Any]:
        """The final output's tokens as they are generated (the chain's last LLM step,
        through StrOutputParser or not); another final step yields its value once."""
        queue: asyncio.Queue = asyncio.Queue()
        done = asyncio.Event()
        holder: dict[str, Any] = {}

        async def go() -> None:
            try:
                holder["out"] = await self._acall_with_config(
                    lambda x, run_manager, config: self._arun(
                        [x], config, run_manager, events=queue
                    ),
                    input,
                    config,
                    run_type="chain",
                )
            except BaseException as exc:  # re-raised to the consumer
                holder["error"] = exc
            finally:
                done.set()
                queue.put_nowait(None)

        task = asyncio.create_task(go())
        final: dict[str, Any] = {}
        streamed = False
        try:
            while True:
                item = await queue.get()
                if item is None:
                    break
                if item[0] == "final":
                    final.update(item[1])
                    continue
                kind, payload = item
                call = final.get("call")
                if kind == "token" and call is not None and payload.get("call") == call:
                    streamed = True
                    text = payload.get("text", "")
                    yield AIMessageChunk(content=text) if final["chat"] else text
            await task
            if "error" in holder:
                raise holder["error"]
            if not streamed:
                yield holder["out"][0]
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    async def _arun(
        self,
        inputs: list[Any],
        config: RunnableConfig,
        run_manager: Any,
        events: asyncio.Queue | None = None,
    ) -> list[Any]:
        async with httpx.AsyncClient() as client:
            run = self._start(client, run_manager)
            if events is not None:
                run.tracer.listeners.append(events)
            child = patch_config(config, callbacks=run_manager.get_child())
            try:
                outputs = await self._walk(run, inputs, child)
                if events is not None:
                    events.put_nowait(("final", _final_call(outputs[0])))
                values = await self._values(run, outputs)
                return [concrete(o, values, run.lowering.meta) for o in outputs]
            except BaseException:
                await run.session.abort()
                raise
            finally:
                self.last_requests = run.session.requests

    def _start(self, client: httpx.AsyncClient, run_manager: Any) -> _Run:
        session = RunSession(client, self.endpoint)
        scheduler = Scheduler(session)
        lowering = Lowering(scheduler, self._config_of)
        manager = run_manager.get_child() if run_manager is not None else None
        tracer = Tracer(manager, lowering, session)
        session.on_event = tracer.on_event
        return _Run(session, lowering, scheduler, tracer)

    async def _walk(self, run: _Run, inputs: list[Any], config: RunnableConfig) -> list[Any]:
        await self._context()
        low, sched = run.lowering, run.scheduler
        sched.active = len(inputs)
        walkers = [sched.walker(low.walk(self.chain, low.symbolize(x), (), config)) for x in inputs]
        return await gather_all(walkers)

    async def _values(self, run: _Run, outputs: list[Any]) -> dict[str, str]:
        s = run.session
        needed = set().union(*(variables(o) for o in outputs))
        if s.run_id is None and not s.calls:
            return dict(s.values)  # nothing ran on the server
        for name in needed:
            if name not in s.inputs:
                s.outputs.setdefault(name, self.objective)
        await s.flush(close=True)
        for name in needed:
            await s.value(name)
        await s.finish()
        return dict(s.values)

    # ------------------------------------------------------------------ configs
    async def _context(self) -> None:
        """The served model's context length, needed once per server when a chat step
        leaves max_tokens unset (the chat route then generates up to the context)."""
        key = self.endpoint.url("")
        if key in _CONTEXT or not any(
            m.model.max_tokens is None and "max_tokens" not in m.kwargs for m in self.models
        ):
            return
        async with httpx.AsyncClient() as client:
            r = await client.get(
                self.endpoint.url("/v1/models"),
                headers=self.endpoint.headers(False),
                timeout=self.endpoint.timeout,
            )
        data = r.json().get("data") if r.status_code == 200 else None
        _CONTEXT[key] = data[0].get("max_model_len") if data else None

    def _config_of(self, step: ModelStep) -> dict[str, Any]:
        """The generation config of a model step's output: what its request-level call
        would send, with the server's defaults for what it leaves unset."""
        if any(k not in _CONFIG_KEYS for k in step.kwargs):
            raise ClientStep  # settings only the request-level route knows
        model = step.model
        kw = step.kwargs
        temperature = kw.get("temperature", model.temperature)
        top_p = kw.get("top_p", model.top_p)
        config: dict[str, Any] = {
            "temperature": 1.0 if temperature is None else float(temperature),
            "top_p": 1.0 if top_p is None else float(top_p),
        }
        max_tokens = kw.get("max_tokens", model.max_tokens)
        if max_tokens is None:
            max_tokens = _CONTEXT.get(self.endpoint.url("")) or 256
        config["max_tokens"] = int(max_tokens)
        seed = kw.get("seed", model.seed)
        if seed is not None:
            config["seed"] = int(seed)
        stop = kw.get("stop", model.stop)
        if stop:
            config["stop"] = [stop] if isinstance(stop, str) else list(stop)
        if kw.get("top_k"):
            config["top_k"] = int(kw["top_k"])
        for name in ("frequency_penalty", "presence_penalty"):
            value = kw.get(name, getattr(model, name, None))
            if value:
                config[name] = float(value)
        return config


def compile_chain(runnable: Runnable, *, objective: str = "latency") -> CompiledChain:
    """The chain as one Parrot program per invoke (see the module doc). `objective`: what
    the final output is run for, `latency` (the default) or `throughput`."""
    return CompiledChain(runnable, objective=objective)


# ------------------------------------------------------------------------- helpers
def _final_call(output: Any) -> dict[str, Any]:
    """Which call's tokens make up the final output, for streaming."""
    if isinstance(output, AIMsg):
        return {"call": output.call, "chat": True}
    if isinstance(output, Var) and output.name.startswith("o"):
        return {"call": f"c{output.name[1:]}", "chat": False}
    if (
        isinstance(output, Text)
        and len(output.pieces) == 1
        and isinstance(output.pieces[0], Var)
        and output.pieces[0].name.startswith("o")
    ):
        return {"call": f"c{output.pieces[0].name[1:]}", "chat": False}
    return {}


def _models(step: Any) -> list[ModelStep]:
    """The Parrot models of a chain."""
    from langchain_core.runnables import RunnableBinding, RunnableParallel, RunnableSequence
    from langchain_core.runnables.base import RunnableEach
    from langchain_core.runnables.passthrough import RunnableAssign

    found = model_of(step)
    if found is not None:
        return [found]
    if isinstance(step, RunnableSequence):
        return [m for s in step.steps for m in _models(s)]
    if isinstance(step, RunnableParallel):
        return [m for s in step.steps__.values() for m in _models(s)]
    if isinstance(step, RunnableAssign):
        return _models(step.mapper)
    if isinstance(step, (RunnableEach, RunnableBinding)):
        return _models(step.bound)
    return []


def _plan(step: Any, server_data: bool, out: list[dict[str, Any]]) -> tuple[bool, int]:
    """Static walk: (does the value after `step` hold server-generated data, round trips)."""
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate, PromptTemplate
    from langchain_core.runnables import (
        RunnableBinding,
        RunnableParallel,
        RunnablePassthrough,
        RunnablePick,
        RunnableSequence,
    )
    from langchain_core.runnables.base import RunnableEach
    from langchain_core.runnables.passthrough import RunnableAssign

    if model_of(step) is not None:
        out.append({"step": step.get_name(), "where": "server"})
        return True, 0
    if isinstance(step, RunnableSequence):
        trips = 0
        for s in step.steps:
            server_data, t = _plan(s, server_data, out)
            trips += t
        return server_data, trips
    if isinstance(step, (RunnableParallel, RunnableAssign)):
        branches = (
            step.steps__ if isinstance(step, RunnableParallel) else step.mapper.steps__
        ).values()
        results = [_plan(s, server_data, out) for s in branches]
        data = any(d for d, _ in results) or (isinstance(step, RunnableAssign) and server_data)
        return data, max((t for _, t in results), default=0)
    if isinstance(step, RunnableEach):
        return _plan(step.bound, server_data, out)
    if isinstance(step, RunnableBinding) and not step.kwargs:
        return _plan(step.bound, server_data, out)
    if isinstance(
        step,
        (RunnablePassthrough, RunnablePick, PromptTemplate, ChatPromptTemplate, StrOutputParser),
    ) or _is_pick(step):
        return server_data, 0
    out.append({"step": step.get_name(), "where": "client", "round_trip": server_data})
    return False, 1 if server_data else 0


def _is_pick(step: Any) -> bool:
    import operator

    from langchain_core.runnables import RunnableLambda

    return isinstance(step, RunnableLambda) and isinstance(step.func, operator.itemgetter)


def _run_sync(coro: Any) -> Any:
    """Run a coroutine to its end from sync code (in a thread when a loop runs here)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = asyncio.run(coro)
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def _iterate_sync(agen: AsyncIterator[Any]) -> Iterator[Any]:
    """Iterate an async iterator from sync code, item by item, on a loop in a thread."""
    import queue as _queue

    items: _queue.Queue = _queue.Queue()
    end = object()

    async def pump() -> None:
        try:
            async for item in agen:
                items.put((True, item))
        except BaseException as exc:
            items.put((False, exc))
        finally:
            items.put((True, end))

    thread = threading.Thread(target=lambda: asyncio.run(pump()), daemon=True)
    thread.start()
    while True:
        ok, item = items.get()
        if item is end:
            break
        if not ok:
            raise item
        yield item
    thread.join()
