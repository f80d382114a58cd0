"""Rendering a ready call into engine work: its prompt tokenized as one text, and its
shareable prefixes.

**Tokens equal the plain path's.** A call's prompt (every segment before its first
output, with its input values substituted) is tokenized as one text, exactly as a
request-level client sending that text to `/v1/completions` would have it tokenized:
tokenizing segment by segment differs at some boundaries (BPE merges across them; with
SmolLM2, `"passage.\\n\\n"` alone ends in one newline token, inside a longer text in two),
and then a compiled chain would not generate what the plain chain generates. Template
text may spell special tokens (a chat template's `<|im_start|>`) and gets their ids; a
value never does: when a value holds a special-token spelling, the prompt is tokenized
in chunks cut at the template's special tokens, values as data (`tokenize(data=True)`),
so no value can close a chat role (and only then do the tokens differ from the plain
path, whose client would have sent that value as markup).

**Prefixes** end at semantic-variable boundaries (`prefix.prefix_boundaries`). The
tokens of the text before a boundary can depend on what follows it, but only in its
last pre-token (tokenizers split text into words before merging; a word can run on
into the next segment, as " parrots" does after "Summarize"). So the prefix at a
boundary is the tokens of the text up to the start of its last pre-token, which every
call with the same text there has, checked against the call's own tokens (a prefix that
is not the start of the prompt is not offered). Equal prefixes get equal keys
(`prefix.prefix_key` over the tokens), whatever template they come from.

The plan of a call: fill the prompt, then for each output in order: generate it, then
fill what the template has up to the next output (text tokenized alone, values as
data). Segments after the last output are never filled: nothing is generated after them.
A `CallPlan` and its `Step`s are read-only: the manager only reads them (`call_task.py`
slices the prompt and copies what it fills; `sharing.py` reads the prompt).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from parrot_backend.program import Call, GenerationConfig, InputRef, OutputRef, Text

from . import prefix as _prefix
from .prefix import Prefix

Tokenize = Callable[[str], Sequence[int]]
PreTokenize = Callable[[str], Sequence[tuple[str, tuple[int, int]]]]


class _Lru:
    """Strings -> token tuples, least recently used out first, bounded in entries and
    in characters held (prompts can be long). Tuples: immutable and shared, and once the
    garbage collector has seen one (ints only) it stops tracking it."""

    def __init__(self, size: int, chars: int) -> None:
        self._size, self._chars, self._held = size, chars, 0
        self._map: OrderedDict[str, tuple[int, ...]] = OrderedDict()

    def get(self, text: str) -> tuple[int, ...] | None:
        hit = self._map.get(text)
        if hit is not None:
            self._map.move_to_end(text)
        return hit

    def put(self, text: str, tokens: tuple[int, ...]) -> tuple[int, ...]:
        if len(text) <= self._chars:
            self._map[text] = tokens
            self._held += len(text)
            while len(self._map) > self._size or self._held > self._chars:
                old, _ = self._map.popitem(last=False)
                self._held -= len(old)
        return tokens


class PromptTokenizer:
    """Tokenizes prompts as whole texts, values as data, and finds stable prefix cuts.

    `tokenize(text)` tokenizes template text (special-token spellings get their ids);
    `tokenize_data(text)` tokenizes a value (they stay text; defaults to `tokenize` for
    tokenizers without special tokens). `pre_tokenize(text)` gives the tokenizer's
    pre-tokens with their character spans (a Hugging Face fast tokenizer's
    `backend_tokenizer.pre_tokenizer.pre_tokenize_str`); without it a prefix cut is made
    at the boundary itself and kept only where the call's tokens agree. `specials`: the
    tokenizer's special tokens by spelling. Results are cached (LRU).
    """

    def __init__(
        self,
        tokenize: Tokenize,
        *,
        tokenize_data: Tokenize | None = None,
        pre_tokenize: PreTokenize | None = None,
        specials: Mapping[str, int] | None = None,
        size: int = 4096,
        chars: int = 8_000_000,
    ) -> None:
        self._tokenize = tokenize
        self._tokenize_data = tokenize_data or tokenize
        self._pre = pre_tokenize
        self._specials = dict(specials or {})
        names = sorted(self._specials, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, names))) if names else None
        self._texts = _Lru(size, chars)
        self._data = _Lru(size, chars)
        self._cuts: OrderedDict[str, int] = OrderedDict()
        self._size = size

    @classmethod
    def for_engine(cls, engine: Any) -> PromptTokenizer:
        """The prompt tokenizer of an engine: its `tokenize` (with `data=` for values), and
        its Hugging Face tokenizer's pre-tokenizer and special tokens where it has them."""
        pre = None
        hf = getattr(engine, "tokenizer", None)
        backend = getattr(hf, "backend_tokenizer", None)
        pre_tokenizer = getattr(backend, "pre_tokenizer", None)
        if pre_tokenizer is not None and backend.normalizer is None:
            pre = pre_tokenizer.pre_tokenize_str  # spans index the text only unnormalized
        specials = getattr(engine, "special_token_ids", None) or {}
        return cls(
            engine.tokenize,
            tokenize_data=lambda text: engine.tokenize(text, data=True),
            pre_tokenize=pre,
            specials=specials,
        )

    def __call__(self, text: str) -> tuple[int, ...]:
        """Tokens of template text alone (cached)."""
        return self.text(text)

    def text(self, text: str) -> tuple[int, ...]:
        """Tokens of template text alone (cached)."""
        hit = self._texts.get(text)
        return hit if hit is not None else self._texts.put(text, tuple(self._tokenize(text)))

    def value(self, text: str) -> tuple[int, ...]:
        """Tokens of a value alone, as data (cached)."""
        hit = self._data.get(text)
        if hit is None:
            hit = self._data.put(text, tuple(self._tokenize_data(text)))
        return hit

    def prompt(self, pieces: Sequence[tuple[str, bool]]) -> tuple[int, ...]:
        """Tokens of the text of `pieces` ((text, is_value) in order) as one text."""
        special = self._special_re
        if special is None or not any(v and special.search(t) for t, v in pieces):
            return self.text("".join(t for t, _ in pieces))
        out: list[int] = []
        chunk: list[str] = []
        for text, is_value in pieces:
            if is_value:
                chunk.append(text)
                continue
            pos = 0
            for m in special.finditer(text):
                chunk.append(text[pos : m.start()])
                if joined := "".join(chunk):
                    out.extend(self.value(joined))
                chunk.clear()
                out.append(self._specials[m.group()])
                pos = m.end()
            chunk.append(text[pos:])
        if joined := "".join(chunk):
            out.extend(self.value(joined))
        return tuple(out)

    def stable_cut(self, text: str) -> int:
        """The longest prefix of `text` (in characters) whose tokens every text starting
        with `text` starts with: up to the start of its last pre-token (after its last
        special token, which nothing merges with)."""
        hit = self._cuts.get(text)
        if hit is not None:
            self._cuts.move_to_end(text)
            return hit
        start = 0
        if self._special_re is not None:
            for m in self._special_re.finditer(text):
                start = m.end()
        tail = text[start:]
        if not tail:
            cut = len(text)
        elif self._pre is None:
            cut = len(text)  # the caller keeps it only where the tokens agree
        else:
            cut = start + self._last_pre_token(tail)
        self._cuts[text] = cut
        if len(self._cuts) > self._size:
            self._cuts.popitem(last=False)
        return cut

    def _last_pre_token(self, tail: str) -> int:
        """Where the last pre-token of `tail` starts (0 when it has none). Pre-tokenizers
        split left to right and agree again after the first boundary, so a long text's
        last pre-token is found in its last `CUT_WINDOW` characters when they hold two or
        more: a call whose text runs to a unique value (a user's question after a ~1,000-
        token system prompt) pre-tokenized all of it, ~4 ms a call on SmolLM2 (a wrong cut
        would cost sharing only: the caller keeps a cut where the tokens agree)."""
        if len(tail) > 2 * CUT_WINDOW:
            spans = self._pre(tail[-CUT_WINDOW:])
            if len(spans) >= 2:
                return len(tail) - CUT_WINDOW + spans[-1][1][0]
        spans = self._pre(tail)
        return spans[-1][1][0] if spans else 0


