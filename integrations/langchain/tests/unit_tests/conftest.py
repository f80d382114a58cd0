"""Unit tests run with sockets off (pytest-socket): they talk to fakes only."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import settings
from pytest_socket import disable_socket, enable_socket

# No per-example deadline: a first example that imports a module can take longer than
# hypothesis's 200 ms on a busy machine, a flaky failure rather than a finding.
settings.register_profile("parrot", parent=settings.default, deadline=None)
settings.load_profile("parrot")


@pytest.fixture(autouse=True)
def _no_network() -> Iterator[None]:
    # AF_UNIX stays allowed: asyncio's event loop needs a socketpair.
    disable_socket(allow_unix_socket=True)
    yield
    enable_socket()
