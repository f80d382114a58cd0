"""Bearer API keys, checked in an ASGI middleware so every route is closed by default.

A route added later (the native API, the engine API) is protected without anyone
remembering a dependency; only the paths in `OPEN_PATHS` (and the web page's static files
under `UI_STATIC_PREFIX`) answer without a key.

One exception for browsers: `EventSource` cannot send an Authorization header, so a
run's event stream (`GET /v1/runs/{id}/events`, that route only) also accepts an
*events grant*: a cookie minted by an authenticated `POST /v1/runs/{id}/events/grant`
(`ui.py`), HMAC-signed by the server, naming one tenant and one run, valid for
`GRANT_TTL_S` seconds, HttpOnly, SameSite=Strict and sent only on that run's events path.
The API key itself never travels in a URL, so it never lands in access logs.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import inspect
import json
import re
import time
from collections.abc import Iterable

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import error_body
from .settings import ServerSettings

OPEN_PATHS = frozenset(
    {"/healthz", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json", "/", "/ui", "/ui/"}
)
UI_STATIC_PREFIX = "/ui/static/"  # the web page's files (no data: the page asks for a key)
# routes that check the operator key themselves (engine registration): tenant keys are not
# what protects them, so the tenant middleware lets them through to that check
OPERATOR_PREFIX = "/v1/engines"
LOCAL_TENANT = "local"  # the tenant of every request when auth is off (loopback only)


_TENANT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def key_tenant(key: str) -> str:
    """The tenant of a static key given without a name: derived from the key itself, so
    it stays the same across restarts whatever the order or number of keys."""
    return "key-" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def parse_api_keys(values: Iterable[str]) -> dict[str, str]:
    """`--api-key` values -> {key: tenant}. `TENANT=KEY` names the tenant (several keys
    may share one: key rotation); a bare `KEY` gets `key_tenant(KEY)`. A value is read as
    `TENANT=KEY` when the text before its first `=` is a tenant name (1-64 letters,
    digits, `_ . -`), so a bare key containing `=` must be given with its tenant.
    Raises ValueError for an empty key or a key given for two tenants."""
    keys: dict[str, str] = {}
    for value in values:
        name, sep, rest = value.partition("=")
        if sep and rest and _TENANT_NAME.fullmatch(name):
            tenant, key = name, rest
        else:
            tenant, key = key_tenant(value), value
        if not key.strip():
            raise ValueError("an API key must not be empty")
        if keys.get(key, tenant) != tenant:
            raise ValueError(f"one API key is given for two tenants ({keys[key]!r}, {tenant!r})")
        keys[key] = tenant
    return keys


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


GRANT_COOKIE = "parrot_events"
GRANT_TTL_S = 120  # short: a grant is checked when a stream (re)connects, the page renews it
_EVENTS_PATH = re.compile(r"/v1/runs/([0-9a-f]{32})/events")
_GRANT_CONTEXT = b"parrot-events-grant/1"


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def grant_key(secret: bytes) -> bytes:
    """The HMAC key of events grants, derived from the server's secret (`salt_secret`) so
    it is never the salt itself; servers sharing that secret accept each other's grants."""
    return hmac.new(secret, _GRANT_CONTEXT, hashlib.sha256).digest()


def mint_events_grant(
    key: bytes, tenant: str, run_id: str, *, ttl_s: float = GRANT_TTL_S, now: float | None = None
) -> str:
    """A signed grant to read `run_id`'s events as `tenant` until `now + ttl_s`."""
    expires = int((time.time() if now is None else now) + ttl_s)
    body = _b64(
        json.dumps({"t": tenant, "r": run_id, "e": expires}, separators=(",", ":")).encode(
            "utf-8", "surrogatepass"
        )
    )
    sig = _b64(hmac.new(key, body.encode("ascii"), hashlib.sha256).digest())
    return f"{body}.{sig}"


