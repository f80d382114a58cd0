"""`UpstreamEngine`: the engine contract over an OpenAI-compatible server (vLLM, SGLang,
llama.cpp, parrot-backend itself).

- **Contexts live here** (`contexts.py`): `fill` appends tokens to the adapter's own copy
  of the context and sends nothing; `generate` sends the context's whole prompt as token
  ids and streams the answer back as `TokenDelta`s, appending what it generated to the
  context. There is no KV fork across HTTP: what the children of a context share is what
  the upstream's prefix cache keeps.
- **Warm-up of shared prefixes.** The first time a context is forked (a child made from
  it by `fill` or `generate`), the adapter sends one short request with the parent's
  tokens (`dialects.warm_request`) and every child waits for it before its own request:
  N calls fanning out from one prefix then find it in the upstream's cache instead of
  missing it N times at once. The manager's prefix contexts are exactly the contexts it
  forks, so a prefix shared by a task group is warmed once, by whichever member comes
  first. Contexts under `warm_min_tokens` are not warmed.
- **Token ids** come back with each chunk where the upstream returns them (llama.cpp's
  `return_tokens`, vLLM's `return_token_ids`); other servers stream text only, and the
  adapter's deltas then have `token_id` None and the text is re-tokenized into the context
  when the generation ends.
- **Cancelling**: closing the `generate` iterator closes the HTTP stream; llama.cpp, vLLM
  and SGLang abort a request whose client went away.
- **Errors**: a 400/413/422 answer is `InvalidRequest` (a bad or oversized prompt); a
  connection that cannot be made or breaks, a 5xx, a refused key, a missing route or
  model are `EngineUnavailable` (the manager takes the upstream out of service and runs
  its calls elsewhere); a 429 is retried (`Retry-After`) a few times, then
  `EngineUnavailable`.
- **Stats** combine the upstream's `/metrics` (`metrics.py`; scraped in the background
  at most every `stats_interval_s`, so the manager's dispatch rounds never wait on it)
  with the adapter's own counts. Capacity is in tokens (`block_size` 1): llama.cpp's
  slots times each slot's context, vLLM's and SGLang's KV size from their metrics, else
  `capacity_tokens`. Used is the larger of what the upstream reports and what this
  adapter's requests in flight may take (prompt plus max new tokens).
- **Priorities** are not sent (vLLM refuses them unless started with priority
  scheduling): the manager's own queue orders calls before they reach the upstream.
- **Log probabilities** (`SamplingParams.logprobs`) pass through from llama.cpp, whose
  `completion_probabilities` carry token ids and raw-logit logprobs (`dialects.py`); the
  other kinds are refused (`InvalidRequest` naming the upstream): vLLM and SGLang key
  their alternatives by token text, not by id.
- **Salts** become vLLM's `cache_salt`; llama.cpp and SGLang have no equivalent, so
  their prefix caches are shared by every tenant whose prompts they see.

Create one with `await UpstreamEngine.connect(url, ...)`; `await engine.aclose()` when
done (or `async with`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Hashable, Sequence
from typing import Any

import httpx

from parrot_backend.contract.engine import EngineStats, TokenDelta
from parrot_backend.contract.errors import (
    ContextBusy,
    ContextNotFound,
    EngineError,
    EngineUnavailable,
    InvalidRequest,
    RequestCancelled,
)
from parrot_backend.contract.sampling import SamplingParams
from parrot_backend.contract.wire import sse_events

from . import dialects
from .contexts import Context, ContextTree
from .discover import UpstreamInfo, discover
from .metrics import Load, read_load
from .tokenizer import PROBE, HttpTokenizer, LocalTokenizer, check_agrees

log = logging.getLogger(__name__)

RETRIES_429 = 5
# A request whose connection failed before any response arrived is sent again, this many
# times: a pooled keep-alive connection the upstream closed meanwhile fails so ("Server
# disconnected without sending a response": seen 2 times in 12 back-to-back generations on
# llama-server). Nothing of the answer was read, so nothing is repeated to the caller.
RETRIES_UNANSWERED = 2
_UNANSWERED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, httpx.ConnectError)


def error_for(status: int, body: Any, url: str) -> EngineError:
    """The contract's error for an upstream's error answer (or error event)."""
    err = body.get("error") if isinstance(body, dict) else None
    message = ""
    if isinstance(err, dict):
        message = str(err.get("message") or "")
        code = err.get("code")
        if status == 200 and isinstance(code, int):
            status = code  # an error event inside a stream carries its status as code
    elif isinstance(err, str):
        message = err
    what = f"upstream {url} answered {status}" + (f": {message[:500]}" if message else "")
    if status in (400, 413, 422):
        return InvalidRequest(what)
    return EngineUnavailable(what)


class UpstreamEngine:
    """One OpenAI-compatible server behind the `EngineClient` interface."""

    def __init__(
        self,
        info: UpstreamInfo,
        tokenizer: LocalTokenizer | HttpTokenizer,
        *,
        api_key: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        model_name: str | None = None,
        eos_ids: frozenset[int] = frozenset(),
        warm_prefixes: bool = True,
        warm_min_tokens: int = 16,
        capacity_tokens: int | None = None,
        stats_interval_s: float = 1.0,
    ) -> None:
        """Prefer `connect`, which asks the upstream for `info` and sets up the tokenizer.
        The HTTP client is made on first use, on the event loop that uses it (a `serve`
        connects its upstreams before it starts its own loop)."""
        self.info = info
        self.kind = info.kind
        self.url = info.base
        self.model_name: str = model_name or info.model
        self.vocab_size = info.vocab_size
        self.max_model_len = info.max_model_len
        self.chat_template = info.chat_template
        self.special_tokens = dict(info.special_tokens)
        self.eos_ids = eos_ids
        self._tok = tokenizer
        self._owns_tok = True
        self.tokenizer = tokenizer.hf  # the manager cuts prefixes with its pre-tokenizer
        self.special_token_ids = tokenizer.special_token_ids
        self.warm_prefixes = warm_prefixes
        self.warm_min_tokens = warm_min_tokens
        self.capacity_tokens = capacity_tokens or self._default_capacity()
        self.stats_interval_s = stats_interval_s
        self.tree = ContextTree()
        self.closed = False
        self.error: BaseException | None = None  # (an in-process engine's loop death)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._transport = transport
        self._http: httpx.AsyncClient | None = None
        self._load = Load()
        self._scraped_at = float("-inf")
        self._scrape: asyncio.Task[None] | None = None
        self._down: str | None = None  # why the last scrape found the upstream unreachable
        self._metrics_route = True
        # the adapter's own counts
        self.running = 0
        self.reserved_tokens = 0
        self.requests = 0
        self.warmups = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.tokens_generated = 0

    # ------------------------------------------------------------------ connecting
    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        api_key: str | None = None,
        model: str | None = None,
        model_name: str | None = None,
        tokenizer: Any = None,
        kind: str | None = None,
        warm_prefixes: bool | None = None,
        capacity_tokens: int | None = None,
        max_model_len: int | None = None,
        stats_interval_s: float = 1.0,
        transport: httpx.AsyncBaseTransport | None = None,
        sync_transport: httpx.BaseTransport | None = None,
    ) -> UpstreamEngine:
        """Connect to the server at `url` (`http://host:port/v1`).

        `model`: the name requests carry (default: the first model it lists);
        `model_name`: the name the manager knows it by (default: `model`). `tokenizer`: a
        loaded Hugging Face tokenizer or a model name/path for `resolve_model`; checked
        against the upstream's `/tokenize` where it has one. Without one the upstream's
        own `/tokenize` is used (llama.cpp, vLLM). `warm_prefixes`: warm a context's
        tokens when it is first forked (default on). Raises EngineUnavailable when the
        upstream cannot be reached, ValueError when the tokenizers disagree or there is
        none to use. `transport`, `sync_transport`: httpx transports to reach the server
        through (tests)."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        client = _make_client(headers, transport)  # for these questions only
        remote = None
        try:
            info = await discover(client, url, model=model, kind=kind)
            if max_model_len is not None:
                info.max_model_len = max_model_len
            if info.kind in (dialects.LLAMA_CPP, "vllm"):
                remote = HttpTokenizer(
                    info.root,
                    kind=info.kind,
                    model=info.model,
                    headers=headers,
                    transport=sync_transport,
                )
            local = await asyncio.to_thread(_local_tokenizer, tokenizer) if tokenizer else None
            if local is not None and remote is not None:
                await asyncio.to_thread(check_agrees, local, remote)
            if local is None and remote is None:
                raise ValueError(
                    f"upstream {info.base} ({info.kind}) has no /tokenize route: "
                    f"name a local tokenizer for it"
                )
            tok = local or remote
            assert tok is not None
            if local is not None:
                _fill_from_hf(info, local.hf)
            eos_ids = await asyncio.to_thread(_eos_ids, info, tok)
            if isinstance(tok, HttpTokenizer):
                tok.special_token_ids.update(_special_ids(info, tok))
        except BaseException:
            if remote is not None:
                remote.close()
            raise
        finally:
            await client.aclose()
        if local is not None and remote is not None:
            remote.close()  # checked; the local one answers from here on
        return cls(
            info,
            tok,
            api_key=api_key,
            transport=transport,
            model_name=model_name,
            eos_ids=eos_ids,
            warm_prefixes=True if warm_prefixes is None else warm_prefixes,
            capacity_tokens=capacity_tokens,
            stats_interval_s=stats_interval_s,
        )

    def _default_capacity(self) -> int:
        if self.info.slots and self.max_model_len:
            return self.info.slots * self.max_model_len
        return 8 * (self.max_model_len or 4096)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Nothing to start (the upstream runs on its own); for `create_app`."""

    async def stop(self) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the HTTP clients; streams in progress end with EngineUnavailable."""
        self.closed = True
        if self._scrape is not None:
            self._scrape.cancel()
        if self._http is not None:
            await self._http.aclose()
        if isinstance(self._tok, HttpTokenizer) and self._owns_tok:
            self._tok.close()

    async def __aenter__(self) -> UpstreamEngine:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    @property
    def supports_logprobs(self) -> bool:
        """llama.cpp returns logprobs by token id (`TokenDelta.top_logprobs`' form); the
        OpenAI-compatible servers key them by token text: refused."""
        return self.kind == dialects.LLAMA_CPP

    @property
    def logprobs_refusal(self) -> str:
        return (
            f"log probabilities are not available from the upstream engine ({self.kind} at "
            f"{self.url}): it does not return them by token id (llama.cpp upstreams do)"
        )

    # The prompt's log probabilities (`fill(..., prompt_logprobs=k)`, OpenAI's `echo` with
    # `logprobs`) are not asked of any upstream kind: refused with a 400.
    supports_prompt_logprobs = False

    @property
    def prompt_logprobs_refusal(self) -> str:
        return (
            f"the prompt's log probabilities are not available from the upstream engine "
            f"({self.kind} at {self.url})"
        )

    def __repr__(self) -> str:
        return f"UpstreamEngine({self.url!r}, kind={self.kind!r}, model={self.info.model!r})"

    # ------------------------------------------------------------------ tokens
    def tokenize(self, text: str, *, data: bool = False) -> list[int]:
        """Token ids of a text segment, no special tokens added (`data`: special-token
        spellings stay text)."""
        return self._tok.tokenize(text, data=data)

    def detokenize(self, token_ids: list[int]) -> str:
        return self._tok.detokenize(token_ids)

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
    ) -> int:
        """Append tokens to a context (forking it from `parent_id` if new); returns its
        length. Sends nothing, except the parent's warm-up when this is its first child.
        Scoring the tokens (`prompt_logprobs`) is refused (`prompt_logprobs_refusal`)."""
        self._check_open()
        if prompt_logprobs is not None:
            raise InvalidRequest(self.prompt_logprobs_refusal)
        if not isinstance(token_ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in token_ids
        ):
            raise InvalidRequest("token_ids must be a list of integers")
        if self.vocab_size is not None:
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequest(f"token ids outside the vocabulary: {bad[:5]}")
        ctx, new = self.tree.resolve(context_id, parent_id, salt)
        if ctx.generating:
            raise ContextBusy(f"context {context_id!r} is generating")
        if self.max_model_len is not None and len(ctx.tokens) + len(token_ids) > self.max_model_len:
            raise InvalidRequest(
                f"context {context_id!r} would hold {len(ctx.tokens) + len(token_ids)} tokens, "
                f"more than the upstream's {self.max_model_len} per request"
            )
        self.tree.add(ctx)
        ctx.tokens.extend(token_ids)
        if new and ctx.parent is not None:
            await self._warm(ctx.parent)
        return len(ctx.tokens)

    async def generate(
        self,
        context_id: Hashable,
        parent_id: Hashable | None,
        sampling: SamplingParams,
        *,
        salt: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[TokenDelta]:
        """Send the context's whole prompt and stream the answer; the generated tokens stay
        in the context. Closing the iterator early cancels the upstream request."""
        self._check_open()
        if not isinstance(sampling, SamplingParams):
            raise InvalidRequest("sampling must be a SamplingParams")
        sampling.validate(self.vocab_size)
        if sampling.logprobs is not None and not self.supports_logprobs:
            raise InvalidRequest(self.logprobs_refusal)
        if parent_id is None and context_id not in self.tree.contexts:
            raise ContextNotFound(
                f"unknown context {context_id!r}: generate continues an "
                f"existing context or forks a new one from a parent"
            )
        ctx, new = self.tree.resolve(context_id, parent_id, salt)
        if not ctx.tokens:
            raise InvalidRequest("cannot generate from an empty context: fill it first")
        if ctx.generating:
            raise ContextBusy(f"context {context_id!r} is already generating")
        room = sampling.max_tokens
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - len(ctx.tokens))
            if room < 1:
                raise InvalidRequest(
                    f"context {context_id!r} holds {len(ctx.tokens)} tokens: "
                    f"no room left under the upstream's {self.max_model_len}"
                )
        prompt = list(ctx.tokens)
        path, body = dialects.request(
            self.kind,
            self.info.model,
            prompt,
            sampling,
            room,
            ctx.salt if ctx.salt is not None else salt,
        )
        self.tree.add(ctx)
        if new and ctx.parent is not None:
            await self._warm(ctx.parent)
        ctx.generating = True
        reserved = len(prompt) + room
        self.running += 1
        self.reserved_tokens += reserved
        stream = self._stream(ctx, path, body, sampling)
        try:
            async with contextlib.aclosing(stream):  # closed with us: the upstream stops
                async for delta in stream:
                    yield delta
        finally:
            ctx.generating = False
            self.running -= 1
            self.reserved_tokens -= reserved

    async def free(self, context_id: Hashable) -> None:
        """Forget a context (the upstream holds nothing of it but its prefix cache)."""
        self.tree.free(context_id)

    async def reset(self) -> int:
        """Free every context not generating (what a manager does when it takes the engine
        (back) into service: contexts it does not know are orphans). Returns how many."""
        freed = 0
        for cid in self.tree.idle_leaves_first():
            with contextlib.suppress(EngineError):
                self.tree.free(cid)
                freed += 1
        return freed

    async def health(self) -> bool:
        """Whether the upstream answers its model list."""
        try:
            response = await self._client.get(self.url + "/models", timeout=5.0)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def stats(self) -> EngineStats:
        """The last scrape of the upstream's metrics with the adapter's own counts; a
        new scrape starts in the background when the last is older than
        `stats_interval_s`. Raises EngineUnavailable while the upstream cannot be
        reached."""
        self._check_open()
        if self._scraped_at == float("-inf"):
            await self._refresh()  # the first time: there is nothing to answer with yet
        stale = time.monotonic() - self._scraped_at > self.stats_interval_s
        if stale and (self._scrape is None or self._scrape.done()):
            self._scrape = asyncio.create_task(self._refresh())
        if self._down is not None:
            raise EngineUnavailable(self._down)
        return self.stats_now()

    def stats_now(self) -> EngineStats:
        load, capacity = self._load, self.capacity_tokens
        used = self.reserved_tokens
        if load.kv_usage is not None:
            used = max(used, int(load.kv_usage * capacity))
        used = min(used, capacity)
        return EngineStats(
            block_size=1,
            blocks_total=capacity,
            blocks_used=used,
            blocks_free=capacity - used,
            blocks_cached=0,
            prefix_cache_enabled=True,
            prefix_cache_hits=self.cached_tokens,
            prefix_cache_queries=self.prompt_tokens,
            contexts=len(self.tree),
            running=max(self.running, load.running or 0),
            waiting=load.waiting or 0,
            tokens_computed=self.prompt_tokens - self.cached_tokens + self.tokens_generated,
            tokens_generated=self.tokens_generated,
            preemptions=0,
            steps=0,
            prefill_tokens_computed=self.prompt_tokens - self.cached_tokens,
            extra={
                "kind": self.kind,
                "url": self.url,
                "requests": self.requests,
                "warmups": self.warmups,
                "upstream": {k: getattr(load, k) for k in load.__slots__},
            },
        )

    # ------------------------------------------------------------------ plumbing
    def _check_open(self) -> None:
        if self.closed:
            raise EngineUnavailable(f"upstream {self.url}: client closed")

    @property
    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = _make_client(self._headers, self._transport)
        return self._http

    def _path_url(self, path: str) -> str:
        return (self.info.root if self.kind == dialects.LLAMA_CPP else self.info.base) + path

    async def _warm(self, parent: Context) -> None:
        """Warm `parent`'s tokens in the upstream's prefix cache once; later children wait
        for the same request. Best effort: a failed warm-up only costs the cache hit."""
        if not self.warm_prefixes or len(parent.tokens) < self.warm_min_tokens:
            return
        fut = parent.warm
        if fut is None or parent.warm_len != len(parent.tokens):
            parent.warm_len = len(parent.tokens)
            fut = parent.warm = asyncio.ensure_future(
                self._send_warm(list(parent.tokens), parent.salt)
            )
        await asyncio.shield(fut)

    async def _send_warm(self, tokens: list[int], salt: str | None) -> None:
        path, body = dialects.warm_request(self.kind, self.info.model, tokens, salt)
        try:
            response = await self._post_retrying(self._path_url(path), body)
            if response.status_code != 200:
                log.info("upstream %s: warm-up answered %s", self.url, response.status_code)
                return
            self.warmups += 1
            self._count(dialects.read(self.kind, _json(response) or {}))
        except Exception as exc:  # best effort: the children's own requests go on
            log.info("upstream %s: warm-up failed: %r", self.url, exc)

    async def _post_retrying(self, url: str, body: dict[str, Any]) -> httpx.Response:
        attempt = unanswered = 0
        while True:
            try:
                response = await self._client.post(url, json=body)
            except _UNANSWERED as exc:
                if unanswered == RETRIES_UNANSWERED:
                    raise EngineUnavailable(f"upstream {url}: {exc!r}") from exc
                unanswered += 1
                continue
            except httpx.HTTPError as exc:
                raise EngineUnavailable(f"upstream {url}: {exc!r}") from exc
            if response.status_code != 429 or attempt == RETRIES_429:
                return response
            await asyncio.sleep(_retry_after(response, attempt))
            attempt += 1

    async def _stream(
        self, ctx: Context, path: str, body: dict[str, Any], sampling: SamplingParams
    ) -> AsyncIterator[TokenDelta]:
        url = self._path_url(path)
        self.requests += 1
        reading = _Reading(
            ctx,
            frozenset(sampling.stop_token_ids),
            frozenset() if sampling.ignore_eos else self.eos_ids,
            sampling.logprobs,
        )
        try:
            async with self._open(url, body) as response:
                events = sse_events(response.aiter_bytes())
                async with contextlib.aclosing(events):  # (and with it the HTTP stream)
                    async for _event, data in events:
                        if data.strip() == "[DONE]":
                            break
                        payload = _loads(data, url)
                        if "error" in payload:
                            raise error_for(200, payload, url)
                        chunk = dialects.read(self.kind, payload)
                        self._count(chunk)
                        if reading.finish is not None:
                            continue  # (the usage chunk after the last delta)
                        if chunk.finish == "abort":
                            raise RequestCancelled(f"upstream {url} aborted the request")
                        for delta in reading.add(chunk, self.tokenize):
                            yield delta
                        if reading.stopped_here:
                            break  # a stop token we honour: closing the stream cancels it
        except httpx.HTTPError as exc:
            raise EngineUnavailable(f"upstream {url}: {exc!r}") from exc
        finally:
            self.tokens_generated += reading.generated
        if reading.finish is None:
            raise EngineUnavailable(f"upstream {url} ended the stream before the end")

    @contextlib.asynccontextmanager
    async def _open(self, url: str, body: dict[str, Any]) -> AsyncIterator[httpx.Response]:
        """The streamed response of a generation request (a 429 retried a few times, and a
        request that got no answer at all: `RETRIES_UNANSWERED`)."""
        attempt = unanswered = 0
        while True:
            answered = False
            try:
                async with self._client.stream("POST", url, json=body) as response:
                    answered = True
                    if response.status_code == 429 and attempt < RETRIES_429:
                        wait = _retry_after(response, attempt)
                    else:
                        if response.status_code != 200:
                            await response.aread()
                            raise error_for(response.status_code, _json(response), url)
                        yield response
                        return
            except _UNANSWERED:
                if answered or unanswered == RETRIES_UNANSWERED:
                    raise  # (once answered, the reader's errors are the reader's)
                unanswered += 1
                continue
            await asyncio.sleep(wait)
            attempt += 1

    def _count(self, chunk: dialects.Chunk) -> None:
        """Prompt tokens and prefix-cache hits, where the upstream reports them."""
        if chunk.prompt_tokens is not None:
            self.prompt_tokens += chunk.prompt_tokens
            self.cached_tokens += chunk.cached_tokens or 0

    async def _refresh(self) -> None:
        """Scrape the upstream's metrics (or, without them, see that it answers)."""
        try:
            if self._metrics_route:
                response = await self._client.get(self.info.root + "/metrics", timeout=5.0)
                if response.status_code == 200:
                    self._load = read_load(response.text)
                    self._down = None
                    return
                self._metrics_route = False  # not exposed: liveness only from now on
            if await self.health():
                self._down = None
            else:
                self._down = f"upstream {self.url} does not answer"
        except httpx.HTTPError as exc:
            self._down = f"upstream {self.url} cannot be reached: {exc!r}"
        finally:
            self._scraped_at = time.monotonic()


