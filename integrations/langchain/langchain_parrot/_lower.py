"""Lowering an LCEL chain into calls of a Parrot program, step by step, with symbolic
values in place of what the server will generate.

A chain runs here on *symbolic* values: a string the server generates is a `Var` (a
semantic variable), a rendered prompt is a `Text` of literal pieces and `Var`s, a chat
prompt a `Chat` of such texts, a chat model's answer an `AIMsg`. Steps the server can
run become calls (`ChatParrot`/`ParrotLLM`, also under `.bind`/`.with_config`) or just
reshape values (sequences, parallels and dicts, passthrough and `.assign`, picks and
`itemgetter`, `.map()`, prompt templates, `StrOutputParser`). Any other step (arbitrary
Python, other parsers, branches, retrievers, tools) runs on the client with concrete
values: the walker asks the `Scheduler` for the values it needs (which sends the calls
gathered so far and waits), runs the step, and feeds its output back as new inputs of
the same run. Strings that enter the program are always variables (data), never
template text, so they are never parsed as placeholders and never spell chat markup.
"""

from __future__ import annotations

import asyncio
import contextvars
import html
import itertools
import operator
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    HumanMessage,
    SystemMessage,
    convert_to_messages,
)
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompt_values import ChatPromptValue, StringPromptValue
from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder, PromptTemplate
from langchain_core.prompts.chat import (
    AIMessagePromptTemplate,
    HumanMessagePromptTemplate,
    SystemMessagePromptTemplate,
)
from langchain_core.runnables import (
    Runnable,
    RunnableBinding,
    RunnableConfig,
    RunnableLambda,
    RunnableParallel,
    RunnablePassthrough,
    RunnablePick,
    RunnableSequence,
)
from langchain_core.runnables.base import RunnableEach
from langchain_core.runnables.configurable import DynamicRunnable
from langchain_core.runnables.passthrough import RunnableAssign

from .chat_models import ChatParrot
from .llms import ParrotLLM

# Which input of a batch the running walker serves (set per walker task; child tasks of
# parallels and maps inherit it): the calls it makes are traced under that input's run.
OWNER: contextvars.ContextVar[int] = contextvars.ContextVar("parrot_owner", default=0)


# ------------------------------------------------------------------------- values
@dataclass(frozen=True, slots=True)
class Var:
    """A semantic variable: a string the server has (or will generate)."""

    name: str


Piece = str | Var


@dataclass(frozen=True, slots=True)
class Text:
    """A string made of literal pieces and variables; `prompt`: a StringPromptValue."""

    pieces: tuple[Piece, ...]
    prompt: bool = False


@dataclass(frozen=True, slots=True)
class Chat:
    """A ChatPromptValue: (role, text) per message; roles system, human, ai."""

    messages: tuple[tuple[str, Text], ...]


@dataclass(frozen=True, slots=True)
class AIMsg:
    """A chat model's answer: an AIMessage whose content is `var` (made by call `call`)."""

    var: Var
    call: str


_ROLES = {"system": "system", "human": "user", "ai": "assistant"}
_BUFFER = {"system": "System", "human": "Human", "ai": "AI"}  # get_buffer_string's names


def variables(value: Any) -> set[str]:
    """Names of the variables in a symbolic value."""
    out: set[str] = set()
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, Var):
            out.add(v.name)
        elif isinstance(v, Text):
            out.update(p.name for p in v.pieces if isinstance(p, Var))
        elif isinstance(v, Chat):
            stack.extend(t for _, t in v.messages)
        elif isinstance(v, AIMsg):
            out.add(v.var.name)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return out


def concrete(value: Any, values: dict[str, str], meta: dict[str, dict]) -> Any:
    """The Python value a plain chain would have here (every variable known)."""
    if isinstance(value, Var):
        return values[value.name]
    if isinstance(value, Text):
        text = "".join(p if isinstance(p, str) else values[p.name] for p in value.pieces)
        return StringPromptValue(text=text) if value.prompt else text
    if isinstance(value, Chat):
        kinds = {"system": SystemMessage, "human": HumanMessage, "ai": AIMessage}
        return ChatPromptValue(
            messages=[kinds[r](content=concrete(t, values, meta)) for r, t in value.messages]
        )
    if isinstance(value, AIMsg):
        info = meta.get(value.call, {})
        return AIMessage(content=values[value.var.name], **info)
    if isinstance(value, dict):
        return {k: concrete(v, values, meta) for k, v in value.items()}
    if isinstance(value, list):
        return [concrete(v, values, meta) for v in value]
    return value


