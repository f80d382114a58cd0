"""Turning an OpenAI request into engine inputs: prompt token ids and SamplingParams.

All checks that can fail because of the client happen here, before any engine work, and
raise APIError(400/404) that names the parameter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator
from functools import partial
from typing import Any

import anyio

from ..contract.errors import InvalidRequest
from ..contract.sampling import Constraint, SamplingParams
from ..engine.grammar import check
from ..engine.grammar_tools import CLOSE, OPEN, Function, tool_call_grammar
from .chat_template import ChatTemplateError, render_chat, takes_tools
from .errors import APIError
from .openai_logprobs import spelled_text
from .openai_schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    _SamplingFields,
)
from .state import ServerState

# How tools are described to a model whose chat template does not render them: the format
# the parser reads back (engine/grammar_tools.py), in a system message.
TOOLS_PREAMBLE = (
    "You can call these functions. Each line inside <tools></tools> describes one, with a "
    "JSON schema of its arguments:\n<tools>\n{tools}\n</tools>\n"
    "To call functions, reply with one block per call and nothing else:\n"
    f"{OPEN}\n"
    '{{"name": "<function name>", "arguments": <the arguments as a JSON object>}}\n'
    f"{CLOSE}"
)


@dataclasses.dataclass(slots=True)
class ChatPlan:
    """What a chat request becomes: the prompt, its decoding constraint (response format or
    forced tool call), and whether tool calls are parsed out of the output."""

    prompt_ids: list[int]
    constraint: Constraint | None = None
    parse_tools: bool = False


def unsupported(param: str, why: str) -> APIError:
    return APIError(
        400, f"'{param}' is not supported: {why}", param=param, code="unsupported_parameter"
    )


def check_model(state: ServerState, model: str) -> None:
    if model != state.model_name:
        raise APIError(
            404,
            f"The model '{model}' does not exist; this server serves '{state.model_name}'",
            param="model",
            code="model_not_found",
        )


def check_common(state: ServerState, body: _SamplingFields) -> int:
    """Checks shared by both endpoints; returns n."""
    check_model(state, body.model)
    n = body.n or 1
    if n > state.settings.max_n:
        raise APIError(400, f"n must be <= {state.settings.max_n}, got {n}", param="n")
    if body.stream_options is not None and not body.stream:
        raise APIError(
            400, "stream_options is only allowed when stream is true", param="stream_options"
        )
    stops = stop_list(body.stop)
    if len(stops) > state.settings.max_stop_sequences:
        raise APIError(
            400,
            f"at most {state.settings.max_stop_sequences} stop sequences "
            f"are allowed, got {len(stops)}",
            param="stop",
        )
    return n


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def resolve_max_tokens(
    state: ServerState, requested: int | None, prompt_len: int, param: str
) -> int:
    """The generation budget; 400 when the prompt (plus what was asked) exceeds the context."""
    if prompt_len == 0:
        raise APIError(400, "the prompt is empty (zero tokens)", param="prompt")
    limit = state.max_model_len
    if limit is None:
        return requested if requested is not None else 256
    room = limit - prompt_len
    if room <= 0:
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens, but the prompt has "
            f"{prompt_len} tokens; shorten the prompt.",
            param="messages" if param == "max_completion_tokens" else "prompt",
            code="context_length_exceeded",
        )
    if requested is None:
        return room
    if requested > room:
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens, but you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for "
            f"the completion); reduce {param} or the prompt.",
            param=param,
            code="context_length_exceeded",
        )
    return requested


def logprobs_of(state: ServerState, body: CompletionRequest | ChatCompletionRequest) -> int | None:
    """The top alternatives asked per token (`SamplingParams.logprobs`), None when no log
    probabilities are asked; 400 when the engine cannot return them."""
    if isinstance(body, ChatCompletionRequest):
        if not body.logprobs:
            if body.top_logprobs:
                raise APIError(400, "top_logprobs needs logprobs to be true", param="top_logprobs")
            return None
        k = body.top_logprobs or 0
    else:
        if body.logprobs is None:
            return None
        k = body.logprobs
    if not getattr(state.engine, "supports_logprobs", False):
        why = getattr(state.engine, "logprobs_refusal", None) or (
            f"the engine this server runs on ({type(state.engine).__name__}) "
            "does not return log probabilities"
        )
        raise unsupported("logprobs", why)
    return k


def prompt_logprobs_of(state: ServerState, body: CompletionRequest, k: int | None) -> int | None:
    """The top alternatives asked per prompt token (the fill's `prompt_logprobs`): legacy
    completions' `echo` with `logprobs` scores the prompt too; None otherwise.
    400 when the engine cannot return them."""
    if not body.echo or k is None:
        return None
    if not getattr(state.engine, "supports_prompt_logprobs", False):
        why = getattr(state.engine, "prompt_logprobs_refusal", None) or (
            f"the engine this server runs on ({type(state.engine).__name__}) "
            "does not return the prompt's log probabilities"
        )
        raise unsupported("echo", f"echo with logprobs: {why}")
    return k


def check_max_tokens_zero(body: CompletionRequest) -> None:
    """max_tokens 0 asks for the prompt alone: only with echo (400 otherwise)."""
    if body.max_tokens == 0 and not body.echo:
        raise APIError(
            400,
            "max_tokens must be >= 1; 0 is allowed only with echo: true (the prompt alone, "
            "with its logprobs when logprobs is set)",
            param="max_tokens",
        )


def build_sampling(
    state: ServerState,
    body: _SamplingFields,
    max_tokens: int,
    constraint: Constraint | None = None,
    logprobs: int | None = None,
) -> SamplingParams:
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else float(body.temperature),
        top_p=1.0 if body.top_p is None else float(body.top_p),
        top_k=body.top_k or 0,
        seed=body.seed,
        stop=stop_list(body.stop),
        ignore_eos=bool(body.ignore_eos),
        constraint=constraint,
        presence_penalty=float(body.presence_penalty or 0.0),
        frequency_penalty=float(body.frequency_penalty or 0.0),
        logprobs=logprobs,
        logit_bias=logit_bias_pairs(body.logit_bias),
    )
    try:
        params.validate(state.vocab_size)
    except InvalidRequest as exc:
        # validate() names the field first ("top_k must be ..."): surface it as the param
        field_name = str(exc).split(" ", 1)[0]
        raise APIError(
            400, str(exc), param=field_name if hasattr(params, field_name) else None
        ) from None
    return params


def logit_bias_pairs(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias` ({"token id": bias}) as `SamplingParams.logit_bias` pairs (the
    ranges are checked by `SamplingParams.validate`)."""
    pairs = []
    for key, value in (bias or {}).items():
        text = key.strip()
        # ASCII digits only: int() also reads other scripts' digits ("٣" is 3) and
        # str.isdigit() passes superscripts, which int() refuses
        digits = text[1:] if text.startswith("-") else text
        tid = int(text) if digits.isascii() and digits.isdigit() else None
        if tid is None:
            raise APIError(
                400,
                f"logit_bias keys must be token ids (integers as strings), got {key[:40]!r}",
                param="logit_bias",
            )
        pairs.append((tid, float(value)))
    return tuple(pairs)


async def tokenize(state: ServerState, text: str, param: str = "prompt") -> list[int]:
    # JSON may carry lone surrogates ("\ud800") that no tokenizer can encode.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(
            400, f"{param} contains invalid Unicode (a lone surrogate)", param=param
        ) from None
    # Off the event loop: long prompts take milliseconds that other streams would feel.
    return list(await anyio.to_thread.run_sync(state.engine.tokenize, text))