async def connect_all(urls: Sequence[str], **kwargs: Any) -> list[UpstreamEngine]:
    """Connect to several upstreams of one model (`UpstreamEngine.connect`'s keywords).

    Those that tokenize through their own `/tokenize` share one tokenizer that falls back
    from one server to the next: the manager renders every prompt with its first engine's
    tokenizer, which must outlive that engine's server."""
    engines: list[UpstreamEngine] = []
    try:
        for url in urls:
            engines.append(await UpstreamEngine.connect(url, **kwargs))
    except BaseException:
        for engine in engines:
            await engine.aclose()
        raise
    shared: HttpTokenizer | None = None
    for engine in engines:
        tok = engine._tok
        if not isinstance(tok, HttpTokenizer):
            continue
        if shared is None:
            shared = tok
        elif tok.kind == shared.kind and await asyncio.to_thread(_agree, shared, tok):
            shared.join(tok)
            engine._tok, engine._owns_tok = shared, False
    return engines


def _agree(a: HttpTokenizer, b: HttpTokenizer) -> bool:
    return a.tokenize(PROBE) == b.tokenize(PROBE)


class _Reading:
    """Turns a generation's chunks into `TokenDelta`s and keeps its context's tokens."""

    def __init__(
        self,
        ctx: Context,
        stop_ids: frozenset[int],
        eos: frozenset[int],
        logprobs: int | None = None,
    ) -> None:
        self.ctx, self.stop_ids, self.eos = ctx, stop_ids, eos
        self.logprobs = logprobs  # top alternatives asked per token, None: none
        self.texts: list[str] = []  # text of pieces without ids: re-tokenized at the end
        self.generated = 0
        self.finish: str | None = None
        self.stopped_here = False  # ended by a stop token the upstream does not know

    def add(self, chunk: dialects.Chunk, tokenize: Any) -> list[TokenDelta]:
        pieces = chunk.pieces or ([(None, "")] if chunk.finish else [])
        scores = self._scores(chunk)
        out = []
        for i, (tid, text) in enumerate(pieces):
            finish = chunk.finish if i == len(pieces) - 1 else None
            logprob = top = None
            if tid is not None:
                self.generated += 1
                if tid in self.stop_ids:
                    self.finish, self.stopped_here = "stop", chunk.finish is None
                    out.append(TokenDelta(tid, "", "stop"))
                    break
                if scores is not None:
                    logprob, top = scores.pop(0)
                    top = top[: self.logprobs]
                if tid not in self.eos:
                    self.ctx.tokens.append(tid)
                else:  # not part of the text: no entry (as the in-process engine's)
                    logprob = top = None
            elif text:
                self.texts.append(text)
            if finish is not None:
                self.finish = finish
                if self.texts:
                    self.ctx.tokens.extend(tokenize("".join(self.texts), data=True))
            out.append(TokenDelta(tid, text, finish, logprob, top))
        return out

    def _scores(self, chunk: dialects.Chunk) -> list[tuple[float, list[tuple[int, float]]]] | None:
        """The chunk's logprobs, one per token id, when they were asked (their absence
        is an error, not a silent None)."""
        if self.logprobs is None:
            return None
        ids = sum(1 for tid, _ in chunk.pieces if tid is not None)
        scores = list(chunk.logprobs or ())
        if len(scores) < ids:
            raise InvalidRequest(
                f"the upstream returned {len(scores)} log probabilities for {ids} tokens"
            )
        return scores


