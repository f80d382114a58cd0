"""Constrained decoding: constraints become llguidance grammars, compiled once per schema and
tokenizer, and each constrained sequence owns a matcher that gives its next-token mask.

Why llguidance (0.2.8 xgrammar and outlines-core 0.2.14 were measured beside it on
SmolLM2's tokenizer; `benchmarks/README.md`, section "Constrained decoding"):

- it refuses what it does not implement (`not`, `if`/`then`, `uniqueItems`, `contains`,
  ...) with the keywords named, so an unsupported schema is a clear 400 instead of a grammar
  that silently accepts values the schema forbids (xgrammar accepted all of these);
- a schema compiles in about a millisecond and a mask costs tens of microseconds with no
  precomputation (outlines-core builds a token automaton per schema: up to 8 s for one with
  `patternProperties`, and masks of over a millisecond inside free strings);
- a matcher's `deep_copy` takes about a microsecond, which makes a fork's grammar state and
  the cache of compiled grammars (a pristine matcher per schema, copied per request) cheap;
- the wheel needs nothing else (xgrammar pulls in torch, triton and transformers).

This module imports no torch: the manager and the server check constraints with `check`
(no tokenizer needed) before any engine work.
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections import OrderedDict
from functools import lru_cache
from typing import Any

import llguidance

from parrot_backend.contract.errors import InvalidRequest
from parrot_backend.contract.sampling import Constraint

# Generated JSON is spelled the way `json.dumps` (and most training data) spells it, with
# no other whitespace: a grammar with free whitespace lets a weak model pad forever.
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[([^\]]*)\]")


class GrammarError(InvalidRequest):
    """The grammar library refuses the constraint (an unsupported JSON-schema keyword, a
    malformed regex), or a matcher failed while generating."""


_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_COMBINATORS = ("allOf", "anyOf", "oneOf")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else")


def closed(schema: Any) -> Any:
    """`schema` with every object that lists `properties` and says nothing about others
    closed to others (`additionalProperties: false`), as OpenAI's strict mode and
    xgrammar's strict mode do: a model that may add keys adds them (SmolLM2 copies the
    schema's own keywords into its arguments), and a consumer never wants them. Write
    `additionalProperties: true` to allow them. An object whose properties are combined
    with `allOf`/`anyOf`/`oneOf` branches is left open, branches included: closing one
    part would forbid the properties of the others."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    combined = "properties" in out and any(k in out for k in _COMBINATORS)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed(v) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list) and not (combined and key in _COMBINATORS):
            out[key] = [closed(v) for v in out[key]]
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    if (
        "properties" in out
        and not combined
        and "additionalProperties" not in out
        and "unevaluatedProperties" not in out
        and "patternProperties" not in out
    ):
        out["additionalProperties"] = False
    return out


class _NotFinite(ValueError):
    pass


def _no_constant(name: str) -> float:
    """NaN and Infinity (which Python's json reads and writes, JSON does not have): a
    schema with one would compile to something else (`{"const": NaN}` became `null`)."""
    raise _NotFinite(name)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400
        raise _NotFinite(text)
    return value


