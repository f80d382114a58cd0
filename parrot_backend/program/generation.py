"""Per-output generation settings: a program's JSON form of the contract's `SamplingParams`.

A `GenerationConfig` takes its defaults from `SamplingParams` and converts to one
(`to_sampling`); it adds what a program needs on top: strict JSON validation, the limits a
model imposes, and types.

An output may be **typed**: `json_schema`, `regex` or `choice` constrains its generation
(the engine masks every token that would leave the grammar), so its value always matches;
a generation that reaches `max_tokens` before the value is complete fails the call rather
than setting a partial value. The value is still text: a downstream call receives the JSON,
the matched string or the chosen string as it was generated.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from parrot_backend.contract.errors import InvalidRequest
from parrot_backend.contract.sampling import (
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_PENALTY,
    Constraint,
    SamplingParams,
)

_PLAIN = SamplingParams()  # the engine's defaults are the program's defaults
NonEmpty = Annotated[str, Field(min_length=1)]
ValueType = Literal["text", "json_schema", "regex", "choice"]
_TYPED = ("json_schema", "regex", "choice")
_PENALTIES = ("presence_penalty", "frequency_penalty")


class GenerationConfig(BaseModel):
    """How one output variable is generated. `temperature == 0` is greedy decoding.

    Strict: `"5"` or `true` are not integers here, NaN and infinities are rejected, and
    unknown fields are errors, so a typo in a request never silently falls back to a default.
    """

    # frozen: one config is shared by every call of a workflow and by the manager's caches
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)

    max_tokens: int = Field(_PLAIN.max_tokens, ge=1)
    temperature: float = Field(_PLAIN.temperature, ge=0.0)
    top_p: float = Field(_PLAIN.top_p, gt=0.0, le=1.0)
    top_k: int = Field(_PLAIN.top_k, ge=0, description="0 disables top-k")
    seed: int | None = Field(_PLAIN.seed, ge=0, lt=2**63)
    stop: list[NonEmpty] = Field(default_factory=list)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    presence_penalty: float = Field(
        _PLAIN.presence_penalty,
        ge=-MAX_PENALTY,
        le=MAX_PENALTY,
        description="lowers the logit of every token already generated in this value, once",
    )
    frequency_penalty: float = Field(
        _PLAIN.frequency_penalty,
        ge=-MAX_PENALTY,
        le=MAX_PENALTY,
        description="lowers a token's logit by this much per time it was generated",
    )
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] = Field(
        default_factory=dict,
        max_length=MAX_LOGIT_BIAS_TOKENS,
        description='OpenAI\'s logit_bias: {"token id": bias in [-100, 100]}, added to those '
        "tokens' logits before the pick (-100 bans a token, 100 all but forces it)",
    )
    ignore_eos: bool = Field(
        _PLAIN.ignore_eos,
        description="generate past the end-of-sequence token, to max_tokens or a stop "
        "(benchmarks that need equal lengths; the OpenAI routes' extension of the same name)",
    )
    json_schema: dict[str, Any] | None = Field(
        None, description="the value is JSON matching this schema (`{}`: any JSON value)"
    )
    regex: NonEmpty | None = Field(
        None, description="the whole value matches this regular expression (Rust syntax)"
    )
    choice: list[NonEmpty] | None = Field(
        None, min_length=1, description="the value is one of these strings"
    )

    @model_validator(mode="after")
    def _check_logit_bias(self) -> GenerationConfig:
        self.bias_pairs()  # keys that are not token ids, or one id twice, are errors
        return self

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """`logit_bias` as `SamplingParams.logit_bias` pairs (ValueError for a key that is
        not a token id, or an id given twice)."""
        pairs: dict[int, float] = {}
        for key, bias in self.logit_bias.items():
            text = key.strip()
            if not text.isascii() or not text.isdigit():
                raise ValueError(
                    f"logit_bias keys are token ids (non-negative integers), got {key[:40]!r}"
                )
            tid = int(text)
            if tid in pairs:
                raise ValueError(f"logit_bias names token id {tid} twice")
            pairs[tid] = float(bias)
        return tuple(pairs.items())

    @model_validator(mode="after")
    def _check_type(self) -> GenerationConfig:
        """At most one type; no stop strings with it; a grammar the engine can compile."""
        given = [name for name in _TYPED if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(
                f"an output has at most one of json_schema, regex and choice; "
                f"got {' and '.join(given)}"
            )
        if given and self.stop:
            raise ValueError(
                f"stop cannot be combined with {given[0]}: the grammar decides where the value ends"
            )
        if given and self.ignore_eos:
            raise ValueError(
                f"ignore_eos cannot be combined with {given[0]}: the grammar decides where "
                "the value ends"
            )
        constraint = self.constraint()
        if constraint is not None:
            # the grammar library (llguidance, no torch) is loaded only for typed outputs
            from parrot_backend.engine.grammar import check

            try:
                check(constraint)
            except InvalidRequest as exc:
                raise ValueError(str(exc)) from None
        return self

    @model_serializer(mode="wrap")
    def _omit_untyped(self, handler: Any) -> dict[str, Any]:
        # a text output's JSON stays what it was before outputs had types and penalties
        # (stored programs, workflow comparisons and replays see no new keys)
        data = handler(self)
        for name in _TYPED:
            if data.get(name, 0) is None:
                del data[name]
        for name in _PENALTIES:
            if data.get(name) == 0:
                del data[name]
        if data.get("ignore_eos") is False:
            del data["ignore_eos"]
        if data.get("logit_bias") == {}:
            del data["logit_bias"]
        return data

    @property
    def value_type(self) -> ValueType:
        """What the value is: free `text`, or the kind of its constraint."""
        for name in _TYPED:
            if getattr(self, name) is not None:
                return name  # type: ignore[return-value]
        return "text"

    def constraint(self) -> Constraint | None:
        """The engine constraint of a typed output (None for text). A typed value must be
        complete: the engine fails the generation instead of ending it at max_tokens."""
        if self.json_schema is not None:
            spec = json.dumps(self.json_schema, ensure_ascii=False)  # keeps the key order
            return Constraint("json_schema", spec, require_complete=True)
        if self.regex is not None:
            return Constraint("regex", self.regex, require_complete=True)
        if self.choice is not None:
            return Constraint("choice", tuple(self.choice), require_complete=True)
        return None

    def limit_problems(self, vocab_size: int | None, max_model_len: int | None) -> list[str]:
        """What does not fit a model with this vocabulary and context (none: fits)."""
        out = []
        if max_model_len is not None and self.max_tokens > max_model_len:
            out.append(
                f"max_tokens {self.max_tokens} exceeds the model's context of "
                f"{max_model_len} tokens"
            )
        if vocab_size is not None:
            if self.top_k > vocab_size:
                out.append(f"top_k {self.top_k} exceeds the vocabulary size {vocab_size}")
            bad = [t for t in self.stop_token_ids if t >= vocab_size]
            if bad:
                out.append(
                    f"stop_token_ids {bad[:5]} are outside the vocabulary (0..{vocab_size - 1})"
                )
            bad = [t for t, _ in self.bias_pairs() if t >= vocab_size]
            if bad:
                out.append(
                    f"logit_bias token ids {bad[:5]} are outside the vocabulary "
                    f"(0..{vocab_size - 1})"
                )
        return out

    def to_sampling(self) -> SamplingParams:
        """The engine's sampling parameters for this output."""
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=list(self.stop),
            stop_token_ids=list(self.stop_token_ids),
            constraint=self.constraint(),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            ignore_eos=self.ignore_eos,
            logit_bias=self.bias_pairs(),
        )
