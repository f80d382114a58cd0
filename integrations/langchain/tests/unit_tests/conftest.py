"""Unit tests run with sockets off (pytest-socket): they talk to fakes only."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pytest_socket import disable_socket, enable_socket


@pytest.fixture(autouse=True)
def _no_network() -> Iterator[None]:
    # AF_UNIX stays allowed: asyncio's event loop needs a socketpair.
    disable_socket(allow_unix_socket=True)
    yield
    enable_socket()
