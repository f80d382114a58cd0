"""Fixtures for server tests: a fake engine, in-process clients and a live uvicorn server."""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import uvicorn
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from parrot_backend.server import ServerSettings, create_app
from parrot_backend.testing.fake_engine import FakeEngine

PG_ENV = "PARROT_TEST_DATABASE_URL"
API_KEY = "sk-test-alice"
OTHER_KEY = "sk-test-bob"
KEYS = {API_KEY: "alice", OTHER_KEY: "bob"}
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def settings() -> ServerSettings:
    return ServerSettings(api_keys=dict(KEYS), sse_ping_s=5)


@pytest.fixture
def app(engine, settings):
    return create_app(engine, settings=settings)


@pytest.fixture
async def client(app) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://test", headers=AUTH, timeout=30
    ) as c:
        yield c


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """uvicorn on 127.0.0.1 in a thread: real sockets, so SSE streams and disconnects
    behave as in production (ASGITransport buffers whole responses)."""

    def __init__(self, app) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", timeout_graceful_shutdown=2
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 15
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def live(app) -> Iterator[LiveServer]:
    with LiveServer(app) as server:
        yield server


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.01) -> bool:
    """Poll until `predicate()` holds (True) or `timeout` passes (its last value); the
    timeout is generous: a loaded CI machine may be slow, and a passing wait ends early."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


@pytest.fixture
def pg_database() -> Iterator[str]:
    """A fresh PostgreSQL database for one test (dropped afterwards)."""
    base = os.environ.get(PG_ENV)
    if not base:
        pytest.skip(f"{PG_ENV} unset")
    name = f"parrot_rec_{uuid.uuid4().hex[:10]}"
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(base).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
