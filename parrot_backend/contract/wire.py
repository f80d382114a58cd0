"""The engine API's HTTP format: what `server.engine_api` serves and `engines.remote` sends.

- Context ids are JSON integers or strings, kept as such (`1` and `"1"` differ).
- `sampling` is `SamplingParams` as JSON; its `constraint` (constrained decoding) is
  `{"kind", "spec", "require_complete"}`, `spec` a string (schema JSON, regex, Lark) or,
  for `choice`, a list of strings. The engine compiles it; a refused one is a 400.
- `POST /engine/generate` waits for the first token, so a bad request (unknown context,
  bad sampling, busy parent, no room) is an HTTP status like the other routes; then it
  streams **server-sent events**: one `data: {"token_id", "text", "finish_reason"}` frame
  per `TokenDelta`, the last one with `finish_reason` set (with `sampling.logprobs` set,
  a token's frame also has `"logprob"` and `"top_logprobs"`, a list of `[token_id,
  logprob]` pairs, most likely first); a failure after that point is an
  `event: error` frame with the error body below. Comment lines (`: ping`) keep idle
  streams alive.
- `POST /engine/fill` with `"prompt_logprobs": k` scores the tokens it appends
  (`EngineClient.fill`): its answer also has `"prompt_logprobs"`, per appended token
  `null` (the first) or `[logprob, [[token_id, logprob], ...]]`. Sent only when set (an
  engine from before it refuses the field), answered only when asked.
- Errors: `{"error": {"type": <engine error class>, "message": ...}}` with the statuses of
  `errors.HTTP_STATUS` (400 InvalidRequest, also malformed bodies; 404 ContextNotFound;
  409 ContextBusy; 507 OutOfMemory; 500 StepFailed), 503 RequestCancelled or EngineError
  (the engine is stopped or dead), 401 for a missing or wrong key.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Hashable
from dataclasses import fields
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from .engine import EngineStats, TokenDelta
from .errors import HTTP_STATUS, EngineError, EngineUnavailable, InvalidRequest
from .sampling import SamplingParams

HEALTH_PATH = "/healthz"  # the only route that answers without a key (for supervisors)

ContextId = StrictInt | StrictStr  # strict: "1" must not silently become 1 (or True 1)


# ---------------------------------------------------------------- requests and responses
class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a typo in a field name is an error


class FillRequest(_Body):
    context_id: ContextId
    parent_id: ContextId | None = None
    token_ids: list[StrictInt] = Field(min_length=0)
    salt: str | None = None
    priority: int = 0
    prompt_logprobs: StrictInt | None = None


class FillResponse(BaseModel):
    length: int = Field(description="the context's length in tokens after the fill")
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = Field(
        default=None, description="with prompt_logprobs asked: per appended token (`ScoredFill`)"
    )


class GenerateRequest(_Body):
    context_id: ContextId
    parent_id: ContextId | None = None
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    salt: str | None = None
    priority: int = 0


class FreeRequest(_Body):
    context_id: ContextId


class OkResponse(BaseModel):
    ok: bool = True


class ResetResponse(BaseModel):
    freed: int = Field(description="contexts released")
    left: int = Field(description="contexts still busy (a request in flight), kept")


class EngineInfo(BaseModel):
    """What a client needs to know about the engine before it sends anything."""

    model_name: str
    vocab_size: int
    max_model_len: int
    block_size: int
    chat_template: str | None = None
    special_tokens: dict[str, str] = Field(default_factory=dict)
    eos_token_ids: list[int] = Field(default_factory=list)
    tokenizer_fingerprint: str = Field(description="sha256 of the files /engine/tokenizer serves")


# the fields a client cannot do without (the rest have defaults)
INFO_REQUIRED = frozenset({"model_name", "vocab_size", "max_model_len", "block_size"})


class TokenizerFiles(BaseModel):
    """The engine's tokenizer as saved by transformers (`save_pretrained`): loading these
    files with `AutoTokenizer` gives the engine's exact tokenization."""

    fingerprint: str
    files: dict[str, str]


class ErrorDetail(BaseModel):
    type: str
    message: str


class ErrorResponse(BaseModel):
    error: ErrorDetail


_STAT_FIELDS = frozenset(f.name for f in fields(EngineStats))


def stats_from_json(data: dict[str, Any]) -> EngineStats:
    """The `EngineStats` of a `/engine/stats` answer; fields a newer engine adds land in
    `extra` instead of breaking the client."""
    known = {k: v for k, v in data.items() if k in _STAT_FIELDS}
    extra = dict(known.pop("extra", None) or {})
    extra.update({k: v for k, v in data.items() if k not in _STAT_FIELDS})
    return EngineStats(**known, extra=extra)


