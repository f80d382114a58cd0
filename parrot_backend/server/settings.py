"""Server settings: what the operator chooses, checked once at startup."""

from __future__ import annotations

import ipaddress
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

# A pluggable key -> tenant lookup (the SQL store plugs one in). It may be sync or async and
# returns None for an unknown key.
KeyLookup = Callable[[str], "Awaitable[str | None] | str | None"]

# How long the HTTP servers (`serve`, `engine`) keep an idle keep-alive connection open.
# uvicorn's default (5 s) is httpx's default keep-alive expiry too: a client reusing a
# pooled connection just as the server closes it gets a ReadError for a request it never
# got an answer to (seen in a benchmark's 36-request burst). Longer than the common
# clients' expiries, the server is never the one that closes first.
KEEP_ALIVE_S = 75

# A program carries every call's template whole: 64 users of a 6,144-token system prompt
# (the paper's shared-prompt app) are ~1.8 MB of JSON, over the 1 MiB this once was.
DEFAULT_MAX_BODY_BYTES = 8 << 20


def is_loopback(host: str) -> bool:
    """True when `host` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname we cannot judge: treat it as public


@dataclass(slots=True)
class ServerSettings:
    """Knobs of the HTTP server. `check()` runs on construction and again in `create_app`."""

    host: str = "127.0.0.1"
    port: int = 8000
    # Bearer key -> tenant. Keys are hashed on load; the plaintext is not kept by the app.
    api_keys: dict[str, str] = field(default_factory=dict)
    key_lookup: KeyLookup | None = None
    # None: auth is on iff keys or a lookup are configured. False turns it off, which is
    # only allowed on loopback; True with no keys rejects everyone (fail closed).
    auth: bool | None = None
    served_model_name: str | None = None  # defaults to the engine's model_name
    max_model_len: int | None = None  # defaults to the engine's max_model_len
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_inflight: int = 256  # generating requests at once; beyond it 429
    # of those, the most one tenant (API key's tenant) holds at once; beyond it 429 for that
    # tenant only. None: no per-tenant bound (a tenant may take all `max_inflight`)
    max_inflight_per_tenant: int | None = None
    max_pending_calls: int = 10_000  # native calls waiting for an engine; beyond it 429
    retry_after_s: int = 1
    max_n: int = 8  # largest `n` (choices per request) accepted
    # Most prompts in one /v1/completions request (a batch: each prompt takes an in-flight
    # slot of `max_inflight`, so the cap is the smaller of the two); beyond it 400.
    max_prompts: int = 64
    max_stop_sequences: int = 16
    max_chat_template_chars: int = 2_000_000  # rendered prompt size cap
    allow_request_chat_template: bool = False  # let requests carry their own template
    sse_ping_s: float = 15.0
    # A streamed OpenAI request whose prompt waits longer than this for the engine (a busy
    # server's queue) gets its response started while it waits: headers, then a ping every
    # `sse_ping_s`, so read timeouts of clients (the openai SDK's is 600 s) and proxies
    # (often 60 s) do not fire. Its prefill's errors then come as an error event.
    stream_start_s: float = 5.0
    sse_send_timeout_s: float | None = 30.0  # a frozen client is dropped after this
    # On server shutdown, streams get this long to finish before they are cancelled.
    shutdown_grace_s: float = 10.0
    manage_engine: bool = False  # lifespan awaits engine.start() / engine.stop()
    # Secret mixed into the tenant-derived prefix-cache salt; never chosen by a client.
    # Random per process: set it explicitly when several server processes share engines.
    salt_secret: bytes = field(default_factory=lambda: secrets.token_bytes(32))

    def __post_init__(self) -> None:
        self.check()

    @property
    def auth_enabled(self) -> bool:
        if self.auth is None:
            return bool(self.api_keys) or self.key_lookup is not None
        return self.auth

    def check(self) -> None:
        """Raise ValueError for settings that must not be served."""
        if not self.auth_enabled and not is_loopback(self.host):
            raise ValueError(
                f"authentication is off but the server would listen on {self.host!r}; "
                "configure API keys or listen on a loopback address (127.0.0.1, ::1)"
            )
        for name in (
            "max_body_bytes",
            "max_inflight",
            "max_pending_calls",
            "max_n",
            "max_prompts",
            "max_stop_sequences",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_inflight_per_tenant is not None and self.max_inflight_per_tenant < 1:
            raise ValueError("max_inflight_per_tenant must be >= 1 (or None: no bound)")
        if self.retry_after_s < 0:
            raise ValueError("retry_after_s must be >= 0")
        if self.stream_start_s < 0:
            raise ValueError("stream_start_s must be >= 0")
        if self.shutdown_grace_s < 0:
            raise ValueError("shutdown_grace_s must be >= 0")
        for key, tenant in self.api_keys.items():
            if not key or not tenant:
                raise ValueError("api_keys entries need a non-empty key and tenant")
