"""The tokenizer over HTTP, at vLLM's paths: `POST /tokenize`, `POST /detokenize`,
`GET /tokenizer_info`.

Clients count tokens before they send (a prompt's `count` against `max_model_len`), and
evaluation harnesses score token ids they build themselves: lm-evaluation-harness's
`local-completions` uses the server's tokenizer when `/tokenizer_info` answers with an
`eos_token` and `/tokenize` with `tokens`, so it needs no tokenizer files of its own.

The ids are the ones the server's routes compute: `/tokenize` of a prompt gives what
`/v1/completions` counts as `prompt_tokens` for it, and of `messages` what
`/v1/chat/completions` renders with the model's chat template. The server adds no special
tokens to a prompt (no BOS: its engine never does), so `add_special_tokens` changes
nothing; it is accepted for vLLM's clients. Special tokens are spelled out (`token_strs`,
`/detokenize`), as in the completions route's logprobs and echo, so `/detokenize` of
`/tokenize`'s ids gives the text back. Behind the API key as every route but
`/healthz`.
"""

from __future__ import annotations

import anyio
from fastapi import APIRouter
from pydantic import Field, model_validator

from .errors import APIError
from .openai_logprobs import TokenTexts, spelled_text
from .openai_prep import chat_prompt, check_model, tokenize
from .openai_schemas import (
    ChatCompletionRequest,
    ChatMessage,
    Tool,
    ToolChoice,
    _Request,
    _Response,
)
from .state import StateDep

router = APIRouter(tags=["tokenizer"])

MAX_DETOKENIZE = 1 << 20  # ids per /detokenize request (the body limit comes first)


class TokenizeRequest(_Request):
    """A prompt, or chat messages rendered as `/v1/chat/completions` renders them."""

    model: str | None = Field(default=None, max_length=512)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: ToolChoice | None = None  # 'none' renders no tools, as chat does
    add_generation_prompt: bool = True
    add_special_tokens: bool = True  # accepted; the server adds none (see the module)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class TokenizeResponse(_Response):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = Field(default=None, max_length=512)
    tokens: list[int] = Field(max_length=MAX_DETOKENIZE)


class DetokenizeResponse(_Response):
    prompt: str


class TokenizerInfo(_Response):
    model: str
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    chat_template: str | None
    model_max_length: int | None
    vocab_size: int | None
    add_special_tokens: bool = False


@router.post("/tokenize", response_model=TokenizeResponse, response_model_exclude_none=True)
async def tokenize_route(body: TokenizeRequest, state: StateDep) -> TokenizeResponse:
    if body.model is not None:
        check_model(state, body.model)
    if body.prompt is not None:
        ids = await tokenize(state, body.prompt)
    else:
        chat = ChatCompletionRequest(
            model=state.model_name,
            messages=body.messages,
            tools=body.tools,
            tool_choice=body.tool_choice,
            add_generation_prompt=body.add_generation_prompt,
        )
        ids = (await chat_prompt(state, chat)).prompt_ids
    # each token's text as the completions route's logprobs spell it (special tokens too)
    strs = None
    if body.return_token_strs:
        texts = TokenTexts(state.engine)
        strs = [texts(t) for t in ids]
    return TokenizeResponse(
        count=len(ids), max_model_len=state.max_model_len, tokens=ids, token_strs=strs
    )


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize_route(body: DetokenizeRequest, state: StateDep) -> DetokenizeResponse:
    if body.model is not None:
        check_model(state, body.model)
    vocab = state.vocab_size
    for i, tid in enumerate(body.tokens):
        if tid < 0 or (vocab is not None and tid >= vocab):
            raise APIError(
                400, f"tokens[{i}] = {tid} is outside the vocabulary [0, {vocab})", param="tokens"
            )
    # special tokens spelled, as an echoed token-id prompt is: /tokenize of the text gives
    # the ids back (the engine's detokenize drops them)
    text = await anyio.to_thread.run_sync(spelled_text, state.engine, body.tokens)
    return DetokenizeResponse(prompt=text)


@router.get("/tokenizer_info", response_model=TokenizerInfo)
async def tokenizer_info(state: StateDep) -> TokenizerInfo:
    special = state.special_tokens
    return TokenizerInfo(
        model=state.model_name,
        eos_token=special.get("eos_token") or None,
        bos_token=special.get("bos_token") or None,
        pad_token=special.get("pad_token") or None,
        chat_template=state.chat_template,
        model_max_length=state.max_model_len,
        vocab_size=state.vocab_size,
    )
