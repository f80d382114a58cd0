"""How a generation is asked for and read back, per kind of upstream.

Two request shapes cover the servers:

- **llama.cpp** (`POST /completion`, its native route): the prompt as token ids,
  `n_predict`, `return_tokens` so every streamed chunk carries the ids of its tokens
  (`{"content", "tokens", "stop"}`); the last chunk has `stop: true` and `stop_type`
  (`eos`, `word`, `limit`) and the prompt's `timings` (`cache_n`: tokens reused from the
  slot's cache). The sampler chain is pinned to what `SamplingParams` means: `min_p`,
  the repeat penalty, DRY, XTC and typical sampling off (llama.cpp's defaults turn some
  on); presence and frequency penalties are passed on, over llama.cpp's window (the whole
  context with `repeat_last_n: -1`, prompt included, where OpenAI counts generated
  tokens only); `logit_bias` as llama.cpp's `[[id, bias], ...]`.
  Constraints: `json_schema`, and `choice` as a GBNF grammar. Log probabilities
  (`SamplingParams.logprobs`) are asked as `n_probs` with `post_sampling_probs` off, so
  llama.cpp reports the softmax of the raw logits, as our engine does; each chunk's
  `completion_probabilities` entries carry the token ids (`id`, `logprob`, `top_logprobs`).
- **OpenAI completions** (`POST /v1/completions`: vLLM, SGLang, parrot-backend, any other):
  the prompt as token ids (every one of these accepts a list of ints), `max_tokens`,
  streamed with usage, `logit_bias` as OpenAI's `{"id": bias}`. vLLM also gets
  `return_token_ids` (each chunk's `token_ids`) and the salt as `cache_salt`; other
  servers' chunks carry text only, and the adapter re-tokenizes the text into the context
  when the generation ends. Constraints:
  `json_schema` as `response_format`. No log probabilities: these servers key their
  alternatives by text, not by id (the engine refuses them).

A `Chunk` is what one streamed event adds: `(token id or None, text)` pairs, the finish
reason once it is known, and prompt-cache usage when the server reports it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from parrot_backend.contract.errors import InvalidRequest
from parrot_backend.contract.sampling import SamplingParams

LLAMA_CPP = "llama.cpp"
KINDS = (LLAMA_CPP, "vllm", "sglang", "parrot", "openai")


@dataclass(slots=True)
class Chunk:
    """What one streamed event of a generation adds."""

    pieces: list[tuple[int | None, str]] = field(default_factory=list)
    finish: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    # with logprobs asked (llama.cpp): per piece with a token id, in order, its logprob
    # and top alternatives as (token id, logprob)
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


def request(
    kind: str,
    model: str,
    prompt: list[int],
    sampling: SamplingParams,
    max_new: int,
    salt: str | None,
    *,
    stream: bool = True,
) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of a generation request; the path is relative to the server's
    root for llama.cpp and to its `/v1` base otherwise."""
    if kind == LLAMA_CPP:
        return "/completion", _llama_body(prompt, sampling, max_new, stream)
    return "/completions", _openai_body(kind, model, prompt, sampling, max_new, salt, stream)


def warm_request(
    kind: str, model: str, prompt: list[int], salt: str | None
) -> tuple[str, dict[str, Any]]:
    """The shortest request that makes the upstream compute and cache `prompt`'s KV."""
    greedy = SamplingParams(max_tokens=1)
    if kind == LLAMA_CPP:
        body = _llama_body(prompt, greedy, 0, stream=False)  # n_predict 0: prompt only
        return "/completion", body
    return "/completions", _openai_body(kind, model, prompt, greedy, 1, salt, stream=False)


def _llama_body(prompt: list[int], s: SamplingParams, max_new: int, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": prompt,
        "n_predict": max_new,
        "stream": stream,
        "return_tokens": True,
        "cache_prompt": True,
        "temperature": s.temperature,
        "top_k": s.top_k,
        "top_p": s.top_p,
        "min_p": 0.0,
        "typical_p": 1.0,
        "repeat_penalty": 1.0,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "dry_multiplier": 0.0,
        "xtc_probability": 0.0,
        "dynatemp_range": 0.0,
        "ignore_eos": s.ignore_eos,
        "stop": list(s.stop),
    }
    if s.penalized:
        # llama.cpp counts the last n tokens of the context, prompt included; -1 is all of
        # it (OpenAI counts the generated tokens only: not the same logits)
        body["repeat_last_n"] = -1
    if s.seed is not None:
        body["seed"] = s.seed % (2**32)  # llama.cpp seeds are 32-bit
    if s.logit_bias:
        body["logit_bias"] = [[t, b] for t, b in s.logit_bias]  # llama.cpp's pairs
    if s.logprobs is not None:
        # the raw logits' softmax (not the sampler's); n_probs 0 would return none at all
        body["n_probs"] = max(s.logprobs, 1)
        body["post_sampling_probs"] = False
    c = s.constraint
    if c is not None:
        if c.kind == "json_schema":
            body["json_schema"] = json.loads(str(c.spec))
        elif c.kind == "choice":
            body["grammar"] = "root ::= " + " | ".join(json.dumps(x) for x in c.spec)
        else:
            raise InvalidRequest(
                f"a llama.cpp upstream cannot enforce a {c.kind} constraint "
                f"(json_schema and choice only)"
            )
    return body


