"""HTTP server: the OpenAI-compatible API, the native Parrot API, the engine API and the
web page, over the manager and its engines."""

from __future__ import annotations

from .app import create_app
from .settings import ServerSettings

__all__ = ["ServerSettings", "create_app"]