def _as_text(value: Any) -> Text | None:
    """A value that formats into a template as text, or None."""
    if isinstance(value, Var):
        return Text((value,))
    if isinstance(value, str):
        return Text((value,))
    if isinstance(value, Text) and not value.prompt:
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return Text((str(value),))
    return None


def escape(text: str, before_placeholder: bool) -> str:
    """Literal text in the template syntax: every `{` literal, backslashes before one
    doubled (and before a following placeholder)."""
    out: list[str] = []
    i = 0
    while i < len(text):
        j = i
        while j < len(text) and text[j] == "\\":
            j += 1
        run = text[i:j]
        if j < len(text) and text[j] == "{":
            out.append(run * 2 + "\\{")
            i = j + 1
        elif j == len(text) and before_placeholder:
            out.append(run * 2)
            i = j
        elif run:
            out.append(run)
            i = j
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def template_of(text: Text, output: str | None = None) -> str:
    """The Parrot template of a text (inputs for variables), then `{{output:...}}`."""
    pieces: list[Piece] = []
    for p in (*text.pieces, *([Var(output)] if output is not None else [])):
        if isinstance(p, str) and pieces and isinstance(pieces[-1], str):
            pieces[-1] += p  # escaped as one text: only a placeholder ends a literal
        else:
            pieces.append(p)
    out = []
    for i, p in enumerate(pieces):
        if isinstance(p, str):
            out.append(escape(p, i + 1 < len(pieces)))
        elif output is not None and i == len(pieces) - 1:
            out.append(f"{{{{output:{p.name}}}}}")
        else:
            out.append(f"{{{{input:{p.name}}}}}")
    return "".join(out)


# ------------------------------------------------------------------------- the walk
class ClientStep(Exception):
    """This step runs on the client (with concrete values)."""


@dataclass(slots=True)
class ModelStep:
    """A Parrot model with its call-time keyword arguments (from `.bind`)."""

    model: ChatParrot | ParrotLLM
    kwargs: dict[str, Any]


def model_of(step: Runnable) -> ModelStep | None:
    """The Parrot model a step is (through bindings), or None."""
    kwargs: dict[str, Any] = {}
    while isinstance(step, RunnableBinding):
        kwargs = {**step.kwargs, **kwargs}
        step = step.bound
    if isinstance(step, (ChatParrot, ParrotLLM)):
        return ModelStep(step, kwargs)
    return None


def may_call(step: Any) -> bool:
    """Whether the server could get calls from `step` (a model somewhere inside)."""
    if model_of(step) is not None:
        return True
    if isinstance(step, RunnableBinding):
        return may_call(step.bound)
    if isinstance(step, RunnableSequence):
        return any(may_call(s) for s in step.steps)
    if isinstance(step, RunnableParallel):
        return any(may_call(s) for s in step.steps__.values())
    if isinstance(step, RunnableAssign):
        return may_call(step.mapper)
    if isinstance(step, RunnableEach):
        return may_call(step.bound)
    if isinstance(step, DynamicRunnable):
        return may_call(step.default)
    return False