# characters of a text's end that `PromptTokenizer.stable_cut` pre-tokenizes first
CUT_WINDOW = 256


@dataclass(frozen=True, slots=True)
class Step:
    """Generate `output` with `config`, then fill `then` (tokens up to the next output).

    Read-only (see the module doc)."""

    output: str
    config: GenerationConfig
    then: list[int]


@dataclass(frozen=True, slots=True)
class CallPlan:
    """The engine work of one call: `prompt` tokens, then `steps` in order.

    `n_tokens` is the KV the call may need: prompt, fills and every output's max_tokens.
    Read-only (see the module doc).
    """

    prompt: list[int]
    steps: list[Step]
    n_tokens: int


def prompt_pieces(call: Call, values: Mapping[str, str]) -> list[tuple[str, bool]]:
    """(text, is_value) of every segment before the call's first output."""
    pieces: list[tuple[str, bool]] = []
    for seg in call.segments:
        if isinstance(seg, Text):
            pieces.append((seg.text, False))
        elif isinstance(seg, InputRef):
            pieces.append((values[seg.name], True))
        else:
            break
    return pieces


def plan_call(call: Call, values: Mapping[str, str], tokens: PromptTokenizer) -> CallPlan:
    """The plan of `call` given the values of its inputs (all must be present)."""
    return render_call(call, values, tokens, "", None)[0]