def _make_client(
    headers: dict[str, str], transport: httpx.AsyncBaseTransport | None
) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        headers=headers,
        # no read timeout: a generation may wait long in the upstream's queue; a dead
        # server shows as a refused or broken connection
        timeout=httpx.Timeout(None, connect=5.0, pool=None),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        trust_env=False,
        transport=transport,
    )


def _retry_after(response: httpx.Response, attempt: int) -> float:
    try:
        return min(30.0, max(0.05, float(response.headers.get("retry-after", ""))))
    except ValueError:
        return min(5.0, 0.1 * 2**attempt)


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


def _loads(data: str, url: str) -> dict[str, Any]:
    try:
        payload = json.loads(data)
    except ValueError as exc:
        raise EngineUnavailable(f"upstream {url} sent a malformed event: {data[:200]!r}") from exc
    if not isinstance(payload, dict):
        raise EngineUnavailable(f"upstream {url} sent a malformed event: {data[:200]!r}")
    return payload


def _local_tokenizer(source: Any) -> LocalTokenizer:
    if isinstance(source, (str, os.PathLike)):
        from transformers import AutoTokenizer

        from parrot_backend.engine.model_files import resolve_model

        path = resolve_model(source, progress=False)
        source = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return LocalTokenizer(source)


def _fill_from_hf(info: UpstreamInfo, hf: Any) -> None:
    """What a local tokenizer knows and the upstream did not say."""
    if info.chat_template is None and getattr(hf, "chat_template", None):
        info.chat_template = hf.chat_template
    if info.vocab_size is None:
        info.vocab_size = len(hf)
    for name in ("bos_token", "eos_token"):
        value = getattr(hf, name, None)
        if name not in info.special_tokens and isinstance(value, str) and value:
            info.special_tokens[name] = value


def _special_ids(info: UpstreamInfo, tok: LocalTokenizer | HttpTokenizer) -> dict[str, int]:
    out = {}
    for spelling in info.special_tokens.values():
        ids = tok.tokenize(spelling)
        if len(ids) == 1:
            out[spelling] = ids[0]
    return out


def _eos_ids(info: UpstreamInfo, tok: LocalTokenizer | HttpTokenizer) -> frozenset[int]:
    """The ids that end a generation and stay out of the context (as in the in-process
    engine): the tokenizer's EOS, or the upstream's EOS spelling as one token."""
    hf = tok.hf
    ids: set[int] = set()
    if hf is not None and isinstance(getattr(hf, "eos_token_id", None), int):
        ids.add(hf.eos_token_id)
    eos = info.special_tokens.get("eos_token")
    if eos:
        found = tok.tokenize(eos)
        if len(found) == 1:
            ids.add(found[0])
    return frozenset(ids)
