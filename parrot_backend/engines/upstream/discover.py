"""What an upstream is, asked once when the adapter connects.

`GET <base>/models` names the model and, through `owned_by`, the server: `llamacpp`,
`vllm`, `sglang` or `parrot` (anything else is a plain OpenAI-compatible server).
llama.cpp also answers `GET /props`: its slots, each slot's context (`n_ctx`, so the
longest prompt plus completion a request may have), chat template and BOS/EOS spellings;
its model card's `meta` gives the vocabulary size. vLLM's and parrot-backend's model cards
carry `max_model_len`.

URLs: the OpenAI base is `.../v1`; llama.cpp's native routes, `/tokenize`, `/metrics` and
the health routes live at the server's root, the base without `/v1`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx

from parrot_backend.contract.errors import EngineUnavailable

from .dialects import LLAMA_CPP

_OWNERS = {"llamacpp": LLAMA_CPP, "vllm": "vllm", "sglang": "sglang", "parrot": "parrot"}


@dataclass(slots=True)
class UpstreamInfo:
    """An upstream's identity and limits (None where it does not say)."""

    kind: str
    root: str  # scheme://host:port[/prefix], no trailing slash, no /v1
    base: str  # the OpenAI base: root + /v1
    model: str  # the name requests carry
    max_model_len: int | None = None
    vocab_size: int | None = None
    slots: int | None = None
    chat_template: str | None = None
    special_tokens: dict[str, str] = field(default_factory=dict)


def split_url(url: str) -> tuple[str, str]:
    """(root, OpenAI base) of what a user passes: `http://h:p/v1` or `http://h:p`."""
    url = url.rstrip("/")
    if url.endswith("/v1"):
        return url[: -len("/v1")], url
    return url, url + "/v1"


async def _get(client: httpx.AsyncClient, url: str, timeout: float) -> Any | None:
    """JSON of a GET, None when the route is not there; EngineUnavailable when the server
    cannot be reached."""
    try:
        response = await client.get(url, timeout=timeout)
    except httpx.HTTPError as exc:
        raise EngineUnavailable(f"cannot reach upstream at {url}: {exc!r}") from exc
    if response.status_code in (401, 403):
        raise EngineUnavailable(f"{url} refused our API key ({response.status_code})")
    if response.status_code != 200:
        return None
    try:
        return response.json()
    except ValueError:
        return None


async def discover(
    client: httpx.AsyncClient,
    url: str,
    *,
    model: str | None = None,
    kind: str | None = None,
    timeout: float = 10.0,
) -> UpstreamInfo:
    """Ask the upstream at `url` what it serves. `model` and `kind` override what it says."""
    root, base = split_url(url)
    models = await _get(client, base + "/models", timeout)
    cards = models.get("data") if isinstance(models, dict) else None
    if not cards:
        raise EngineUnavailable(
            f"{base}/models lists no model: is this an OpenAI-compatible "
            f"server (give the URL ending in /v1)?"
        )
    card = next((c for c in cards if model is None or c.get("id") == model), cards[0])
    found = _OWNERS.get(str(card.get("owned_by", "")).lower(), "openai")
    props = await _get(client, root + "/props", timeout) if found in (LLAMA_CPP, "openai") else None
    if found == "openai" and isinstance(props, dict) and "default_generation_settings" in props:
        found = LLAMA_CPP
    info = UpstreamInfo(kind=kind or found, root=root, base=base, model=model or card["id"])
    if isinstance(card.get("max_model_len"), int):
        info.max_model_len = card["max_model_len"]
    meta = card.get("meta") if isinstance(card.get("meta"), dict) else {}
    if isinstance(meta.get("n_vocab"), int):
        info.vocab_size = meta["n_vocab"]
    if isinstance(props, dict):
        settings = props.get("default_generation_settings") or {}
        if isinstance(settings.get("n_ctx"), int):
            info.max_model_len = settings["n_ctx"]  # per slot: what one request may use
        if isinstance(props.get("total_slots"), int):
            info.slots = props["total_slots"]
        if isinstance(props.get("chat_template"), str) and props["chat_template"]:
            info.chat_template = props["chat_template"]
        for name in ("bos_token", "eos_token"):
            if isinstance(props.get(name), str) and props[name]:
                info.special_tokens[name] = props[name]
    return info