def events_grant_tenant(
    key: bytes, token: str | None, run_id: str, *, now: float | None = None
) -> str | None:
    """The tenant of a valid, unexpired grant for `run_id`; None for anything else
    (forged, altered, expired, for another run, malformed)."""
    if not token or token.count(".") != 1 or len(token) > 2048:
        return None
    body, sig = (part.encode("utf-8", "surrogatepass") for part in token.split("."))
    want = _b64(hmac.new(key, body, hashlib.sha256).digest()).encode("ascii")
    if not hmac.compare_digest(sig, want):  # bytes: any text compares, in constant time
        return None
    try:
        claims = json.loads(_unb64(body.decode("ascii")))
    except ValueError:
        return None
    if not isinstance(claims, dict) or claims.get("r") != run_id:
        return None
    expires, tenant = claims.get("e"), claims.get("t")
    if not isinstance(expires, int) or not isinstance(tenant, str) or not tenant:
        return None
    if (time.time() if now is None else now) >= expires:
        return None
    return tenant


class Authenticator:
    """Resolves a bearer key to a tenant through the static keys, then the pluggable lookup."""

    def __init__(self, settings: ServerSettings) -> None:
        self.enabled = settings.auth_enabled
        # Look keys up by digest so the dict probe does not compare secrets byte by byte.
        self._keys = {_digest(k): tenant for k, tenant in settings.api_keys.items()}
        self._lookup = settings.key_lookup
        self.grant_key = grant_key(settings.salt_secret)

    async def tenant_for(self, key: str | None) -> str | None:
        if not self.enabled:
            return LOCAL_TENANT
        if not key:
            return None
        tenant = self._keys.get(_digest(key))
        if tenant is not None:
            return tenant
        if self._lookup is not None:
            found = self._lookup(key)
            if inspect.isawaitable(found):
                found = await found
            return found or None
        return None


def bearer_key(header: str | None) -> str | None:
    """The key of an `Authorization: Bearer <key>` header, or None."""
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    if not hmac.compare_digest(scheme.lower(), "bearer"):
        return None
    return value.strip() or None


class AuthMiddleware:
    """Rejects requests without a valid key (401) and stores the tenant in `request.state`."""

    def __init__(self, app: ASGIApp, *, authenticator: Authenticator, on_reject=None) -> None:
        self.app = app
        self.authenticator = authenticator
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        path = scope["path"]
        if (
            path in OPEN_PATHS
            or path.startswith(UI_STATIC_PREFIX)
            or path == OPERATOR_PREFIX
            or path.startswith(OPERATOR_PREFIX + "/")
        ):
            state["tenant"] = None
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        if len(request.headers.getlist("authorization")) > 1:
            # which one counts would be up to each proxy on the way: none does
            if self.on_reject is not None:
                self.on_reject("auth")
            await _send_401(scope, send, False, "more than one Authorization header: send one")
            return
        header = request.headers.get("authorization")
        tenant = await self.authenticator.tenant_for(bearer_key(header))
        if tenant is None and header is None and scope.get("method") == "GET":
            # a browser's EventSource: an events grant, for the events route only
            match = _EVENTS_PATH.fullmatch(path)
            if match is not None and GRANT_COOKIE in request.cookies:
                tenant = events_grant_tenant(
                    self.authenticator.grant_key, request.cookies[GRANT_COOKIE], match.group(1)
                )
                if tenant is None:
                    if self.on_reject is not None:
                        self.on_reject("auth")
                    await _send_401(scope, send, False, "invalid or expired events grant")
                    return
        if tenant is None:
            if self.on_reject is not None:
                self.on_reject("auth")
            await _send_401(scope, send, header is None)
            return
        state["tenant"] = tenant
        await self.app(scope, receive, send)


async def _send_401(scope: Scope, send: Send, missing: bool, message: str | None = None) -> None:
    message = message or (
        "missing API key: send 'Authorization: Bearer <key>'" if missing else "invalid API key"
    )
    body = json.dumps(error_body(message, "authentication_error", None, "invalid_api_key"))
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})
        return
    await send(
        {
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"www-authenticate", b'Bearer realm="parrot"'),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body.encode()})


def tenant_salt(secret: bytes, tenant: str) -> str:
    """The prefix-cache salt for a tenant: derived by the server, never chosen by a client,
    so one tenant cannot probe another's cached prefixes through timing."""
    digest = hmac.new(secret, tenant.encode("utf-8", "surrogatepass"), hashlib.sha256)
    return digest.hexdigest()[:32]