def check_token_ids(state: ServerState, ids: list[int]) -> None:
    vocab = state.vocab_size
    for tid in ids:
        if tid < 0 or (vocab is not None and tid >= vocab):
            raise APIError(
                400, f"prompt token id {tid} is outside the vocabulary [0, {vocab})", param="prompt"
            )


@dataclasses.dataclass(slots=True)
class CompletionPrompt:
    """One prompt of a completions request: its token ids, its text (for echo; "" for
    token ids without echo) and its generation budget (`resolve_budgets`: `max_tokens`
    checked against its length; with `max_tokens` null, the rest of the context after
    this prompt)."""

    ids: list[int]
    text: str
    max_tokens: int = 0


def max_prompts(state: ServerState) -> int:
    """Most prompts one request may carry: `max_prompts`, and no more than the in-flight
    slots, all or one tenant's (each prompt takes one, so a larger batch could never be
    admitted)."""
    settings = state.settings
    caps = [settings.max_prompts, settings.max_inflight, settings.max_inflight_per_tenant]
    return min(c for c in caps if c is not None)


@contextlib.contextmanager
def _naming(index: int, count: int) -> Iterator[None]:
    """A batch's errors name their prompt (`prompt[3]: ...`); a single prompt's are as
    they always were."""
    try:
        yield
    except APIError as exc:
        if count == 1:
            raise
        raise APIError(
            exc.status,
            f"prompt[{index}]: {exc.message}",
            type=exc.type,
            param=f"prompt[{index}]" if exc.param == "prompt" else exc.param,
            code=exc.code,
            headers=exc.headers,
        ) from None


