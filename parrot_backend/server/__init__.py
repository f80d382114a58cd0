"""HTTP server: the OpenAI-compatible API (and later the native Parrot API) over an engine."""

from __future__ import annotations

from .app import create_app
from .settings import ServerSettings

__all__ = ["ServerSettings", "create_app"]