class Lowering:
    """Walks chains for one run: gathers calls into the scheduler's session, runs client
    steps, and gives each chain's symbolic output."""

    def __init__(self, scheduler: Any, config_of: Any) -> None:
        self.scheduler = scheduler  # Scheduler: session, resolve(), child walkers
        self.config_of = config_of  # ModelStep -> generation config of its output
        self.ids = itertools.count()
        self.client_steps = 0  # steps run on the client
        self.round_trips = 0  # times the client waited for server values
        self.meta: dict[str, dict] = {}  # call -> AIMessage fields (filled from events)
        self.models: dict[str, ModelStep] = {}  # call -> model, for tracing
        self.prompts: dict[str, Any] = {}  # call -> its symbolic prompt, for tracing
        self.owners: dict[str, int] = {}  # call -> the batch input it serves, for tracing

    def new_input(self, value: str) -> Var:
        """A client-side string as an input variable of the run."""
        var = Var(f"in{next(self.ids)}")
        self.scheduler.session.add_input(var.name, value)
        return var

    def symbolize(self, value: Any) -> Any:
        """A concrete Python value entering the program: strings become inputs."""
        if isinstance(value, str):
            return self.new_input(value)
        if isinstance(value, dict):
            return {k: self.symbolize(v) for k, v in value.items()}
        if isinstance(value, list) and not all(isinstance(v, BaseMessage) for v in value):
            return [self.symbolize(v) for v in value]
        return value

    async def walk(
        self, step: Any, value: Any, later: tuple[Any, ...], config: RunnableConfig | None
    ) -> Any:
        """The symbolic output of `step` on `value`; `later`: the steps after it."""
        try:
            return await self._lower(step, value, later, config)
        except ClientStep:
            return await self._client(step, value, later, config)

    async def _lower(
        self, step: Any, value: Any, later: tuple[Any, ...], config: RunnableConfig | None
    ) -> Any:
        if isinstance(step, RunnableSequence):
            steps = step.steps
            for i, s in enumerate(steps):
                value = await self.walk(s, value, (*steps[i + 1 :], *later), config)
            return value
        if isinstance(step, RunnableParallel):
            branches = step.steps__
            results = await self.scheduler.gather(
                [self.walk(s, value, later, config) for s in branches.values()]
            )
            return dict(zip(branches, results, strict=True))
        if isinstance(step, RunnableAssign):
            if not isinstance(value, dict):
                raise ClientStep
            added = await self.walk(step.mapper, value, later, config)
            return {**value, **added}
        if isinstance(step, RunnablePassthrough):
            if step.func is not None or step.afunc is not None:
                raise ClientStep  # a side effect on the concrete input
            return value
        if isinstance(step, RunnablePick):
            if not isinstance(value, dict):
                raise ClientStep
            if isinstance(step.keys, str):
                return value.get(step.keys)
            return {k: value[k] for k in step.keys if k in value} or None
        if isinstance(step, RunnableLambda) and isinstance(step.func, operator.itemgetter):
            return self._itemgetter(step.func, value)
        if isinstance(step, RunnableEach):
            if not isinstance(value, list):
                raise ClientStep  # a list the server makes: its length is not known here
            return list(
                await self.scheduler.gather(
                    [self.walk(step.bound, v, later, config) for v in value]
                )
            )
        model = model_of(step)
        if model is not None:
            return self._call(model, value)
        if isinstance(step, DynamicRunnable):  # configurable fields or alternatives
            bound, bound_config = step.prepare(config)
            return await self._lower(bound, value, later, bound_config)
        if isinstance(step, RunnableBinding):
            if step.kwargs:
                raise ClientStep
            return await self.walk(step.bound, value, later, config)
        if isinstance(step, PromptTemplate):
            return self._prompt(step, value)
        if isinstance(step, ChatPromptTemplate):
            return self._chat_prompt(step, value)
        if isinstance(step, StrOutputParser):
            if isinstance(value, AIMsg):
                return value.var
            if isinstance(value, (Var, str)):
                return value
            if isinstance(value, Text) and not value.prompt:
                return value
            raise ClientStep
        raise ClientStep

    def _itemgetter(self, getter: operator.itemgetter, value: Any) -> Any:
        keys = getter.__reduce__()[1]
        if not isinstance(value, dict) or not all(k in value for k in keys):
            raise ClientStep
        return value[keys[0]] if len(keys) == 1 else tuple(value[k] for k in keys)

    # ------------------------------------------------------------------ prompts
    def _fields(self, step: PromptTemplate | ChatPromptTemplate, value: Any) -> dict[str, Any]:
        if not isinstance(value, dict):
            names = step.input_variables
            if len(names) != 1:
                raise ClientStep  # what the plain prompt would refuse, it refuses there
            value = {names[0]: value}
        fields = dict(step.partial_variables)
        fields.update(value)
        for k, v in list(fields.items()):
            if callable(v) and not isinstance(v, Runnable):
                fields[k] = v()  # a partial given as a function is called at format time
        return fields

    def _prompt(self, step: PromptTemplate, value: Any) -> Text:
        return Text(self._format(step, self._fields(step, value)), prompt=True)

    def _format(self, step: PromptTemplate, fields: dict[str, Any]) -> tuple[Piece, ...]:
        pieces: list[Piece] = []
        if step.template_format == "f-string":
            for literal, name, spec, conversion in string.Formatter().parse(step.template):
                if literal:
                    pieces.append(literal)
                if name is None:
                    continue
                if spec or conversion or name not in fields:
                    raise ClientStep  # formatting the server cannot apply to a value
                text = _as_text(fields[name])
                if text is None:
                    raise ClientStep
                pieces.extend(text.pieces)
        elif step.template_format == "mustache":
            from langchain_core.utils import mustache

            for kind, token in mustache.tokenize(step.template):
                if kind == "literal":
                    pieces.append(token)
                elif kind in ("variable", "no escape") and token in fields:
                    text = _as_text(fields[token])
                    if text is None:
                        raise ClientStep
                    for p in text.pieces:
                        if kind == "no escape":
                            pieces.append(p)
                        elif isinstance(p, str):
                            pieces.append(html.escape(p))
                        elif p.name in self.scheduler.session.inputs:  # escaped, as data
                            value = self.scheduler.session.inputs[p.name]
                            pieces.append(self.new_input(html.escape(value)))
                        else:
                            raise ClientStep  # a generated value the client must escape
                else:
                    raise ClientStep  # sections, partials, dotted names: on the client
        else:
            raise ClientStep  # jinja2
        return tuple(pieces)

    def _chat_prompt(self, step: ChatPromptTemplate, value: Any) -> Chat:
        fields = self._fields(step, value)
        messages: list[tuple[str, Text]] = []
        for m in step.messages:
            if isinstance(m, BaseMessage):
                messages.append(self._message(m))
            elif isinstance(m, MessagesPlaceholder):
                got = fields.get(m.variable_name)
                if got is None and m.optional:
                    continue
                if not isinstance(got, list):
                    raise ClientStep
                got = got[-m.n_messages :] if m.n_messages else got
                for item in got:
                    if isinstance(item, AIMsg):
                        messages.append(("ai", Text((item.var,))))
                    else:
                        [msg] = convert_to_messages([item])
                        messages.append(self._message(msg))
            else:
                role = {
                    SystemMessagePromptTemplate: "system",
                    HumanMessagePromptTemplate: "human",
                    AIMessagePromptTemplate: "ai",
                }.get(type(m))
                prompt = getattr(m, "prompt", None)
                if role is None or not isinstance(prompt, PromptTemplate):
                    raise ClientStep  # multimodal contents, custom message templates
                messages.append((role, Text(self._format(prompt, fields))))
        return Chat(tuple(messages))

    @staticmethod
    def _message(message: BaseMessage) -> tuple[str, Text]:
        if message.type not in _ROLES or not isinstance(message.content, str):
            raise ClientStep
        if message.name or (isinstance(message, AIMessage) and message.tool_calls):
            raise ClientStep  # ChatParrot sends these fields, which a template cannot hold
        return message.type, Text((message.content,))

    # ------------------------------------------------------------------ calls
    def _call(self, model: ModelStep, value: Any) -> Any:
        name = f"c{next(self.ids)}"
        out = f"o{name[1:]}"
        config = self.config_of(model)
        if isinstance(model.model, ChatParrot):
            if isinstance(value, Chat):
                messages = value.messages
            else:
                text = _as_text(value) or (value if isinstance(value, Text) else None)
                if text is None:
                    raise ClientStep
                messages = (("human", Text(text.pieces)),)
            call = {
                "name": name,
                "outputs": {out: config},
                "messages": [
                    *({"role": _ROLES[r], "content": template_of(t)} for r, t in messages),
                    {"role": "assistant", "content": f"{{{{output:{out}}}}}"},
                ],
            }
            result: Any = AIMsg(Var(out), name)
            prompt: Any = Chat(tuple(messages))
        else:
            if isinstance(value, Chat):  # a chat prompt to a text model: its buffer string
                pieces: list[Piece] = []
                for i, (r, t) in enumerate(value.messages):
                    pieces.extend([*(["\n"] if i else []), f"{_BUFFER[r]}: ", *t.pieces])
                text = Text(tuple(pieces))
            else:
                text = _as_text(value) or (value if isinstance(value, Text) else None)
                if text is None:
                    raise ClientStep
            call = {"name": name, "template": template_of(text, out), "outputs": {out: config}}
            result = Var(out)
            prompt = Text(text.pieces, prompt=True)
        self.scheduler.session.add_call(call)
        self.models[name] = model
        self.prompts[name] = prompt
        self.owners[name] = OWNER.get()
        return result

    # ------------------------------------------------------------------ the client
    async def _client(
        self, step: Any, value: Any, later: tuple[Any, ...], config: RunnableConfig | None
    ) -> Any:
        """Run `step` on the client: get the values it needs, run it, feed its output
        back into the run as inputs."""
        self.client_steps += 1
        needed = variables(value)
        session = self.scheduler.session
        if any(n not in session.values for n in needed):
            self.round_trips += 1
            more = any(may_call(s) for s in later)
            await self.scheduler.resolve(needed, more_calls_later=more)
        given = concrete(value, session.values, self.meta)
        result = await step.ainvoke(given, config)
        return self.symbolize(result)


async def gather_all(coros: Sequence[Any]) -> list[Any]:
    """asyncio.gather, cancelling the rest when one fails."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        raise
