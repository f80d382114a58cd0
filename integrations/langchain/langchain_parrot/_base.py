"""What ChatParrot and ParrotLLM share: connection settings, sampling fields, payloads."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from langchain_core.language_models import LangSmithParams
from langchain_core.utils import from_env, secret_from_env
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr

from ._http import AsyncTransport, Endpoint, SyncTransport

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_MODEL = "SmolLM2-135M-Instruct"

# Call-time keyword arguments that would break the request if sent as they are.
_RESERVED = frozenset({"stream", "stream_options", "messages", "prompt"})


def wire_bias(bias: dict[Any, float] | None) -> dict[str, float] | None:
    """A `logit_bias` as the server takes it: token ids as strings (None or empty: unset)."""
    return {str(k): v for k, v in bias.items()} if bias else None


class ParrotParams(BaseModel):
    """Connection and sampling settings of a parrot-backend model (a mixin)."""

    model_config = ConfigDict(populate_by_name=True, arbitrary_types_allowed=True)

    model: str = Field(default=DEFAULT_MODEL, alias="model_name")
    """The served model's id (`GET /v1/models`); the server answers 404 for another."""
    base_url: str = Field(default_factory=from_env("PARROT_BASE_URL", default=DEFAULT_BASE_URL))
    """Server root, e.g. `http://127.0.0.1:8000` (a trailing `/v1` is accepted too).
    Defaults to `$PARROT_BASE_URL`, then `http://127.0.0.1:8000`."""
    api_key: SecretStr | None = Field(
        default_factory=secret_from_env("PARROT_API_KEY", default=None)
    )
    """Bearer key; defaults to `$PARROT_API_KEY`. Not needed when the server runs without
    auth (the default on loopback)."""
    temperature: float | None = None
    """Sampling temperature, 0 for greedy; None leaves the server's default (1)."""
    max_tokens: int | None = None
    """Most tokens to generate."""
    top_p: float | None = None
    """Nucleus sampling; None leaves the server's default (1)."""
    seed: int | None = None
    """Sampling seed: the same seed and inputs give the same output."""
    frequency_penalty: float | None = None
    """Lowers a token's logit by this much per time it was already generated (-2 to 2)."""
    presence_penalty: float | None = None
    """Lowers the logit of every token already generated, once (-2 to 2)."""
    logit_bias: dict[int, float] | None = None
    """Added to these token ids' logits before each pick, -100 to 100 (OpenAI's
    `logit_bias`: -100 bans a token, 100 all but forces it)."""
    stop: list[str] | None = None
    """Stop sequences (not included in the output); a call's `stop` replaces them."""
    timeout: float | None = 600.0
    """Seconds to wait for the connection and for each read (between stream chunks);
    None waits forever."""
    max_retries: int = Field(default=2, ge=0)
    """Retries of 429/502/503/504 answers and of connections that failed before sending."""
    streaming: bool = False
    """Generate through the streaming route even for `invoke` (tokens reach callbacks)."""
    http_client: httpx.Client | None = Field(default=None, exclude=True)
    """An httpx.Client to send with (proxies, TLS, tests); one is made when None."""
    http_async_client: httpx.AsyncClient | None = Field(default=None, exclude=True)
    """An httpx.AsyncClient for the async methods; otherwise one per call (an AsyncClient
    is bound to the event loop that first used it)."""

    _client: httpx.Client | None = PrivateAttr(default=None)

    @property
    def _endpoint(self) -> Endpoint:
        key = self.api_key.get_secret_value() if self.api_key is not None else None
        return Endpoint(self.base_url, key, self.timeout, self.max_retries)

    def _transport(self) -> SyncTransport:
        client = self.http_client
        if client is None:
            if self._client is None:
                self._client = httpx.Client()
            client = self._client
        return SyncTransport(client, self._endpoint)

    @asynccontextmanager
    async def _atransport(self) -> AsyncIterator[AsyncTransport]:
        if self.http_async_client is not None:
            yield AsyncTransport(self.http_async_client, self._endpoint)
            return
        async with httpx.AsyncClient() as client:
            yield AsyncTransport(client, self._endpoint)

    @staticmethod
    def _set(fields: dict[str, Any]) -> dict[str, Any]:
        """The fields that are set (not None)."""
        return {k: v for k, v in fields.items() if v is not None}

    def _payload(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Request fields from the settings, then the call's `stop` and keyword arguments."""
        payload: dict[str, Any] = {
            "model": self.model,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "top_p": self.top_p,
            "seed": self.seed,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "logit_bias": wire_bias(self.logit_bias),
        }
        stops = stop if stop is not None else self.stop
        if stops:
            # one string is one stop sequence (as the OpenAI API takes it), not its letters
            payload["stop"] = [stops] if isinstance(stops, str) else list(stops)
        payload.update((k, v) for k, v in kwargs.items() if k not in _RESERVED)
        return {k: v for k, v in payload.items() if v is not None}

    @property
    def _parrot_identifying_params(self) -> dict[str, Any]:
        # Everything that changes what the server generates (timeouts and retries do not).
        return {
            "model": self.model,
            "base_url": self.base_url,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "top_p": self.top_p,
            "seed": self.seed,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "logit_bias": self.logit_bias,
            "stop": self.stop,
        }

    def _fill_ls_params(
        self, params: LangSmithParams, stop: list[str] | None, kwargs: dict[str, Any]
    ) -> LangSmithParams:
        params["ls_provider"] = "parrot"
        model = kwargs.get("model")
        params["ls_model_name"] = model if isinstance(model, str) else self.model
        temperature = kwargs.get("temperature", self.temperature)
        if temperature is not None:
            params["ls_temperature"] = temperature
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        if max_tokens is not None:
            params["ls_max_tokens"] = max_tokens
        stops = stop if stop is not None else self.stop
        if stops:
            params["ls_stop"] = [stops] if isinstance(stops, str) else list(stops)
        return params


def usage_dict(usage: Any) -> dict[str, int]:
    """The server's usage as the OpenAI-style `token_usage` of `llm_output`."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }
