"""Rendering a ready call into engine work, with segment-wise tokenization.

A call's tokens are the concatenation of each segment's tokens (text segments and
substituted values tokenized alone; see `prefix.py`), so a prefix ending at a segment
boundary has the same tokens in every call that shares it.

The plan of a call: fill the prompt (every segment before the first output), then for each
output in order: generate it, then fill the segments up to the next output. Segments after
the last output are never filled: nothing is generated after them.

`render_call` gives a ready call's plan and prefixes (`prefix.call_prefixes`) together,
compiling each template once (see its doc). A `CallPlan` and its `Step`s are read-only:
calls of one template may share their steps list, `Step` objects and `then` lists. The
manager only reads them (`execute.py` slices the prompt and copies what it fills;
`sharing.py` reads the prompt).
"""

from __future__ import annotations

import operator
import sys
import weakref
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from parrot_backend.program import Call, GenerationConfig, InputRef, OutputRef, Segment, Text

from . import prefix as _prefix
from .prefix import Prefix

Tokenize = Callable[[str], Sequence[int]]


class TokenCache:
    """Tokenizes segments through one tokenizer, remembering recent ones (LRU).

    Template texts (system prompts, instructions) repeat across runs, and a value read by
    many calls is tokenized once. Tokens are kept as tuples: immutable, and once the
    garbage collector has seen one (ints only) it stops tracking it, so a full cache is
    not walked by every collection as lists would be.
    """

    def __init__(self, tokenize: Tokenize, size: int = 4096) -> None:
        self._tokenize = tokenize
        self._size = size
        self._cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()

    def __call__(self, text: str) -> tuple[int, ...]:
        """Tokens of one segment (cached, shared)."""
        hit = self._cache.get(text)
        if hit is not None:
            self._cache.move_to_end(text)
            return hit
        tokens = tuple(self._tokenize(text))
        self._cache[text] = tokens
        if len(self._cache) > self._size:
            self._cache.popitem(last=False)
        return tokens


@dataclass(slots=True)
class Step:
    """Generate `output` with `config`, then fill `then` (tokens up to the next output).

    Read-only (see the module doc): `render_call` shares steps across calls."""

    output: str
    config: GenerationConfig
    then: list[int]


