"""Per-output generation settings: the JSON form of the engine's SamplingParams."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from parrot_backend.engine.sampling import SamplingParams

NonEmpty = Annotated[str, Field(min_length=1)]


class GenerationConfig(BaseModel):
    """How one output variable is generated. `temperature == 0` is greedy decoding.

    Strict: `"5"` or `true` are not integers here, NaN and infinities are rejected, and
    unknown fields are errors, so a typo in a request never silently falls back to a default.
    """

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    max_tokens: int = Field(128, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k")
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: list[NonEmpty] = Field(default_factory=list)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)

    def limit_problems(self, vocab_size: int | None, max_model_len: int | None) -> list[str]:
        """What does not fit a model with this vocabulary and context (none: fits)."""
        out = []
        if max_model_len is not None and self.max_tokens > max_model_len:
            out.append(f"max_tokens {self.max_tokens} exceeds the model's context of "
                       f"{max_model_len} tokens")
        if vocab_size is not None:
            if self.top_k > vocab_size:
                out.append(f"top_k {self.top_k} exceeds the vocabulary size {vocab_size}")
            bad = [t for t in self.stop_token_ids if t >= vocab_size]
            if bad:
                out.append(f"stop_token_ids {bad[:5]} are outside the vocabulary "
                           f"(0..{vocab_size - 1})")
        return out

    def to_sampling(self) -> SamplingParams:
        """The engine's sampling parameters for this output."""
        # imported here: the engine pulls in torch, and `program` must stay importable without it
        from parrot_backend.engine.sampling import SamplingParams

        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=list(self.stop),
            stop_token_ids=list(self.stop_token_ids),
        )
