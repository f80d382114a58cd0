"""Sampling parameters: the one definition of how an engine picks tokens.

Frozen: a manager shares one `SamplingParams` among every call made from the same
generation config, and engines keep the one they are given for the whole generation.

Also the engine API's JSON for them (`wire.GenerateRequest.sampling`): pydantic validates
these dataclasses directly, with integers strict (`"5"` is not 5) and unknown fields
refused; the values themselves are checked by `validate`, where the engine knows its
vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from pydantic import ConfigDict, StrictInt

from .errors import InvalidRequest

MAX_TOP_K = 1_000_000
MAX_PENALTY = 2.0  # OpenAI's range for presence_penalty and frequency_penalty
CONSTRAINT_KINDS = ("json_schema", "regex", "choice", "lark")
MAX_CONSTRAINT_CHARS = 1_000_000  # a grammar's source text; compiling more is a DoS vector
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's bound)
MAX_LOGIT_BIAS = 100.0  # |bias| per token (OpenAI's range)
MAX_LOGIT_BIAS_TOKENS = 1024  # entries per request


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a generation's text must match; the engine masks every other token.

    `kind` is one of `CONSTRAINT_KINDS`: `json_schema` (`spec`: the schema as JSON text,
    whose property order is the order generated), `regex` (`spec`: a Rust-regex pattern
    the whole text matches), `choice` (`spec`: a tuple of the allowed strings) or `lark`
    (`spec`: an llguidance Lark grammar, e.g. tool calls with inline `%json` schemas).

    `require_complete`: a generation that reaches `max_tokens` before the grammar accepts
    fails (`InvalidRequest`) instead of ending with a partial text ("length"); typed
    semantic variables use it so that a value that is set always matches.
    """

    kind: str
    spec: str | tuple[str, ...]
    require_complete: bool = False

    __pydantic_config__: ClassVar[ConfigDict] = ConfigDict(extra="forbid")

    @property
    def key(self) -> tuple[str, str | tuple[str, ...]]:
        """What the compiled grammar depends on (cache key; forks compare it)."""
        return self.kind, self.spec

    def validate(self) -> None:
        """Raise InvalidRequest when the constraint is malformed (not when the grammar
        library refuses it: that needs the library, see `engine.grammar.check`)."""
        if self.kind not in CONSTRAINT_KINDS:
            raise InvalidRequest(
                f"constraint kind must be one of {', '.join(CONSTRAINT_KINDS)}, got {self.kind!r}"
            )
        if not isinstance(self.require_complete, bool):
            raise InvalidRequest("constraint require_complete must be a boolean")
        if self.kind == "choice":
            if (
                not isinstance(self.spec, tuple)
                or not self.spec
                or not all(isinstance(c, str) and c for c in self.spec)
            ):
                raise InvalidRequest(
                    "a choice constraint needs a non-empty list of non-empty strings"
                )
            size = sum(len(c) for c in self.spec)
        else:
            if not isinstance(self.spec, str) or not self.spec:
                raise InvalidRequest(f"a {self.kind} constraint needs a non-empty string spec")
            size = len(self.spec)
        if size > MAX_CONSTRAINT_CHARS:
            raise InvalidRequest(
                f"the {self.kind} constraint is too large ({size} characters; "
                f"at most {MAX_CONSTRAINT_CHARS})"
            )


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens for one generation. `temperature == 0` means greedy, and so does
    any temperature below `GREEDY_BELOW` (dividing logits by it would overflow float32)."""

    GREEDY_BELOW: ClassVar[float] = 1e-5
    __pydantic_config__: ClassVar[ConfigDict] = ConfigDict(extra="forbid")

    max_tokens: StrictInt = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: StrictInt = 0  # 0 = disabled
    seed: StrictInt | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[StrictInt] = field(default_factory=list)
    ignore_eos: bool = False
    constraint: Constraint | None = None  # None: free text (the plain sampler path)
    # OpenAI's penalties, over the tokens this generation has produced so far (not the
    # prompt): a token's logit is lowered by frequency_penalty per time it was generated
    # and by presence_penalty once if it was; both 0 leave the plain sampler path.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # log probabilities: None (off), or the number of top alternatives (0..MAX_LOGPROBS)
    # returned with each generated token's own logprob (`TokenDelta.logprob`). They are
    # the model's log-softmax of the raw logits at that position: before penalties,
    # temperature, top-k/top-p and the grammar mask (OpenAI's and vLLM's default).
    logprobs: StrictInt | None = None
    # OpenAI's logit_bias as (token id, bias) pairs, ids distinct, bias in [-100, 100]: added
    # to those tokens' logits before penalties, temperature, top-k and top-p (greedy
    # included; after a grammar's mask, which it cannot lift). Logprobs stay the model's.
    logit_bias: tuple[tuple[StrictInt, float], ...] = ()

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidRequest naming the first bad field."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise InvalidRequest(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be >= 1, got {self.max_tokens}")
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
            raise InvalidRequest(f"temperature must be a finite number >= 0, got {t!r}")
        p = self.top_p
        if (
            not isinstance(p, (int, float))
            or isinstance(p, bool)
            or not math.isfinite(p)
            or not 0 < p <= 1
        ):
            raise InvalidRequest(f"top_p must be in (0, 1], got {p!r}")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise InvalidRequest(f"top_k must be an integer >= 0 (0 disables it), got {k!r}")
        limit = vocab_size if vocab_size is not None else MAX_TOP_K
        if k > limit:
            raise InvalidRequest(f"top_k must be <= {limit} (the vocabulary size), got {k}")
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not 0 <= self.seed < 2**63
        ):
            raise InvalidRequest(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequest("stop must be a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(i, int)
            and not isinstance(i, bool)
            and (vocab_size is None or 0 <= i < vocab_size)
            for i in self.stop_token_ids
        ):
            raise InvalidRequest("stop_token_ids must be a list of token ids inside the vocabulary")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if (
                not isinstance(v, (int, float))
                or isinstance(v, bool)
                or not math.isfinite(v)
                or not -MAX_PENALTY <= v <= MAX_PENALTY
            ):
                raise InvalidRequest(f"{name} must be in [-2, 2], got {v!r}")
        check_logprobs("logprobs", self.logprobs, vocab_size)
        self._check_logit_bias(vocab_size)
        if self.constraint is not None:
            if not isinstance(self.constraint, Constraint):
                raise InvalidRequest("constraint must be a Constraint")
            self.constraint.validate()
            # the grammar decides where the text ends: a stop string could cut a value short
            # of matching, and ignoring EOS would run past the grammar's end
            if self.stop:
                raise InvalidRequest(
                    "stop strings cannot be combined with a constraint "
                    "(the grammar decides where the text ends)"
                )
            if self.ignore_eos:
                raise InvalidRequest(
                    "ignore_eos cannot be combined with a constraint "
                    "(the grammar decides where the text ends)"
                )

    def _check_logit_bias(self, vocab_size: int | None) -> None:
        bias = self.logit_bias
        if not isinstance(bias, tuple) or len(bias) > MAX_LOGIT_BIAS_TOKENS:
            raise InvalidRequest(
                f"logit_bias must hold at most {MAX_LOGIT_BIAS_TOKENS} (token id, bias) pairs"
            )
        seen: set[int] = set()
        for pair in bias:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise InvalidRequest("logit_bias must be (token id, bias) pairs")
            tid, b = pair
            if (
                isinstance(tid, bool)
                or not isinstance(tid, int)
                or tid < 0
                or (vocab_size is not None and tid >= vocab_size)
            ):
                raise InvalidRequest(
                    f"logit_bias token id {tid!r} is outside the vocabulary"
                    + (f" [0, {vocab_size})" if vocab_size is not None else "")
                )
            if tid in seen:
                raise InvalidRequest(f"logit_bias names token id {tid} twice")
            seen.add(tid)
            if (
                not isinstance(b, (int, float))
                or isinstance(b, bool)
                or not math.isfinite(b)
                or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS
            ):
                raise InvalidRequest(f"logit_bias of token {tid} must be in [-100, 100], got {b!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < self.GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Whether the logits depend on the tokens generated so far."""
        return bool(self.presence_penalty or self.frequency_penalty)


def check_logprobs(name: str, k: object, vocab_size: int | None = None) -> None:
    """A number of top alternatives per token (`SamplingParams.logprobs`, `fill`'s
    `prompt_logprobs`): None or an integer in [0, MAX_LOGPROBS]; InvalidRequest naming
    `name` otherwise."""
    if k is not None and (
        isinstance(k, bool)
        or not isinstance(k, int)
        or not 0 <= k <= min(MAX_LOGPROBS, vocab_size or MAX_LOGPROBS)
    ):
        raise InvalidRequest(f"{name} must be null or an integer in [0, {MAX_LOGPROBS}], got {k!r}")
