"""`RemoteEngine`: the `EngineClient` contract over HTTP, for an engine in another process.

The server side is `parrot_backend.server.engine_api` (run by `parrot-backend engine`);
both speak `parrot_backend.contract.wire`. Everything the manager does with an
in-process `Engine` works the same here:

- `fill`, `free`, `stats` are one request each; `generate` is one streamed request (SSE).
  Closing the `generate` iterator early closes the HTTP stream, and the engine cancels the
  generation at its next step. Cancelling a `fill` (or `generate`) task does the same.
- Remote errors come back as the engine's own classes (`InvalidRequest`,
  `ContextNotFound`, `ContextBusy`, `OutOfMemory`, `RequestCancelled`); an engine that
  cannot be reached, drops a stream, refuses our key or reports itself dead raises
  `EngineUnavailable` (an `EngineError`), so a caller that handles `EngineError` per
  request keeps working, and one that cares can tell "this engine is gone".
- `tokenize` / `detokenize` are local and synchronous (the manager calls them in hot
  paths). The tokenizer is **fetched from the engine once at connect time**
  (`GET /engine/tokenizer`: the files transformers' `save_pretrained` writes) and loaded
  with `AutoTokenizer`, so a manager node needs no model files and tokenizes exactly as
  the engine does. Engines with the same tokenizer fingerprint share one loaded copy. Pass
  `tokenizer=` (a loaded tokenizer, or a model name/path for `resolve_model`) to skip the
  download.

Create one with `await RemoteEngine.connect(url, api_key=...)`; `await engine.aclose()`
when done (or `async with`).
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import threading
from collections.abc import AsyncIterator, Hashable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from parrot_backend.contract.engine import EngineStats, ScoredFill, TokenDelta
from parrot_backend.contract.errors import EngineUnavailable, InvalidRequest
from parrot_backend.contract.sampling import SamplingParams
from parrot_backend.contract.wire import (
    INFO_REQUIRED,
    check_context_id,
    delta_from_json,
    error_from_response,
    sse_events,
    stats_from_json,
)
from parrot_backend.engine.tokens import decode_tokens, encode_segment, special_token_ids

_TOKENIZERS: dict[str, Any] = {}  # fingerprint -> loaded tokenizer, shared by engines
_TOKENIZERS_LOCK = threading.Lock()


def _load_tokenizer(files: dict[str, str]):
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="parrot-remote-tok-") as tmp:
        for name, text in files.items():
            if Path(name).name != name or name.startswith("."):
                raise EngineUnavailable(f"engine sent a tokenizer file named {name!r}")
            (Path(tmp) / name).write_text(text, "utf-8")
        # everything is read into memory here; the folder can go away afterwards
        return AutoTokenizer.from_pretrained(tmp, local_files_only=True)


def _local_tokenizer(source: str | os.PathLike):
    from transformers import AutoTokenizer

    from parrot_backend.engine.model_files import resolve_model

    path = resolve_model(source, progress=False)
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


class RemoteEngine:
    """One remote engine (base URL + key) behind the `EngineClient` interface."""

    # the engine's deltas carry `SamplingParams.logprobs` over the wire (`wire.delta_frame`)
    supports_logprobs = True
    # ... and scores a fill's tokens (`fill(..., prompt_logprobs=k)`, the fill's answer)
    supports_prompt_logprobs = True

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str,
        info: dict[str, Any],
        tokenizer: Any,
        client: httpx.AsyncClient | None = None,
        control_timeout_s: float = 10.0,
    ) -> None:
        """Prefer `connect`, which fetches `info` (`GET /engine/info`) and the tokenizer."""
        self.base_url = base_url.rstrip("/")
        self.info = dict(info)
        self.model_name: str = info["model_name"]
        self.vocab_size: int = info["vocab_size"]
        self.max_model_len: int = info["max_model_len"]
        self.block_size: int = info["block_size"]
        self.chat_template: str | None = info.get("chat_template")
        self.special_tokens: dict[str, str] = dict(info.get("special_tokens") or {})
        self.eos_ids = frozenset(info.get("eos_token_ids") or ())
        self.tokenizer = tokenizer
        self.special_token_ids = special_token_ids(tokenizer)
        self.control_timeout_s = control_timeout_s
        self._owns_client = client is None
        self._client = client or self.make_client(self.base_url, api_key)
        self.closed = False

    @staticmethod
    def make_client(base_url: str, api_key: str) -> httpx.AsyncClient:
        # No read timeout by default: a fill or a generation may wait long in the engine's
        # queue; liveness comes from the connection itself (a dead process resets it) and
        # from the registry's heartbeats. Control calls set their own timeout.
        return httpx.AsyncClient(
            base_url=base_url,
            headers={"Authorization": f"Bearer {api_key}"},
            timeout=httpx.Timeout(None, connect=5.0, pool=None),
            # one connection per concurrent stream; the manager bounds the batch itself
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            trust_env=False,  # engines are reached directly, never through HTTP(S)_PROXY
        )

    @classmethod
    async def connect(
        cls,
        base_url: str,
        *,
        api_key: str,
        tokenizer: Any = None,
        control_timeout_s: float = 10.0,
    ) -> RemoteEngine:
        """Fetch the engine's info and tokenizer; raises EngineUnavailable when the engine
        cannot be reached or does not speak the engine API. `tokenizer`: a loaded tokenizer,
        or a local model name/path to load it from, instead of downloading it."""
        base_url = base_url.rstrip("/")
        client = cls.make_client(base_url, api_key)
        try:
            info = await cls._get_json(client, "/engine/info", control_timeout_s)
            missing = INFO_REQUIRED - set(info) if isinstance(info, dict) else INFO_REQUIRED
            if missing:
                raise EngineUnavailable(f"{base_url}/engine/info lacks {sorted(missing)}")
            # loading takes a while: keep the caller's event loop (the manager's) serving
            if tokenizer is None:
                tokenizer = await cls._fetch_tokenizer(client, info, control_timeout_s)
            elif isinstance(tokenizer, (str, os.PathLike)):
                tokenizer = await asyncio.to_thread(_local_tokenizer, tokenizer)
            engine = cls(
                base_url,
                api_key=api_key,
                info=info,
                tokenizer=tokenizer,
                client=client,
                control_timeout_s=control_timeout_s,
            )
        except BaseException:
            await client.aclose()
            raise
        engine._owns_client = True  # made here, so closed with the engine
        return engine

    @classmethod
    async def _get_json(cls, client: httpx.AsyncClient, path: str, timeout: float) -> Any:
        try:
            response = await client.get(path, timeout=timeout)
        except httpx.HTTPError as exc:
            raise EngineUnavailable(f"cannot reach engine at {client.base_url}: {exc!r}") from exc
        if response.status_code != 200:
            err = error_from_response(response.status_code, _json_or_none(response))
            if not isinstance(err, EngineUnavailable):
                err = EngineUnavailable(f"{client.base_url}{path}: {err}")
            raise err
        try:
            return response.json()
        except ValueError as exc:
            raise EngineUnavailable(f"{client.base_url}{path} did not answer JSON") from exc

    @classmethod
    async def _fetch_tokenizer(cls, client: httpx.AsyncClient, info: dict, timeout: float):
        fingerprint = info.get("tokenizer_fingerprint")
        with _TOKENIZERS_LOCK:
            if fingerprint in _TOKENIZERS:
                return _TOKENIZERS[fingerprint]
        payload = await cls._get_json(client, "/engine/tokenizer", timeout)
        tokenizer = await asyncio.to_thread(_load_tokenizer, payload["files"])
        with _TOKENIZERS_LOCK:
            return _TOKENIZERS.setdefault(payload["fingerprint"], tokenizer)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Nothing to start (the engine runs in its own process); for `create_app`'s
        `manage_engine`."""

    async def stop(self) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the HTTP client; streams in progress end with EngineUnavailable."""
        self.closed = True
        if self._owns_client:
            await self._client.aclose()

    async def __aenter__(self) -> RemoteEngine:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"RemoteEngine({self.base_url!r}, model={self.model_name!r})"

    # ------------------------------------------------------------------ local
    def tokenize(self, text: str, *, data: bool = False) -> list[int]:
        """Token ids for a text segment, without special tokens (as `Engine.tokenize`)."""
        return encode_segment(self.tokenizer, text, data=data)

    def detokenize(self, token_ids: list[int]) -> str:
        return decode_tokens(self.tokenizer, token_ids)

    # ------------------------------------------------------------------ primitives
    async def fill(
        self,
        context_id: Hashable,
        parent_id: Hashable | None,
        token_ids: list[int],
        *,
        salt: str | None = None,
        priority: int = 0,
        prompt_logprobs: int | None = None,
    ) -> int | ScoredFill:
        """Append tokens to a context (forking it from `parent_id` if new); returns its
        length (with `prompt_logprobs`, a `ScoredFill`: the engine's entries). Cancelling
        the awaiting task cancels the remote fill."""
        check_context_id(context_id, "context_id")
        check_context_id(parent_id, "parent_id")
        body = {
            "context_id": context_id,
            "parent_id": parent_id,
            "token_ids": list(token_ids),
            "salt": salt,
            "priority": priority,
        }
        if prompt_logprobs is not None:  # (an engine from before it refuses the field)
            body["prompt_logprobs"] = prompt_logprobs
        data = await self._post("/engine/fill", body, timeout=None)
        if prompt_logprobs is None:
            return int(data["length"])
        entries = [
            None if e is None else (float(e[0]), [(int(t), float(lp)) for t, lp in e[1]])
            for e in data["prompt_logprobs"]
        ]
        return ScoredFill(int(data["length"]), entries)

    async def generate(
        self,
        context_id: Hashable,
        parent_id: Hashable | None,
        sampling: SamplingParams,
        *,
        salt: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[TokenDelta]:
        """Stream the deltas of a remote generation; the last has `finish_reason` set.
        Closing the iterator early closes the stream, which cancels the generation."""
        check_context_id(context_id, "context_id")
        check_context_id(parent_id, "parent_id")
        if not isinstance(sampling, SamplingParams):
            raise InvalidRequest("sampling must be a SamplingParams")
        self._check_open()
        wire_sampling = asdict(sampling)
        if sampling.logprobs is None:  # (an engine from before logprobs refuses the field)
            del wire_sampling["logprobs"]
        if not sampling.logit_bias:  # (nor one from before logit_bias this one)
            del wire_sampling["logit_bias"]
        body = {
            "context_id": context_id,
            "parent_id": parent_id,
            "sampling": wire_sampling,
            "salt": salt,
            "priority": priority,
        }
        finished = False
        try:
            async with self._client.stream("POST", "/engine/generate", json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    raise error_from_response(response.status_code, _json_or_none(response))
                async for event, data in sse_events(response.aiter_bytes()):
                    if event == "error":
                        raise error_from_response(200, _loads(data))
                    delta = delta_from_json(_loads(data))
                    finished = delta.finish_reason is not None
                    yield delta
                    if finished:
                        return
        except httpx.HTTPError as exc:
            raise EngineUnavailable(f"engine at {self.base_url}: {exc!r}") from exc
        if not finished:
            raise EngineUnavailable(f"engine at {self.base_url} ended the stream early")

    async def free(self, context_id: Hashable) -> None:
        """Release a context (blocks other contexts hold stay alive)."""
        check_context_id(context_id, "context_id")
        await self._post("/engine/free", {"context_id": context_id}, timeout=self.control_timeout_s)

    async def reset(self) -> int:
        """Free every idle context on the engine (what a manager does when it takes the
        engine over: contexts it does not know are orphans). Returns how many it freed."""
        data = await self._post("/engine/reset", {}, timeout=self.control_timeout_s)
        return int(data["freed"])

    async def stats(self) -> EngineStats:
        self._check_open()
        data = await self._get_json(self._client, "/engine/stats", self.control_timeout_s)
        return stats_from_json(data)

    async def health(self) -> bool:
        """Whether `/healthz` answers OK (it needs no key)."""
        try:
            response = await self._client.get("/healthz", timeout=self.control_timeout_s)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    # ------------------------------------------------------------------ plumbing
    def _check_open(self) -> None:
        if self.closed:
            raise EngineUnavailable(f"engine at {self.base_url}: client closed")

    async def _post(self, path: str, body: dict, *, timeout: float | None) -> Any:
        self._check_open()
        try:
            response = await self._client.post(
                path, json=body, timeout=httpx.Timeout(timeout, connect=5.0, pool=None)
            )
        except httpx.HTTPError as exc:
            raise EngineUnavailable(f"engine at {self.base_url}: {exc!r}") from exc
        data = _json_or_none(response)
        if response.status_code != 200:
            raise error_from_response(response.status_code, data)
        if data is None:
            raise EngineUnavailable(f"engine at {self.base_url}{path} did not answer JSON")
        return data


def _json_or_none(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


def _loads(data: str) -> Any:
    try:
        return json.loads(data)
    except ValueError as exc:
        raise EngineUnavailable(f"engine sent a malformed event: {data[:200]!r}") from exc
