"""Turning an OpenAI request into engine inputs: prompt token ids and SamplingParams.

All checks that can fail because of the client happen here, before any engine work, and
raise APIError(400/404) that names the parameter.
"""

from __future__ import annotations

from functools import partial

import anyio

from ..engine.errors import InvalidRequest
from ..engine.sampling import SamplingParams
from .chat_template import ChatTemplateError, render_chat
from .errors import APIError
from .openai_schemas import ChatCompletionRequest, CompletionRequest, _SamplingFields
from .state import ServerState


def unsupported(param: str, why: str) -> APIError:
    return APIError(400, f"'{param}' is not supported: {why}", param=param,
                    code="unsupported_parameter")


def check_model(state: ServerState, model: str) -> None:
    if model != state.model_name:
        raise APIError(404, f"The model '{model}' does not exist; this server serves "
                            f"'{state.model_name}'", param="model", code="model_not_found")


def check_common(state: ServerState, body: _SamplingFields) -> int:
    """Checks shared by both endpoints; returns n."""
    check_model(state, body.model)
    n = body.n or 1
    if n > state.settings.max_n:
        raise APIError(400, f"n must be <= {state.settings.max_n}, got {n}", param="n")
    if body.presence_penalty or body.frequency_penalty:
        raise unsupported("presence_penalty" if body.presence_penalty else "frequency_penalty",
                          "penalties are not implemented; send 0 or omit it")
    if body.logit_bias:
        raise unsupported("logit_bias", "send null or omit it")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed when stream is true",
                       param="stream_options")
    stops = stop_list(body.stop)
    if len(stops) > state.settings.max_stop_sequences:
        raise APIError(400, f"at most {state.settings.max_stop_sequences} stop sequences "
                            f"are allowed, got {len(stops)}", param="stop")
    return n


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def resolve_max_tokens(state: ServerState, requested: int | None, prompt_len: int,
                       param: str) -> int:
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


def build_sampling(state: ServerState, body: _SamplingFields, max_tokens: int) -> SamplingParams:
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else float(body.temperature),
        top_p=1.0 if body.top_p is None else float(body.top_p),
        top_k=body.top_k or 0,
        seed=body.seed,
        stop=stop_list(body.stop),
        ignore_eos=bool(body.ignore_eos),
    )
    try:
        params.validate(state.vocab_size)
    except InvalidRequest as exc:
        # validate() names the field first ("top_k must be ..."): surface it as the param
        field_name = str(exc).split(" ", 1)[0]
        raise APIError(400, str(exc), param=field_name if hasattr(params, field_name) else None
                       ) from None
    return params


async def tokenize(state: ServerState, text: str, param: str = "prompt") -> list[int]:
    # JSON may carry lone surrogates ("\ud800") that no tokenizer can encode.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, f"{param} contains invalid Unicode (a lone surrogate)",
                       param=param) from None
    # Off the event loop: long prompts take milliseconds that other streams would feel.
    return list(await anyio.to_thread.run_sync(state.engine.tokenize, text))


def check_token_ids(state: ServerState, ids: list[int]) -> None:
    vocab = state.vocab_size
    for tid in ids:
        if tid < 0 or (vocab is not None and tid >= vocab):
            raise APIError(400, f"prompt token id {tid} is outside the vocabulary "
                                f"[0, {vocab})", param="prompt")


async def completion_prompt(state: ServerState, body: CompletionRequest) -> tuple[list[int], str]:
    """Prompt token ids and the prompt text (for echo)."""
    if body.logprobs is not None:
        raise unsupported("logprobs", "log probabilities are not implemented")
    if body.best_of is not None and body.best_of != 1:
        raise unsupported("best_of", "use n instead")
    if body.suffix:
        raise unsupported("suffix", "insertion is not implemented")
    prompt = body.prompt
    if isinstance(prompt, list):
        if not prompt:
            raise APIError(400, "prompt must not be an empty list", param="prompt")
        if isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, "batched prompts are not supported: send one prompt per "
                                    "request (or use n for several choices)", param="prompt")
            prompt = prompt[0]
    if isinstance(prompt, str):
        return await tokenize(state, prompt), prompt
    ids = list(prompt)
    check_token_ids(state, ids)
    text = state.engine.detokenize(ids) if body.echo else ""
    return ids, text


def chat_messages(body: ChatCompletionRequest) -> list[dict]:
    """Messages as the plain dicts chat templates expect (text parts joined)."""
    out = []
    for m in body.messages:
        if isinstance(m.content, list):
            content = "\n".join(part.text for part in m.content)
        else:
            content = m.content or ""
        msg = {"role": m.role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


async def chat_prompt(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    if body.tools:
        raise unsupported("tools", "tool calling is not implemented")
    if body.tool_choice not in (None, "none"):
        raise unsupported("tool_choice", "tool calling is not implemented")
    if body.response_format is not None and body.response_format.type != "text":
        raise unsupported("response_format", "only {'type': 'text'} is implemented")
    if body.logprobs or body.top_logprobs:
        raise unsupported("logprobs", "log probabilities are not implemented")
    template = state.chat_template
    if body.chat_template is not None:
        if not state.settings.allow_request_chat_template:
            raise APIError(400, "chat_template in a request is disabled on this server",
                           param="chat_template")
        template = body.chat_template
    render = partial(
        render_chat, template, chat_messages(body),
        add_generation_prompt=body.add_generation_prompt is not False,
        special_tokens=state.special_tokens,
        max_chars=state.settings.max_chat_template_chars,
    )
    try:
        text = await anyio.to_thread.run_sync(render)
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), param="messages", code="chat_template_error") from None
    return await tokenize(state, text, "messages")