@dataclass(slots=True)
class CallPlan:
    """The engine work of one call: `prompt` tokens, then `steps` in order.

    `n_tokens` is the KV the call may need: prompt, fills and every output's max_tokens.
    Read-only (see the module doc): `render_call` shares `steps` across calls.
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


# --------------------------------------------------------------------------- render_call
# `array("I", ids)` holds the bytes `prefix._pack(ids)` packs ("<I" each) where an unsigned
# int is 4 little-endian bytes; it takes the same ids (ints in [0, 2**32)) and raises for
# the others, which then go the reference way (and get its ValueError). Elsewhere every
# call goes the reference way.
_ARRAY_PACKS = array("I").itemsize == 4 and sys.byteorder == "little"
_CACHE_SIZE = 4096
# id(segments) -> salt -> recipe (each holds its segments, so the id is not reused while
# cached; model and tokenizer are checked on use). At most _CACHE_SIZE recipes in all.
_RECIPES: dict[int, dict[str | bytes | None, _Recipe]] = {}
_N_RECIPES = 0
# id(segments) -> segments rendered once without a recipe: a recipe costs several renders
# to make, so it is made on a template's second call (one-off templates never pay for it)
_SEEN: dict[int, tuple[Segment, ...]] = {}
# Prefix is a named tuple: tuple.__new__ makes an equal one without its Python-level
# __new__ (Prefix has no defaults to miss).
_NEW_TUPLE = tuple.__new__


class _Recipe:
    """What `render_call` knows of one segments tuple, tokenizer (`ref`), model and salt.

    `head`: the leading text's tokens when the first boundary is after it (its hash state
    `h0` and prefix, from `prefix._leading`, the prefix in `out0` unless it is empty),
    else [], `h0` the base state and `out0` []. `chunks`: one per later boundary, in
    order: (boundary, text tokens before the input or None, their packed bytes, the
    input's name or None); each boundary ends after an input or at the first output, so
    a chunk is texts then at most one input. `tail`: text tokens after the last boundary
    (a template with no output). `outs`: output names in order; `thens[k]`: what follows
    output k up to the next one, a token list when it is all text, else a list of token
    lists and input names; `after`: inputs after the last output (looked up and
    tokenized, as `plan_and_pieces` does, though never filled). When every `then` is text
    (`static_post`), `steps` is the steps list last made, for the configs `configs` (by
    identity): calls with the same configs share it. `single`: the output's name when the
    template has one output and no input after it (the common case), else None.
    """

    __slots__ = (
        "segments",
        "ref",
        "model",
        "head",
        "h0",
        "out0",
        "n0",
        "chunks",
        "tail",
        "outs",
        "thens",
        "after",
        "static_post",
        "then_len",
        "single",
        "configs",
        "steps",
    )

    segments: tuple[Segment, ...]
    ref: weakref.ref[Any]
    model: str
    head: list[int]
    h0: Any
    out0: list[Prefix]
    n0: int
    chunks: tuple[tuple[int, list[int] | None, bytes | None, str | None], ...]
    tail: list[int]
    outs: tuple[str, ...]
    thens: tuple[Any, ...]
    after: tuple[str, ...]
    static_post: bool
    then_len: int
    single: str | None
    configs: tuple[GenerationConfig, ...] | None
    steps: list[Step]


def render_call(
    call: Call,
    values: Mapping[str, str],
    tokens: TokenCache,
    model: str,
    salt: str | bytes | None,
) -> tuple[CallPlan, tuple[Prefix, ...]]:
    """`plan_and_pieces(call, values, tokens)[0]` and the tuple of `prefix.call_prefixes(
    model, call.segments, values, tokens, salt, pieces)`: equal plans and prefixes, and the
    same exceptions for bad input (a missing value: KeyError; token ids outside
    [0, 2**32): ValueError), in one pass.

    Calls of one workflow share their segments tuple (`ingest.CallBuilder`), so each
    tuple is compiled once per tokenizer (weakly held), model and salt into a `_Recipe`:
    its text segments tokenized and packed ahead, its leading text's hash state and
    prefix (`prefix._leading`) kept. Per call only the input values are tokenized
    (through `tokens`), packed and hashed. Text tokens are taken to be the same on every
    call of a tokenizer, as `prefix._leading` takes them. The plan's `steps` (and their
    `Step`s and `then` lists) may be shared with other calls of the template: read-only,
    as every plan (see the module doc); the prompt is the call's own.

    Segments that are not a tuple, or a tokenizer that cannot be weakly referenced, take
    the two-function path; so does a call the compiled path raises on, so the exception
    is the one that path raises.
    """
    segments = call.segments
    try:
        by_salt = _RECIPES.get(id(segments))
        r = None if by_salt is None else by_salt.get(salt)
        if r is None or r.segments is not segments or r.ref() is not tokens or r.model != model:
            if _SEEN.get(id(segments)) is not segments:  # the first call: no recipe yet
                if len(_SEEN) >= _CACHE_SIZE:
                    _SEEN.clear()
                _SEEN[id(segments)] = segments
                r = None
            else:
                r = _compile(segments, tokens, model, salt)
        if r is not None:
            return _render(r, call, values, tokens)
    except Exception:  # the reference path below raises it again (or gives the result)
        pass
    # outside the handler: what it raises does not carry the compiled path's error along
    return _render_reference(call, values, tokens, model, salt)


def _render_reference(
    call: Call,
    values: Mapping[str, str],
    tokens: Tokenize,
    model: str,
    salt: str | bytes | None,
) -> tuple[CallPlan, tuple[Prefix, ...]]:
    """What `render_call` returns, the two-function way."""
    plan, pieces = plan_and_pieces(call, values, tokens)
    return plan, tuple(_prefix.call_prefixes(model, call.segments, values, tokens, salt, pieces))


def _compile(
    segments: tuple[Segment, ...], tokens: Tokenize, model: str, salt: str | bytes | None
) -> _Recipe | None:
    """The recipe of `segments` (cached), or None where the reference path must run.
    Raises what tokenizing, packing or hashing the texts raises (not cached)."""
    if type(segments) is not tuple or not _ARRAY_PACKS:
        return None
    try:
        ref = weakref.ref(tokens)  # a tokenizer id must not be reused while cached
    except TypeError:
        return None
    end = len(segments)
    for i, seg in enumerate(segments):
        if isinstance(seg, OutputRef):
            end = min(end, i)
        elif not isinstance(seg, (Text, InputRef)):
            return None  # not a segment `plan_and_pieces` knows: the reference path decides
    cuts = _prefix._boundaries(segments)
    r = _Recipe()
    r.segments = segments
    r.ref = ref
    r.model = model
    r.head = []
    r.h0 = None
    r.out0 = []
    done = 0
    if cuts and cuts[0] == 1 and isinstance(segments[0], Text):
        leading = _prefix._leading(segments, tokens, model, salt)
        if leading is None:
            return None
        r.h0, lead = leading
        r.out0 = [] if lead is None else [lead]
        r.head = list(tokens(segments[0].text))
        done = 1
    elif cuts:
        r.h0 = _prefix._base(model, salt)
    r.n0 = len(r.head)
    chunks = []
    for cut in cuts:
        if cut <= done:
            continue
        static: list[int] = []
        name = None
        for seg in segments[done:cut]:
            if name is not None:
                return None  # a chunk is texts then at most one input (see _Recipe)
            if isinstance(seg, Text):
                static.extend(tokens(seg.text))
            elif isinstance(seg, InputRef):
                name = seg.name
            else:
                return None
        if not static and name is None:
            return None  # cannot happen: boundaries increase
        chunks.append((cut, static or None, _prefix._pack(static) if static else None, name))
        done = cut
    r.chunks = tuple(chunks)
    tail: list[int] = []
    for seg in segments[done:end]:
        if not isinstance(seg, Text):
            return None  # an input past the last boundary: cannot happen
        tail.extend(tokens(seg.text))
    r.tail = tail
    outs: list[str] = []
    thens: list[list[Any]] = []
    for seg in segments[end:]:
        if isinstance(seg, OutputRef):
            outs.append(seg.name)
            thens.append([])
        elif isinstance(seg, Text):
            thens[-1].append(list(tokens(seg.text)))
        else:
            thens[-1].append(seg.name)
    r.outs = tuple(outs)
    r.after = tuple(x for x in thens[-1] if isinstance(x, str)) if thens else ()
    filled = thens[:-1]  # the last output's `then` is never filled
    r.static_post = not any(isinstance(x, str) for items in filled for x in items)
    if r.static_post:  # each `then` is one token list
        r.thens = tuple([t for x in items for t in x] for items in filled)
        r.then_len = sum(len(t) for t in r.thens)
    else:  # token lists and input names
        r.thens = tuple(filled)
        r.then_len = 0
    r.single = outs[0] if len(outs) == 1 and not r.after else None
    r.configs = None
    r.steps = []
    global _N_RECIPES
    if _N_RECIPES >= _CACHE_SIZE:
        _RECIPES.clear()
        _N_RECIPES = 0
    by_salt = _RECIPES.setdefault(id(segments), {})  # its recipes hold these segments
    if salt not in by_salt:
        _N_RECIPES += 1
    by_salt[salt] = r  # replaces one of another model or tokenizer
    return r


def _render(
    r: _Recipe, call: Call, values: Mapping[str, str], tokens: Tokenize
) -> tuple[CallPlan, tuple[Prefix, ...]]:
    """One call by its recipe. Raises where the reference path raises (and may raise
    where it does not, or differently: the caller then runs that path)."""
    prompt = r.head[:]
    out = r.out0[:]
    if r.chunks:
        h = r.h0.copy()
        last = r.n0
        for cut, static, packed, name in r.chunks:
            if static is not None:
                prompt += static
                h.update(packed)
            if name is not None:
                piece = tokens(values[name])
                prompt += piece
                h.update(array("I", piece))
            n = len(prompt)
            if n != last:  # empty prefixes skipped: n never falls, and starts at 0 or above
                out.append(_NEW_TUPLE(Prefix, (h.hexdigest(), cut, n)))  # see _NEW_TUPLE
                last = n
    if r.tail:
        prompt += r.tail
    single = r.single
    if single is not None:  # one output, nothing to look up after it
        config = call.configs[single]
        cached = r.configs
        if cached is not None and cached[0] is config:
            steps = r.steps
        else:
            steps = [Step(single, config, [])]
            r.configs, r.steps = (config,), steps
        return CallPlan(prompt, steps, len(prompt) + config.max_tokens), tuple(out)
    outs = r.outs
    configs = call.configs
    n_tokens = len(prompt)
    if not outs:
        steps = []
    elif r.static_post:
        cfgs = tuple([configs[o] for o in outs])
        cached = r.configs
        if cached is not None and all(map(operator.is_, cfgs, cached)):
            steps = r.steps
        else:
            steps = [Step(o, c, t) for o, c, t in zip(outs, cfgs, (*r.thens, []), strict=True)]
            r.configs, r.steps = cfgs, steps
        n_tokens += r.then_len + sum([c.max_tokens for c in cfgs])
    else:
        steps = []
        for o, items in zip(outs, r.thens, strict=False):
            then: list[int] = []
            for x in items:
                then += tokens(values[x]) if x.__class__ is str else x
            config = configs[o]
            steps.append(Step(o, config, then))
            n_tokens += len(then) + config.max_tokens
        config = configs[outs[-1]]
        steps.append(Step(outs[-1], config, []))
        n_tokens += config.max_tokens
    for name in r.after:
        tokens(values[name])
    return CallPlan(prompt, steps, n_tokens), tuple(out)