def _prompt_list(state: ServerState, body: CompletionRequest) -> list[str | list[int]]:
    prompt = body.prompt
    if not isinstance(prompt, list):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be an empty list", param="prompt")
    if not isinstance(prompt[0], (str, list)):
        return [prompt]  # token ids: one prompt
    cap = max_prompts(state)
    if len(prompt) > cap:
        raise APIError(
            400,
            f"at most {cap} prompts are allowed in one request, got {len(prompt)}; "
            "send the rest in further requests",
            param="prompt",
        )
    return list(prompt)


async def completion_prompts(state: ServerState, body: CompletionRequest) -> list[CompletionPrompt]:
    """Each prompt of the request (one, or a batch: a list of strings or of token id
    lists) tokenized and checked, every one before any engine work."""
    if body.best_of is not None and body.best_of != 1:
        raise unsupported("best_of", "use n instead")
    if body.suffix:
        raise unsupported("suffix", "insertion is not implemented")
    prompts = _prompt_list(state, body)
    out = []
    for i, prompt in enumerate(prompts):
        with _naming(i, len(prompts)):
            if isinstance(prompt, str):
                out.append(CompletionPrompt(await tokenize(state, prompt), prompt))
                continue
            ids = list(prompt)
            check_token_ids(state, ids)
            out.append(CompletionPrompt(ids, spelled_text(state.engine, ids) if body.echo else ""))
    return out


def resolve_budgets(
    state: ServerState, body: CompletionRequest, prompts: list[CompletionPrompt]
) -> None:
    """Each prompt's `max_tokens` (`resolve_max_tokens`: 400 when it does not fit)."""
    for i, prompt in enumerate(prompts):
        with _naming(i, len(prompts)):
            prompt.max_tokens = resolve_max_tokens(
                state, body.max_tokens, len(prompt.ids), "max_tokens"
            )


def _text(message: ChatMessage) -> str:
    if isinstance(message.content, list):
        return "\n".join(part.text for part in message.content)
    return message.content or ""


def _arguments(text: str) -> Any:
    # templates that render calls expect the arguments as a mapping (HF's convention)
    try:
        return json.loads(text)
    except ValueError:
        return text


def _call_block(name: str, arguments: str) -> str:
    args = _arguments(arguments)
    body = {"name": name, "arguments": args if not isinstance(args, str) else arguments}
    return f"{OPEN}\n{json.dumps(body, ensure_ascii=False)}\n{CLOSE}"