def _openai_body(
    kind: str,
    model: str,
    prompt: list[int],
    s: SamplingParams,
    max_new: int,
    salt: str | None,
    stream: bool,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_new,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    if s.top_k:
        body["top_k"] = s.top_k
    if s.presence_penalty:
        body["presence_penalty"] = s.presence_penalty
    if s.frequency_penalty:
        body["frequency_penalty"] = s.frequency_penalty
    if s.seed is not None:
        body["seed"] = s.seed
    if s.logit_bias:
        body["logit_bias"] = {str(t): b for t, b in s.logit_bias}  # OpenAI's: ids as keys
    if s.stop:
        body["stop"] = list(s.stop)
    if s.ignore_eos:
        body["ignore_eos"] = True
    if s.stop_token_ids and kind in ("vllm", "sglang"):
        body["stop_token_ids"] = list(s.stop_token_ids)
    if kind == "vllm":
        body["return_token_ids"] = True
        if salt:
            body["cache_salt"] = salt
    c = s.constraint
    if c is not None:
        if c.kind != "json_schema":
            raise InvalidRequest(
                f"an OpenAI-compatible upstream cannot be asked for a "
                f"{c.kind} constraint (json_schema only)"
            )
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": json.loads(str(c.spec)), "strict": True},
        }
    return body


def read(kind: str, payload: dict[str, Any]) -> Chunk:
    """The `Chunk` of one streamed JSON payload (not `[DONE]`, not an error)."""
    if kind == LLAMA_CPP:
        return _read_llama(payload)
    return _read_openai(payload)


def _read_llama(p: dict[str, Any]) -> Chunk:
    chunk = Chunk()
    text = p.get("content") or ""
    ids = p.get("tokens") or []
    if ids:
        # several ids in one chunk: their text arrives with the last one
        chunk.pieces = [(int(t), "") for t in ids[:-1]] + [(int(ids[-1]), text)]
    elif text:
        chunk.pieces = [(None, text)]
    probs = p.get("completion_probabilities")
    if probs:
        chunk.logprobs = [_llama_logprob(e) for e in probs]
    if p.get("stop"):
        chunk.finish = "length" if p.get("stop_type") == "limit" else "stop"
        timings = p.get("timings") or {}
        if "prompt_n" in timings:
            chunk.cached_tokens = int(timings.get("cache_n") or 0)
            chunk.prompt_tokens = int(timings["prompt_n"]) + chunk.cached_tokens
    return chunk


def _llama_logprob(entry: Any) -> tuple[float, list[tuple[int, float]]]:
    """One `completion_probabilities` entry as (logprob, [(token id, logprob)])."""
    try:
        top = [(int(t["id"]), float(t["logprob"])) for t in entry.get("top_logprobs") or ()]
        return float(entry["logprob"]), top
    except (KeyError, TypeError, ValueError, AttributeError):
        raise InvalidRequest(
            "the llama.cpp upstream returned log probabilities without token ids and "
            "logprobs (a llama.cpp older than its `completion_probabilities` with ids?)"
        ) from None


def _read_openai(p: dict[str, Any]) -> Chunk:
    chunk = Chunk()
    usage = p.get("usage")
    if isinstance(usage, dict) and usage.get("prompt_tokens") is not None:
        chunk.prompt_tokens = int(usage["prompt_tokens"])
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            chunk.cached_tokens = int(details["cached_tokens"])
    for choice in p.get("choices") or []:
        if choice.get("index", 0) != 0:
            continue
        text = choice.get("text") or ""
        ids = choice.get("token_ids") or []
        if ids:
            chunk.pieces = [(int(t), "") for t in ids[:-1]] + [(int(ids[-1]), text)]
        elif text:
            chunk.pieces = [(None, text)]
        reason = choice.get("finish_reason")
        if reason is not None:
            # "abort" (vLLM dropped the request) is an error the engine raises
            chunk.finish = reason if reason in ("length", "abort") else "stop"
    return chunk
