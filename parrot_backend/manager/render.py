"""Rendering a ready call into engine work, with segment-wise tokenization.

A call's tokens are the concatenation of each segment's tokens (text segments and
substituted values tokenized alone; see `prefix.py`), so a prefix ending at a segment
boundary has the same tokens in every call that shares it.

The plan of a call: fill the prompt (every segment before the first output), then for each
output in order: generate it, then fill the segments up to the next output. Segments after
the last output are never filled: nothing is generated after them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from parrot_backend.program import Call, GenerationConfig, InputRef, OutputRef, Text

Tokenize = Callable[[str], list[int]]


class TokenCache:
    """Tokenizes segments through one tokenizer, remembering recent ones (LRU).

    Template texts (system prompts, instructions) repeat across runs, and a value read by
    many calls is tokenized once.
    """

    def __init__(self, tokenize: Tokenize, size: int = 4096) -> None:
        self._tokenize = tokenize
        self._size = size
        self._cache: OrderedDict[str, list[int]] = OrderedDict()

    def __call__(self, text: str) -> list[int]:
        """Tokens of one segment (cached: do not mutate the result)."""
        hit = self._cache.get(text)
        if hit is not None:
            self._cache.move_to_end(text)
            return hit
        tokens = self._tokenize(text)
        self._cache[text] = tokens
        if len(self._cache) > self._size:
            self._cache.popitem(last=False)
        return tokens


@dataclass(slots=True)
class Step:
    """Generate `output` with `config`, then fill `then` (tokens up to the next output)."""

    output: str
    config: GenerationConfig
    then: list[int]


@dataclass(slots=True)
class CallPlan:
    """The engine work of one call: `prompt` tokens, then `steps` in order.

    `n_tokens` is the KV the call may need: prompt, fills and every output's max_tokens.
    """

    prompt: list[int]
    steps: list[Step]
    n_tokens: int


def plan_call(call: Call, values: Mapping[str, str], tokens: TokenCache) -> CallPlan:
    """The plan of `call` given the values of its inputs (all must be present)."""
    return plan_and_pieces(call, values, tokens)[0]


def plan_and_pieces(
    call: Call, values: Mapping[str, str], tokens: Tokenize
) -> tuple[CallPlan, list[list[int]]]:
    """`plan_call`, and the tokens of each segment before the first output (what
    `prefix.segment_tokens` gives for them): `prefix.call_prefixes(..., pieces=)` takes
    them, so each segment of a call is tokenized once. Do not mutate the pieces."""
    prompt: list[int] = []
    steps: list[Step] = []
    pieces: list[list[int]] = []
    current = prompt
    for seg in call.segments:
        if isinstance(seg, Text):
            piece = tokens(seg.text)
        elif isinstance(seg, InputRef):
            piece = tokens(values[seg.name])
        elif isinstance(seg, OutputRef):
            step = Step(seg.name, call.configs[seg.name], [])
            steps.append(step)
            current = step.then
            continue
        else:
            continue
        if not steps:
            pieces.append(piece)
        current.extend(piece)
    if steps:
        steps[-1].then = []  # nothing is generated after the last output
    n = len(prompt) + sum(len(s.then) + s.config.max_tokens for s in steps)
    return CallPlan(prompt, steps, n), pieces
