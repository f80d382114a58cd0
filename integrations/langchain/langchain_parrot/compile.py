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
from langchain_core.runnables import Runnable, RunnableBinding, RunnableConfig
from langchain_core.runnables.base import coerce_to_runnable
from langchain_core.runnables.config import patch_config

from ._base import wire_bias
from ._http import _transport_error, error_from_response
from ._lower import (
    OWNER,
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
from .errors import ParrotBadRequestError, ParrotError

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
        "logit_bias",
    }
)


def _asks_logprobs(model: Any) -> bool:
    """The model is set to return log probabilities, which only its own request returns
    (a server program's outputs are text)."""
    asked = getattr(model, "logprobs", None)
    return asked is not None and asked is not False


# base URL -> served model id -> its context length (None: the server lists no models)
_SERVED: dict[str, dict[str, int | None] | None] = {}


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
        managers: list[CallbackManager | AsyncCallbackManager],
        lowering: Lowering,
        session: RunSession,
    ) -> None:
        self.managers = managers  # per input of the run: its chain run's children
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
        if call not in low.models or not self.managers:
            if kind == "call_finished" and call in low.models:
                self._meta(call, payload)
            return
        model = low.models[call]
        manager = self.managers[low.owners.get(call, 0)]  # the input the call serves
        if kind == "call_started" and call not in self.runs:
            prompt = concrete(low.prompts[call], self.session.values, low.meta)
            serialized = model.model.to_json() if hasattr(model.model, "to_json") else {}
            if isinstance(model.model, ChatParrot):
                runs = await self._call(
                    manager.on_chat_model_start,
                    serialized,
                    [prompt.to_messages()],
                    name=model.model.get_name(),
                )
            else:
                runs = await self._call(
                    manager.on_llm_start,
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
                response = meta["response_metadata"]
                info = {"finish_reason": response["finish_reason"]}
                gen: Generation = (
                    ChatGeneration(message=AIMessage(content=text, **meta), generation_info=info)
                    if isinstance(model.model, ChatParrot)
                    else Generation(text=text, generation_info=info)
                )
                # as ChatParrot's and ParrotLLM's own results: usage in llm_output too
                llm_output = {"model_name": response["model_name"]}
                if "token_usage" in response:
                    llm_output["token_usage"] = response["token_usage"]
                result = LLMResult(generations=[[gen]], llm_output=llm_output)
                await self._call(run.on_llm_end, result)
        elif kind == "call_failed":
            run = self.runs.pop(call, None)
            if run is not None:
                await self._call(run.on_llm_error, ParrotError(str(payload.get("error"))))

    def _meta(self, call: str, payload: dict[str, Any]) -> dict[str, Any]:
        model = self.lowering.models[call].model
        reasons = payload.get("finish_reasons") or {}
        # the fields ChatParrot's own answer has (its id aside: no request made it)
        response: dict[str, Any] = {"model_name": model.model}
        meta: dict[str, Any] = {"response_metadata": response}
        prompt, completion = payload.get("prompt_tokens"), payload.get("completion_tokens")
        if isinstance(prompt, int) and isinstance(completion, int):
            response["token_usage"] = {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            }
            meta["usage_metadata"] = {
                "input_tokens": prompt,
                "output_tokens": completion,
                "total_tokens": prompt + completion,
            }
        response["finish_reason"] = next(iter(reasons.values()), None)
        response["model_provider"] = "parrot"
        self.lowering.meta[call] = meta
        return meta


@dataclass(frozen=True, slots=True)
class _Failed:
    """The output of a batch input that failed (`return_exceptions=True`)."""

    error: Exception


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
        found = _models(self.chain)
        if not found:
            raise ValueError("the chain has no ChatParrot or ParrotLLM step to compile")
        # models that only ever run on the client (under fallbacks, retries, branches)
        # make requests of their own: the run goes to the server of the others
        self.models = [m for m, server in found if server] or [m for m, _ in found]
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
        server = any(st["where"] == "server" for st in steps)  # else it all runs here
        return {"steps": steps, "round_trips": trips, "requests": 1 + follow if server else 0}

    # ------------------------------------------------------------------ running
    def invoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        return self._call_with_config(
            lambda x, run_manager, config: _run_sync(self._arun([x], [config], [run_manager]))[0],
            input,
            config,
            run_type="chain",
        )

    async def ainvoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        async def go(x: Any, run_manager: Any, config: RunnableConfig) -> Any:
            return (await self._arun([x], [config], [run_manager]))[0]

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
        # a chain run per input (its own config: callbacks, tags, configurable), as the
        # plain chain's batch has; the inputs still share one server run
        return await self._abatch_with_config(
            lambda xs, run_manager, config: self._abatch_run(
                xs, config, run_manager, return_exceptions
            ),
            list(inputs),
            config,
            return_exceptions=return_exceptions,
            run_type="chain",
        )

    async def _abatch_run(
        self,
        inputs: list[Any],
        configs: list[RunnableConfig],
        run_managers: list[Any],
        return_exceptions: bool,
    ) -> list[Any]:
        try:
            return await self._arun(
                inputs, configs, run_managers, return_exceptions=return_exceptions
            )
        except ParrotBadRequestError:
            if not return_exceptions or len(inputs) < 2:
                raise

        # The server refused the run as a whole for one input's sake (a prompt longer than
        # the context): one run per input, so that only that input fails, as in the plain
        # chain's batch. Client steps that ran before the refusal run again.
        async def alone(x: Any, config: RunnableConfig, run_manager: Any) -> Any:
            try:
                [out] = await self._arun([x], [config], [run_manager], return_exceptions=True)
            except Exception as exc:
                return exc
            return out

        return list(
            await asyncio.gather(
                *(alone(*a) for a in zip(inputs, configs, run_managers, strict=True))
            )
        )

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
                        [x], [config], [run_manager], events=queue
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
            elif final["chat"]:
                # as ChatParrot's stream ends: finish reason, model and usage, once
                message = holder["out"][0]
                yield AIMessageChunk(
                    content="",
                    response_metadata={
                        k: v for k, v in message.response_metadata.items() if k != "token_usage"
                    },
                    usage_metadata=message.usage_metadata,
                    chunk_position="last",
                )
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    async def _arun(
        self,
        inputs: list[Any],
        configs: list[RunnableConfig],
        run_managers: list[Any],
        events: asyncio.Queue | None = None,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """The outputs of `inputs`, run together; with `return_exceptions`, an input that
        fails (on the client or on the server) gives its exception and the others go on."""
        async with httpx.AsyncClient() as client:
            run = self._start(client, run_managers)
            if events is not None:
                run.tracer.listeners.append(events)
            children = [
                patch_config(c, callbacks=m.get_child())
                for c, m in zip(configs, run_managers, strict=True)
            ]
            try:
                outputs = await self._walk(run, inputs, children, return_exceptions)
                if events is not None:
                    events.put_nowait(("final", _final_call(outputs[0])))
                values = await self._values(run, outputs, return_exceptions)
                return [
                    o.error if isinstance(o, _Failed) else concrete(o, values, run.lowering.meta)
                    for o in outputs
                ]
            except BaseException:
                await run.session.abort()
                raise
            finally:
                self.last_requests = run.session.requests

    def _start(self, client: httpx.AsyncClient, run_managers: list[Any]) -> _Run:
        session = RunSession(client, self.endpoint)
        scheduler = Scheduler(session)
        lowering = Lowering(scheduler, self._config_of)
        tracer = Tracer([m.get_child() for m in run_managers], lowering, session)
        session.on_event = tracer.on_event
        return _Run(session, lowering, scheduler, tracer)

    async def _walk(
        self,
        run: _Run,
        inputs: list[Any],
        configs: list[RunnableConfig],
        return_exceptions: bool,
    ) -> list[Any]:
        await self._server_info()
        low, sched = run.lowering, run.scheduler

        async def one(i: int, x: Any) -> Any:
            OWNER.set(i)  # this walker's task and those it starts: calls for input i
            try:
                return await low.walk(self.chain, low.symbolize(x), (), configs[i])
            except Exception as exc:
                if not return_exceptions:
                    raise
                return _Failed(exc)

        sched.active = len(inputs)
        return await gather_all([sched.walker(one(i, x)) for i, x in enumerate(inputs)])

    async def _values(
        self, run: _Run, outputs: list[Any], return_exceptions: bool
    ) -> dict[str, str]:
        """Send what is left, close the run and wait for every output's values; an output
        whose value failed becomes a `_Failed` in `outputs` (with `return_exceptions`)."""
        s = run.session
        live = [i for i, o in enumerate(outputs) if not isinstance(o, _Failed)]
        needed = set().union(*(variables(outputs[i]) for i in live))
        if s.run_id is None and not s.calls:
            return dict(s.values)  # nothing ran on the server
        for name in needed:
            if name not in s.inputs:
                s.outputs.setdefault(name, self.objective)
        await s.flush(close=True)
        for i in live:
            try:
                for name in sorted(variables(outputs[i])):
                    await s.value(name)
            except ParrotError as exc:
                if not return_exceptions:
                    raise
                outputs[i] = _Failed(exc)
        await s.finish()
        return dict(s.values)

    # ------------------------------------------------------------------ configs
    async def _server_info(self) -> None:
        """What the server serves (`GET /v1/models`), read once per server (and again for
        a model it did not list): the model ids, to refuse an unknown one as its
        request-level route does, and the context length, for a chat step that leaves
        max_tokens unset (the chat route then generates up to the context)."""
        key = self.endpoint.url("")
        if key in _SERVED:
            served = _SERVED[key]
            if served is None or all(m.model.model in served for m in self.models):
                return  # else read again: the server may have been restarted on another model
        url = self.endpoint.url("/v1/models")
        try:
            async with httpx.AsyncClient() as client:
                r = await client.get(
                    url, headers=self.endpoint.headers(False), timeout=self.endpoint.timeout
                )
        except httpx.HTTPError as exc:
            raise _transport_error(exc, self.endpoint, url) from exc
        if r.status_code in (401, 403):
            raise error_from_response(r)
        try:
            data = r.json().get("data") if r.status_code == 200 else None
        except (ValueError, AttributeError):
            data = None
        if not isinstance(data, list) or not all(isinstance(m, dict) for m in data):
            _SERVED[key] = None  # not a listing: nothing to check against
            return
        _SERVED[key] = {m.get("id"): m.get("max_model_len") for m in data}

    def _served(self, model: str) -> int | None:
        """The context length of a served model (None when unknown); refuses a model the
        server does not serve, as its chat and completions routes do (404)."""
        served = _SERVED.get(self.endpoint.url(""))
        if served is None:
            return None
        if model not in served:
            names = ", ".join(repr(m) for m in served)
            raise ParrotBadRequestError(
                f"The model {model!r} does not exist; this server serves {names}",
                status_code=404,
                type="not_found_error",
                param="model",
            )
        return served[model]

    def _config_of(self, step: ModelStep) -> dict[str, Any]:
        """The generation config of a model step's output: what its request-level call
        would send, with the server's defaults for what it leaves unset."""
        if any(k not in _CONFIG_KEYS for k in step.kwargs) or _asks_logprobs(step.model):
            raise ClientStep  # settings only the request-level route knows
        model = step.model
        kw = step.kwargs
        context = self._served(model.model)
        temperature = kw.get("temperature", model.temperature)
        top_p = kw.get("top_p", model.top_p)
        config: dict[str, Any] = {
            "temperature": 1.0 if temperature is None else float(temperature),
            "top_p": 1.0 if top_p is None else float(top_p),
        }
        max_tokens = kw.get("max_tokens", model.max_tokens)
        if max_tokens is None:
            max_tokens = context or 256
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
        bias = wire_bias(kw.get("logit_bias", getattr(model, "logit_bias", None)))
        if bias:
            config["logit_bias"] = {k: float(v) for k, v in bias.items()}
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


def _models(step: Any, client: bool = False) -> list[tuple[ModelStep, bool]]:
    """The Parrot models of a chain, each with whether it may run on the server (False
    for those under steps that always run on the client)."""
    from langchain_core.runnables import RunnableParallel, RunnableSequence
    from langchain_core.runnables.base import RunnableBindingBase, RunnableEach
    from langchain_core.runnables.branch import RunnableBranch
    from langchain_core.runnables.configurable import (
        DynamicRunnable,
        RunnableConfigurableAlternatives,
    )
    from langchain_core.runnables.fallbacks import RunnableWithFallbacks
    from langchain_core.runnables.passthrough import RunnableAssign

    found = model_of(step)
    if found is not None:
        return [(found, not client)]
    if isinstance(step, RunnableSequence):
        return [m for s in step.steps for m in _models(s, client)]
    if isinstance(step, RunnableParallel):
        return [m for s in step.steps__.values() for m in _models(s, client)]
    if isinstance(step, RunnableAssign):
        return _models(step.mapper, client)
    if isinstance(step, RunnableEach):
        return _models(step.bound, client)
    if isinstance(step, RunnableBindingBase):  # .bind, .with_config; .with_retry: client
        return _models(step.bound, client or not isinstance(step, RunnableBinding))
    if isinstance(step, DynamicRunnable):  # lowered as configured at invoke time
        found_ = _models(step.default, client)
        if isinstance(step, RunnableConfigurableAlternatives):
            for alt in step.alternatives.values():
                if isinstance(alt, Runnable):
                    found_ += _models(alt, client)
        return found_
    if isinstance(step, RunnableWithFallbacks):
        return [m for s in (step.runnable, *step.fallbacks) for m in _models(s, True)]
    if isinstance(step, RunnableBranch):
        parts = [r for _, r in step.branches] + [step.default]
        return [m for s in parts for m in _models(s, True)]
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
    from langchain_core.runnables.configurable import DynamicRunnable
    from langchain_core.runnables.passthrough import RunnableAssign

    found = model_of(step)
    if (
        found is not None
        and all(k in _CONFIG_KEYS for k in found.kwargs)
        and not _asks_logprobs(found.model)
    ):
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
    if isinstance(step, DynamicRunnable):  # as configured by default
        return _plan(step.default, server_data, out)
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
    """Iterate an async iterator from sync code, item by item, on a loop in a thread.
    Leaving early (`break`, `close()`) cancels it there, which cancels the run."""
    import queue as _queue

    items: _queue.Queue = _queue.Queue()
    end = object()
    running: dict[str, Any] = {}

    async def pump() -> None:
        running["loop"] = asyncio.get_running_loop()
        running["task"] = asyncio.current_task()
        try:
            async for item in agen:
                items.put((True, item))
        except BaseException as exc:
            items.put((False, exc))
        finally:
            items.put((True, end))

    thread = threading.Thread(target=lambda: asyncio.run(pump()), daemon=True)
    thread.start()
    try:
        while True:
            ok, item = items.get()
            if item is end:
                break
            if not ok:
                raise item
            yield item
    finally:
        if thread.is_alive() and "task" in running:
            with contextlib.suppress(RuntimeError):  # the loop just ended by itself
                running["loop"].call_soon_threadsafe(running["task"].cancel)
        thread.join()