def grammar_source(constraint: Constraint) -> str:
    """The llguidance grammar (its serialized form) for a constraint; GrammarError when the
    spec is not even well-formed (the grammar itself is checked by `check`)."""
    kind, spec = constraint.kind, constraint.spec
    if kind == "json_schema":
        try:
            schema = json.loads(spec, parse_constant=_no_constant, parse_float=_finite)
        except _NotFinite as exc:
            raise GrammarError(f"json_schema has a number that is not finite: {exc}") from None
        except ValueError as exc:
            raise GrammarError(f"json_schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("json_schema must be a JSON object (or true)")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(
                closed(schema), defaults=JSON_OPTIONS
            )
        except ValueError as exc:
            raise GrammarError(f"json_schema: {exc}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        # Lark string literals take JSON's escapes, so any string is spelled exactly
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
    if kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(spec)
    raise GrammarError(f"unknown constraint kind {kind!r}")


def _readable(kind: str, message: str) -> str:
    """llguidance's message, with unsupported JSON-schema keywords named plainly."""
    found = _UNIMPLEMENTED.search(message)
    if found:
        keys = [k.strip().strip('"') for k in found.group(1).split(",") if k.strip()]
        return f"json_schema uses keywords the grammar engine does not support: {', '.join(keys)}"
    # one line (it goes into JSON error bodies); regex errors span several
    text = " ".join(line.strip() for line in message.splitlines() if line.strip())
    text = text[:500] or "invalid grammar"
    return text if text.startswith(kind) else f"{kind}: {text}"


def _matcher_error(message: str) -> str:
    """llguidance's matcher error without the parser state it appends (hundreds of lines
    of internal rows and token dumps, no use to a client)."""
    return message.split("<state>", 1)[0].strip() or "invalid grammar"


class _ByteVocabulary:
    """A tokenizer of 256 single-byte tokens and an end token, for `_admits_nothing`: it
    spells every string, so a grammar whose first mask under it is empty admits no
    value under any tokenizer."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<end>"]
    special_token_ids = [256]

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode("utf-8"))


@lru_cache(maxsize=1)
def _byte_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocabulary()), slices=[])


def _admits_nothing(kind: str, source: str) -> str:
    """The problem of a grammar that compiles but admits no value at all (a regex such
    as `[^\\s\\S]`, a schema that is only a `$ref` to itself): its first mask, over bytes,
    is empty, and the engine would fail the call at its first token. Lark grammars may
    name the model's special tokens, which bytes lack: not checked here."""
    if kind == "lark":
        return ""
    matcher = llguidance.LLMatcher(_byte_tokenizer(), source, log_level=0)
    if not matcher.is_error():
        matcher.compute_bitmask()
    if not matcher.is_error():
        return ""
    error = _matcher_error(matcher.get_error())
    if error.startswith("NoExtensionBias"):
        return f"{kind}: the constraint admits no value at all"
    return _readable(kind, error)


@lru_cache(maxsize=1024)
def _problem(kind: str, spec: str | tuple[str, ...]) -> str:
    try:
        source = grammar_source(Constraint(kind, spec))
        message = llguidance.LLMatcher.validate_grammar(source, None)
        if not message:
            return _admits_nothing(kind, source)
    except GrammarError as exc:
        return str(exc)
    except BaseException as exc:  # a panic in the native library is a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        return f"{kind}: the grammar engine cannot compile it ({type(exc).__name__}: {exc})"
    return _readable(kind, message)


def check(constraint: Constraint) -> None:
    """Raise GrammarError (an InvalidRequest) unless the grammar library accepts the
    constraint; needs no tokenizer, so a manager or server node checks before sending."""
    constraint.validate()
    problem = _problem(constraint.kind, constraint.spec)
    if problem:
        raise GrammarError(problem)


class GrammarState:
    """One sequence's position in its grammar; a fork gets a copy (`fork`).

    `end` is the context length this state describes: the state is only continued by a
    generation on a context of exactly that length (no fill came in between)."""

    __slots__ = ("key", "matcher", "end")

    def __init__(self, key: tuple, matcher: llguidance.LLMatcher, end: int) -> None:
        self.key = key
        self.matcher = matcher
        self.end = end

    def fork(self) -> GrammarState:
        """An independent copy, for a context forked from this one."""
        return GrammarState(self.key, self.matcher.deep_copy(), self.end)

    def fill_mask(self, pointer: int, nbytes: int) -> None:
        """Write the next-token bitmask (one bit per token id, 32 per int32) at `pointer`;
        GrammarError if the matcher is in an error state (a grammar too complex to step)."""
        self.matcher.unsafe_compute_mask_ptr(pointer, nbytes)
        if self.matcher.is_error():
            error = _matcher_error(self.matcher.get_error())
            raise GrammarError(f"constrained decoding failed: {error}")

    def fill_masks_ahead(self, draft: list[int], pointer: int, nbytes: int) -> None:
        """The next-token bitmask at `pointer`, then one after each token of `draft` at
        `pointer + (i + 1) * nbytes`: the masks of a row with draft tokens. The state is
        rolled back to where it was; `draft` must fit the grammar (`valid_prefix`)."""
        consumed = 0
        try:
            for i, token in enumerate(draft):
                self.fill_mask(pointer + i * nbytes, nbytes)
                self.consume(token)
                consumed += 1
            self.fill_mask(pointer + len(draft) * nbytes, nbytes)
        finally:
            if consumed:
                self.matcher.rollback(consumed)

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, from the first, the grammar allows from here."""
        return self.matcher.validate_tokens(tokens) if tokens else 0

    def forced(self, k: int) -> list[int]:
        """Up to `k` tokens the grammar forces from here (a JSON key, its quotes and colon):
        the only tokens it allows, whatever the model would pick."""
        return self.matcher.compute_ff_tokens()[:k] if k > 0 else []

    def consume(self, token_id: int) -> None:
        """Advance past a sampled token; GrammarError if the grammar does not allow it."""
        if not self.matcher.consume_token(token_id):
            raise GrammarError(
                f"token {token_id} does not fit the constraint: {self.matcher.get_error()}"
            )

    @property
    def accepting(self) -> bool:
        """Whether the text so far is complete (the generation may end here)."""
        return self.matcher.is_accepting()

    @property
    def stopped(self) -> bool:
        """Whether the grammar allows nothing more (the generation ends here)."""
        return self.matcher.is_stopped()


class GrammarCompiler:
    """Compiles constraints for one tokenizer; compiled grammars are kept by their spec (a
    pristine matcher each, copied for every request: `start`)."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_ids: frozenset[int], *, max_cached: int = 256
    ) -> None:
        from llguidance.hf import from_tokenizer

        eos = sorted(eos_ids)
        self.vocab_size = vocab_size
        self.tokenizer = from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos or None)
        self.max_cached = max_cached
        self.hits = 0
        self.misses = 0
        self._cache: OrderedDict[tuple, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # compiles may run on worker threads

    def compile(self, constraint: Constraint) -> llguidance.LLMatcher:
        """The pristine matcher of a constraint (cached); GrammarError if refused."""
        key = constraint.key
        with self._lock:
            matcher = self._cache.get(key)
            if matcher is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return matcher
        check(constraint)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar_source(constraint), log_level=0)
        if matcher.is_error():
            raise GrammarError(_readable(constraint.kind, _matcher_error(matcher.get_error())))
        with self._lock:
            self.misses += 1
            self._cache[key] = matcher
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return matcher

    def is_cached(self, constraint: Constraint) -> bool:
        with self._lock:
            return constraint.key in self._cache

    def start(self, constraint: Constraint, end: int) -> GrammarState:
        """A fresh state at the grammar's start, for a context of length `end`."""
        return GrammarState(constraint.key, self.compile(constraint).deep_copy(), end)
