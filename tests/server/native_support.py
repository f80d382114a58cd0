"""Helpers of the native API tests: a scripted engine, a SQLite store, an app and clients.

(A module name unique across test folders: tests/ dirs are imported as rootdir modules.)
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

from parrot_backend.server import ServerSettings, create_app
from parrot_backend.server.runtime import NativeRuntime
from parrot_backend.store import Store
from parrot_backend.testing.fake_engine import ScriptedEngine

KEYS = {"sk-alice": "alice", "sk-bob": "bob"}
ALICE = {"Authorization": "Bearer sk-alice"}
BOB = {"Authorization": "Bearer sk-bob"}


def echo(prompt: str) -> str:
    """Reply with the prompt's last word in brackets: values show where they came from."""
    words = prompt.split()
    return f"<{words[-1] if words else ''}>"


def run_body(*calls: dict, inputs: dict | None = None, outputs: dict | None = None, **kw) -> dict:
    return {
        "program": {"calls": list(calls), **kw.pop("program_extra", {})},
        "inputs": inputs or {},
        "outputs": outputs or {},
        **kw,
    }


_TEMPLATE: list[Path] = []


def migrated_sqlite(tmp_path: Path) -> str:
    """A fresh, already migrated SQLite database (a copy of one migrated per process:
    running the migrations for every test would dominate the test time)."""
    if not _TEMPLATE:
        path = Path(tempfile.mkdtemp(prefix="parrot-native-")) / "template.db"
        store = Store(f"sqlite:///{path}")
        with store.engine.connect() as conn:  # fold the WAL into the file before copying
            conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
        store.close()
        _TEMPLATE.append(path)
    target = tmp_path / "parrot.db"
    if not target.exists():
        shutil.copy(_TEMPLATE[0], target)
    return f"sqlite:///{target}"


@contextlib.asynccontextmanager
async def native_app(
    tmp_path: Path,
    *,
    engine: ScriptedEngine | None = None,
    url: str | None = None,
    settings: ServerSettings | None = None,
    **runtime_kw,
) -> AsyncIterator[tuple[httpx.AsyncClient, NativeRuntime]]:
    """The app with the native API on a scripted engine, started (the ASGI transport runs
    no lifespan, so the runtime is started here); yields an authenticated client (alice)."""
    engine = engine or ScriptedEngine(reply=echo)
    store = Store(url or migrated_sqlite(tmp_path))
    rt = NativeRuntime(store, {"e0": engine}, worker="test-worker", **runtime_kw)
    settings = settings or ServerSettings(
        api_keys=dict(KEYS), key_lookup=rt.key_lookup, sse_ping_s=5
    )
    app = create_app(engine, settings=settings, native=rt)
    await rt.start()
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://test", headers=ALICE, timeout=30
        ) as client:
            yield client, rt
    finally:
        await rt.stop()
        store.close()


def sse_events(raw: str) -> list[dict]:
    """Parse `id:`/`event:`/`data:` SSE blocks (pings and comments skipped)."""
    out = []
    for block in raw.replace("\r\n", "\n").split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.split("\n"):
            if not line or line.startswith(":"):
                continue
            key, _, value = line.partition(":")
            fields[key] = value[1:] if value.startswith(" ") else value
        if "data" in fields:
            out.append(
                {
                    "id": fields.get("id"),
                    "event": fields.get("event"),
                    "data": json.loads(fields["data"]),
                }
            )
    return out