def render_call(
    call: Call,
    values: Mapping[str, str],
    tokens: PromptTokenizer,
    model: str,
    salt: str | bytes | None,
) -> tuple[CallPlan, tuple[Prefix, ...]]:
    """The call's plan and its prefixes (shortest first, empty ones skipped) under
    `model` and `salt` (see the module doc). Raises KeyError for a missing value and
    ValueError for token ids outside [0, 2**32)."""
    segments = call.segments
    pieces = prompt_pieces(call, values)
    prompt = tokens.prompt(pieces)
    outputs: list[tuple[str, list[int]]] = []
    then: list[int] = []
    for seg in segments[len(pieces) :]:
        if isinstance(seg, OutputRef):
            then = []
            outputs.append((seg.name, then))
        elif isinstance(seg, Text):
            then.extend(tokens.text(seg.text))
        else:
            then.extend(tokens.value(values[seg.name]))
    if outputs:  # nothing is generated after the last output
        outputs[-1] = (outputs[-1][0], [])
    steps = [Step(name, call.configs[name], then) for name, then in outputs]
    n = len(prompt) + sum(len(s.then) + s.config.max_tokens for s in steps)
    plan = CallPlan(list(prompt), steps, n)
    return plan, _prefixes(segments, pieces, prompt, tokens, model, salt)


def _prefixes(
    segments: Sequence[Any],
    pieces: list[tuple[str, bool]],
    prompt: tuple[int, ...],
    tokens: PromptTokenizer,
    model: str,
    salt: str | bytes | None,
) -> tuple[Prefix, ...]:
    cuts = _prefix._boundaries(segments)
    if not cuts:
        return ()
    out: list[Prefix] = []
    h = _prefix._base(model, salt).copy()
    done = 0  # prompt tokens hashed so far
    last = len(pieces)
    # the last prefix found below the whole prompt: its stable cut (characters) and tokens.
    # A later cut's tokens are those plus the tokens of the text between the two cuts (a
    # stable cut is where a byte-level BPE's tokenization starts afresh), so each call
    # tokenizes its own text after the shared part, not its whole prompt a second time (64
    # calls after a 6,144-token system prompt: 0.5 s of the event loop). Where that
    # disagrees with the prompt, the head is tokenized whole, as before.
    at, upto = 0, ()
    for cut in cuts:
        if cut >= last:  # the whole prompt: nothing follows it but the generation
            n = len(prompt)
        else:
            text = "".join(t for t, _ in pieces[:cut])
            chars = tokens.stable_cut(text)
            if not chars:
                continue
            mine = None
            if at and chars > at:
                mine = upto + tokens.prompt(_between(pieces[:cut], at, chars))
                if prompt[: len(mine)] != mine:
                    mine = None  # a tokenizer that starts a text differently (Metaspace)
            if mine is None:
                mine = tokens.prompt(_truncate(pieces[:cut], chars))
            n = len(mine)
            if prompt[:n] != mine:  # the tokens run on into what follows: no prefix here
                continue
            at, upto = chars, mine
        if n <= done:
            continue
        h.update(_prefix._pack(prompt[done:n]))
        done = n
        out.append(Prefix(h.copy().hexdigest(), min(cut, last), n))
    return tuple(out)


def _between(pieces: Sequence[tuple[str, bool]], start: int, end: int) -> list[tuple[str, bool]]:
    """Characters `start:end` of the pieces' text, as pieces."""
    out = []
    pos = 0
    for text, is_value in pieces:
        lo, hi = max(start - pos, 0), min(end - pos, len(text))
        if lo < hi:
            out.append((text[lo:hi], is_value))
        pos += len(text)
    return out


def _truncate(pieces: Sequence[tuple[str, bool]], chars: int) -> list[tuple[str, bool]]:
    """The first `chars` characters of the pieces' text, as pieces."""
    out = []
    left = chars
    for text, is_value in pieces:
        if left <= 0:
            break
        out.append((text[:left], is_value))
        left -= len(text)
    return out
