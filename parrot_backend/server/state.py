"""What the routes share: the engine, settings, limits and metrics of one app."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from ..contract.engine import EngineClient
from .auth import Authenticator, tenant_salt
from .limits import InflightLimiter
from .metrics import ServerMetrics
from .settings import ServerSettings


@dataclass
class ServerState:
    engine: EngineClient
    settings: ServerSettings
    metrics: ServerMetrics
    limiter: InflightLimiter
    authenticator: Authenticator
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_name(self) -> str:
        return self.settings.served_model_name or self.engine.model_name

    @property
    def max_model_len(self) -> int | None:
        return self.settings.max_model_len or getattr(self.engine, "max_model_len", None)

    @property
    def vocab_size(self) -> int | None:
        return getattr(self.engine, "vocab_size", None)

    @property
    def chat_template(self) -> str | None:
        return getattr(self.engine, "chat_template", None)

    @property
    def special_tokens(self) -> dict[str, str]:
        return dict(getattr(self.engine, "special_tokens", None) or {})

    def salt_for(self, tenant: str) -> str:
        return tenant_salt(self.settings.salt_secret, tenant)


def get_state(request: Request) -> ServerState:
    return request.app.state.parrot


def get_tenant(request: Request) -> str:
    """The tenant the auth middleware resolved (routes behind it always have one)."""
    tenant = getattr(request.state, "tenant", None)
    if tenant is None:  # only open paths lack one, and they never ask
        raise RuntimeError("tenant requested on an unauthenticated path")
    return tenant


StateDep = Annotated[ServerState, Depends(get_state)]