def chat_messages(body: ChatCompletionRequest, *, native_tools: bool = False) -> list[dict]:
    """Messages as the plain dicts chat templates expect (text parts joined).

    Tool calls of assistant messages and `tool` messages go to a template that renders
    tools (`native_tools`) as fields; for any other template they become text in the
    format the model was told to use: call blocks in the assistant's turn, results as a
    user turn holding `<tool_response>` (a role the template may not know)."""
    out = []
    for m in body.messages:
        content = _text(m)
        msg: dict[str, Any] = {"role": m.role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        if m.role == "assistant" and m.tool_calls:
            if native_tools:
                msg["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {
                            "name": c.function.name,
                            "arguments": _arguments(c.function.arguments),
                        },
                    }
                    for c in m.tool_calls
                ]
            else:
                blocks = "\n".join(
                    _call_block(c.function.name, c.function.arguments) for c in m.tool_calls
                )
                msg["content"] = f"{content}\n{blocks}" if content else blocks
        elif m.role == "tool":
            if native_tools:
                if m.tool_call_id is not None:
                    msg["tool_call_id"] = m.tool_call_id
            else:
                msg = {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
        out.append(msg)
    return out


def tool_messages(messages: list[dict], tools: list[dict]) -> list[dict]:
    """`messages` with the tools described in the system message (added when there is
    none), for templates that do not render tools themselves."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    preamble = TOOLS_PREAMBLE.format(tools=lines)
    if messages and messages[0]["role"] in ("system", "developer"):
        first = dict(messages[0])
        first["content"] = f"{first['content']}\n\n{preamble}" if first["content"] else preamble
        return [first, *messages[1:]]
    return [{"role": "system", "content": preamble}, *messages]


def _checked(constraint: Constraint, param: str) -> Constraint:
    try:
        check(constraint)
    except InvalidRequest as exc:
        raise APIError(400, f"{param}: {exc}", param=param, code="unsupported_schema") from None
    return constraint


def _tool_choice(body: ChatCompletionRequest) -> tuple[str, str | None]:
    """(mode, forced function name): mode is none, auto, required or named."""
    choice = body.tool_choice
    if choice is None:
        return ("auto" if body.tools else "none"), None
    if isinstance(choice, str):
        if choice != "none" and not body.tools:
            raise APIError(400, f"tool_choice {choice!r} needs tools", param="tool_choice")
        return choice, None
    if not body.tools:
        raise APIError(
            400, "tool_choice names a function but no tools were given", param="tool_choice"
        )
    name = choice.function.name
    if name not in {t.function.name for t in body.tools}:
        raise APIError(
            400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice"
        )
    return "named", name


def _functions(body: ChatCompletionRequest) -> list[Function]:
    """The tools as grammar functions, each schema checked (400 naming the tool)."""
    functions, seen = [], set()
    for i, tool in enumerate(body.tools or []):
        f = tool.function
        if f.name in seen:
            raise APIError(400, f"two tools are named {f.name!r}", param=f"tools[{i}]")
        seen.add(f.name)
        parameters = f.parameters if f.parameters is not None else {"type": "object"}
        _checked(
            Constraint("json_schema", json.dumps(parameters, ensure_ascii=False)),
            f"tools[{i}].function.parameters",
        )
        functions.append(Function(f.name, parameters))
    return functions


def _content_schema(body: ChatCompletionRequest) -> dict[str, Any] | None:
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise APIError(
            400,
            "response_format of type json_schema needs json_schema.schema",
            param="response_format.json_schema",
        )
    schema = fmt.json_schema.schema_
    _checked(
        Constraint("json_schema", json.dumps(schema, ensure_ascii=False)),
        "response_format.json_schema.schema",
    )
    return schema


def _constraint(
    body: ChatCompletionRequest, mode: str, forced: str | None, functions: list[Function]
) -> Constraint | None:
    """The decoding constraint: forced tool calls, a response format, or (tools offered
    freely under a response format) either of the two."""
    content = _content_schema(body)
    parallel = body.parallel_tool_calls is not False
    if mode in ("required", "named"):
        chosen = [f for f in functions if forced is None or f.name == forced]
        grammar = tool_call_grammar(chosen, parallel=parallel)
    elif mode == "auto" and content is not None:
        grammar = tool_call_grammar(functions, parallel=parallel, content_schema=content)
    elif content is not None:
        return Constraint("json_schema", json.dumps(content, ensure_ascii=False))
    else:
        return None
    return _checked(Constraint("lark", grammar), "tools")


async def chat_prompt(state: ServerState, body: ChatCompletionRequest) -> ChatPlan:
    """The prompt and decoding plan of a chat request (400s name the bad parameter)."""
    template = state.chat_template
    if body.chat_template is not None:
        if not state.settings.allow_request_chat_template:
            raise APIError(
                400, "chat_template in a request is disabled on this server", param="chat_template"
            )
        template = body.chat_template
    mode, forced = _tool_choice(body)
    functions = _functions(body)
    constraint = _constraint(body, mode, forced, functions)
    native = takes_tools(template)
    messages = chat_messages(body, native_tools=native)
    tools = None
    if mode != "none":  # with 'none' the model is not told of tools it may not call
        tools = [t.model_dump(exclude_none=True, by_alias=True) for t in body.tools]
        if not native:
            messages, tools = tool_messages(messages, tools), None
    render = partial(
        render_chat,
        template,
        messages,
        add_generation_prompt=body.add_generation_prompt is not False,
        special_tokens=state.special_tokens,
        max_chars=state.settings.max_chat_template_chars,
        tools=tools,
    )
    try:
        text = await anyio.to_thread.run_sync(render)
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), param="messages", code="chat_template_error") from None
    return ChatPlan(await tokenize(state, text, "messages"), constraint, parse_tools=mode != "none")