def check_context_id(value: Hashable | None, what: str) -> None:
    """Raise InvalidRequest unless `value` survives JSON unchanged (an int or a string; a
    tuple would come back a list). `parent_id` may be None."""
    if value is None and what == "parent_id":
        return
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InvalidRequest(f"{what} must be an int or a str over HTTP, got {value!r}")


# ---------------------------------------------------------------- errors, both ways
# error `type` names the engine API sends -> our classes
_BY_TYPE: dict[str, type[EngineError]] = {cls.__name__: cls for cls in HTTP_STATUS}
_BY_TYPE["EngineError"] = EngineUnavailable
# fallback when a body carries no type (a proxy's page, an older server); 503 is not here:
# it means the engine stopped, which the caller sees as unavailable
_BY_STATUS: dict[int, type[EngineError]] = {
    status: cls for cls, status in HTTP_STATUS.items() if status != 503
}
_BY_STATUS[422] = InvalidRequest


def error_payload(exc: EngineError) -> tuple[int, str]:
    """(HTTP status, type name) for an engine error; unknown subclasses count as the
    engine being unavailable (it is stopped or its loop died)."""
    for cls, status in HTTP_STATUS.items():
        if isinstance(exc, cls):
            return status, cls.__name__
    return 503, "EngineError"


def error_body(type_: str, message: str) -> dict[str, Any]:
    """The JSON body of an error answer (and of an `error` event)."""
    return ErrorResponse(error=ErrorDetail(type=type_, message=message)).model_dump()


def error_from_response(status: int, body: Any) -> EngineError:
    """The exception for an error answer of the engine API."""
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and isinstance(err.get("type"), str):
        message = str(err.get("message") or err["type"])
        cls = _BY_TYPE.get(err["type"])
        if cls is not None:
            return cls(message)
        if status in (401, 403):
            return EngineUnavailable(f"the engine refused our API key: {message}")
        return EngineError(f"engine answered {status}: {message}")
    if status in (401, 403):
        return EngineUnavailable(f"the engine refused our API key ({status})")
    if status >= 500 and status != 507:
        return EngineUnavailable(f"engine answered {status}")
    return _BY_STATUS.get(status, EngineError)(f"engine answered {status}")


# ---------------------------------------------------------------- server-sent events
def sse_frame(payload: dict[str, Any], event: str | None = None) -> bytes:
    """One server-sent event carrying `payload` as JSON."""
    # ASCII-only JSON: no raw U+2028, U+0085... that line splitters treat as line ends
    text = json.dumps(payload, ensure_ascii=True, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return (head + "data: " + text + "\n\n").encode("utf-8")


def delta_frame(delta: TokenDelta) -> bytes:
    """The event of one generated delta."""
    payload: dict[str, Any] = {
        "token_id": delta.token_id,
        "text": delta.text,
        "finish_reason": delta.finish_reason,
    }
    if delta.logprob is not None:
        payload["logprob"] = delta.logprob
        payload["top_logprobs"] = [[t, lp] for t, lp in delta.top_logprobs or ()]
    return sse_frame(payload)


def error_frame(exc: EngineError) -> bytes:
    """The `error` event that ends a stream that failed after its first token."""
    _, name = error_payload(exc)
    return sse_frame(error_body(name, str(exc)), "error")


def delta_from_json(payload: dict[str, Any]) -> TokenDelta:
    """The `TokenDelta` of a delta event's data."""
    delta = TokenDelta(payload["token_id"], payload["text"], payload.get("finish_reason"))
    if payload.get("logprob") is not None:
        delta.logprob = float(payload["logprob"])
        delta.top_logprobs = [(int(t), float(lp)) for t, lp in payload.get("top_logprobs") or ()]
    return delta


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[tuple[str, str]]:
    """(event name, data) per server-sent event; comment lines (pings) are skipped.

    Lines end at LF (CRLF tolerated) only: httpx's `aiter_lines` also splits at U+2028,
    U+0085 and friends, which may appear raw inside a JSON string of generated text."""
    buffer = b""
    event, data = "message", []
    async for chunk in chunks:
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for raw in lines:
            line = raw.removesuffix(b"\r").decode("utf-8", "replace")
            if not line:
                if data:
                    yield event, "\n".join(data)
                event, data = "message", []
            elif line.startswith(":"):
                continue
            else:
                name, _, value = line.partition(":")
                value = value[1:] if value.startswith(" ") else value
                if name == "event":
                    event = value
                elif name == "data":
                    data.append(value)
    if data:
        yield event, "\n".join(data)
