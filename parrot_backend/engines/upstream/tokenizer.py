"""Tokenizers for an upstream: a local Hugging Face tokenizer, or the upstream's own routes.

The engine contract's `tokenize` is synchronous (the manager calls it while rendering a
call), so the HTTP tokenizer uses a blocking client with a short timeout and caches its
answers: each distinct text costs one round trip, on loopback about a millisecond.

- llama.cpp: `POST /tokenize {"content", "add_special": false, "parse_special"}` (false
  for data, so a value's `<|im_end|>` stays text) and `POST /detokenize {"tokens"}`.
- vLLM: `POST /tokenize {"model", "prompt", "add_special_tokens": false}` and
  `POST /detokenize {"model", "tokens"}`. It has no switch that keeps special-token
  spellings in data as text: give a local tokenizer when values may contain them.

A local tokenizer is preferred where one is given (it also gives the manager the
pre-tokenizer it cuts shared prefixes with); `check_agrees` compares it with the
upstream's `/tokenize` on a probe text at connect time.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import httpx

from parrot_backend.contract.errors import EngineUnavailable, InvalidRequest
from parrot_backend.engine.tokens import decode_tokens, encode_segment, special_token_ids

log = logging.getLogger(__name__)

PROBE = "Hello, world!\n\n  café — 日本語 🦜 <|im_start|>user\nx = [1, 2];\tdone.</s>"


class LocalTokenizer:
    """A loaded Hugging Face tokenizer, used the way every engine uses one."""

    def __init__(self, hf: Any) -> None:
        self.hf = hf
        self.special_token_ids = special_token_ids(hf)

    def tokenize(self, text: str, *, data: bool = False) -> list[int]:
        return encode_segment(self.hf, text, data=data)

    def detokenize(self, token_ids: list[int]) -> str:
        return decode_tokens(self.hf, token_ids)


class HttpTokenizer:
    """The upstream's `/tokenize` and `/detokenize`, cached (LRU, `size` texts).

    `roots` are servers of one model that tokenize alike (`join`): when the one in use
    cannot be reached, the next is asked, so a manager whose first upstream died still
    renders prompts."""

    hf = None

    def __init__(
        self,
        root: str,
        *,
        kind: str,
        model: str,
        headers: dict[str, str],
        specials: dict[str, int] | None = None,
        timeout_s: float = 30.0,
        size: int = 8192,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.root = root
        self.kind = kind
        self.model = model
        self.special_token_ids = dict(specials or {})
        self._clients = [
            httpx.Client(
                base_url=root,
                headers=headers,
                timeout=timeout_s,
                trust_env=False,
                transport=transport,
            )
        ]
        self._cache: OrderedDict[tuple[str, bool], tuple[int, ...]] = OrderedDict()
        self._size = size
        self._warned = False

    def join(self, other: HttpTokenizer) -> None:
        """Fall back on `other`'s server (same kind and tokenization) when ours is down."""
        self._clients.extend(other._clients)
        other._clients = []

    def close(self) -> None:
        for client in self._clients:
            client.close()

    def tokenize(self, text: str, *, data: bool = False) -> list[int]:
        key = (text, data)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return list(hit)
        if self.kind == "llama.cpp":
            body: dict[str, Any] = {
                "content": text,
                "add_special": False,
                "parse_special": not data,
            }
        else:
            if data and not self._warned:
                self._warned = True
                log.warning(
                    "%s: its /tokenize cannot keep special-token spellings in values "
                    "as text; give a local tokenizer to be exact",
                    self.root,
                )
            body = {"model": self.model, "prompt": text, "add_special_tokens": False}
        tokens = self._post("/tokenize", body)["tokens"]
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise EngineUnavailable(f"{self.root}/tokenize answered {str(tokens)[:200]}")
        self._cache[key] = tuple(tokens)
        if len(self._cache) > self._size:
            self._cache.popitem(last=False)
        return list(tokens)

    def detokenize(self, token_ids: list[int]) -> str:
        if self.kind == "llama.cpp":
            return str(self._post("/detokenize", {"tokens": list(token_ids)})["content"])
        body = {"model": self.model, "tokens": list(token_ids)}
        return str(self._post("/detokenize", body)["prompt"])

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if not self._clients:
            raise EngineUnavailable(f"{self.root}: this tokenizer was joined to another")
        for i, client in enumerate(self._clients):
            try:
                response = client.post(path, json=body)
            except httpx.HTTPError as exc:
                if i + 1 == len(self._clients):
                    raise EngineUnavailable(f"{client.base_url}{path}: {exc!r}") from exc
                continue
            if i:  # ask the one that answered first from now on
                self._clients.insert(0, self._clients.pop(i))
            break
        where = f"{response.request.url}"
        if response.status_code in (400, 422):
            raise InvalidRequest(f"{where} refused the text: {response.text[:300]}")
        if response.status_code != 200:
            raise EngineUnavailable(f"{where} answered {response.status_code}")
        try:
            return response.json()
        except ValueError as exc:
            raise EngineUnavailable(f"{where} did not answer JSON") from exc


def check_agrees(local: LocalTokenizer, remote: HttpTokenizer, text: str = PROBE) -> None:
    """Raise ValueError when the local tokenizer and the upstream's disagree on `text`
    (prompts are sent as token ids: a different tokenizer would send another prompt)."""
    ours, theirs = local.tokenize(text), remote.tokenize(text)
    if ours != theirs:
        raise ValueError(
            f"the local tokenizer and {remote.root}/tokenize disagree (first tokens "
            f"{ours[:8]} vs {theirs[:8]}): the upstream serves another model or tokenizer"
        )
