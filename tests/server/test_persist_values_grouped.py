"""StorePersister.on_values: several values of a run (a fan-out's calls ending together)
in one transaction, after the run's buffered events; a failed write fails them all and
loses nothing buffered."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest

from parrot_backend.program import ProgramSpec
from parrot_backend.server.notify import Notifier
from parrot_backend.server.persist import RunMeta, StorePersister
from parrot_backend.store import Store

from .native_support import migrated_sqlite

PROGRAM = ProgramSpec.model_validate(
    {
        "calls": [
            {"name": f"m{i}", "template": f"M{i} {{{{input:x}}}} {{{{output:p{i}}}}}"}
            for i in range(3)
        ]
    }
).model_dump(mode="json")
OUTPUTS = {f"p{i}": "latency" for i in range(3)}


@contextlib.asynccontextmanager
async def started(tmp_path) -> AsyncIterator[tuple[Store, int, StorePersister]]:
    """A persister (flushing only when told) with run r1 created, its 3 calls started and
    a token of each buffered."""
    store = Store(migrated_sqlite(tmp_path))
    tenant = store.ensure_tenant("t").id
    p = StorePersister(store, "w", Notifier(), flush_interval_s=3600)
    p.start()
    try:
        p.expect("r1", RunMeta(tenant))
        created = {"program": PROGRAM, "inputs": {"x": "1"}, "outputs": OUTPUTS, "open": False}
        await p.on_event("r1", "run_created", created)
        for i in range(3):
            await p.on_event("r1", "call_started", {"call": f"m{i}", "engine": "e0"})
        for i in range(3):
            await p.on_event("r1", "token", {"call": f"m{i}", "variable": f"p{i}", "text": "v"})
        yield store, tenant, p
    finally:
        await p.stop()
        store.close()


def values(*names: str) -> list[dict]:
    return [{"name": n, "value": f"v{n}", "source": "call", "call": "m" + n[1:]} for n in names]


async def test_values_of_a_group_are_one_transaction_after_the_buffered_events(
    tmp_path,
) -> None:
    async with started(tmp_path) as (store, tenant, p):
        commits: list[object] = []
        real = store.set_variables

        def counted(*args, **kw):
            commits.append(args[1])
            return real(*args, **kw)

        store.set_variables = counted  # type: ignore[method-assign]
        await p.on_values("r1", values("p0", "p1", "p2"))
        assert commits == [{"p0": "vp0", "p1": "vp1", "p2": "vp2"}]  # one store call
        assert p.runs["r1"].buffered == []
        events = store.read_events(tenant, "r1")
        assert [e.type for e in events][-6:] == ["token"] * 3 + ["variable_ready"] * 3
        assert [e.payload["name"] for e in events[-3:]] == ["p0", "p1", "p2"]
        detail = store.get_run(tenant, "r1")
        assert {n: v.value for n, v in detail.variables.items() if n != "x"} == {
            "p0": "vp0",
            "p1": "vp1",
            "p2": "vp2",
        }


async def test_a_failed_group_fails_every_value_and_keeps_what_was_buffered(tmp_path) -> None:
    async with started(tmp_path) as (store, tenant, p):
        real = store.set_variables

        def broken(*args, **kw):
            raise RuntimeError("database hiccup")

        store.set_variables = broken  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="hiccup"):
            await p.on_values("r1", values("p0", "p1"))
        # the tokens go back to the buffer; the failed values are not kept
        assert [t for t, _ in p.runs["r1"].buffered] == ["token"] * 3
        assert all(e.type != "variable_ready" for e in store.read_events(tenant, "r1"))

        store.set_variables = real  # type: ignore[method-assign]
        await p.on_values("r1", values("p0", "p1", "p2"))
        types = [e.type for e in store.read_events(tenant, "r1")]
        assert types[-6:] == ["token"] * 3 + ["variable_ready"] * 3
        assert types.count("variable_ready") == 3


async def test_a_value_stored_before_is_not_logged_again(tmp_path) -> None:
    async with started(tmp_path) as (store, tenant, p):
        await p.on_event("r1", "variable_ready", values("p0")[0])
        await p.on_values("r1", values("p0", "p1"))
        names = [
            e.payload["name"] for e in store.read_events(tenant, "r1") if e.type == "variable_ready"
        ]
        assert names == ["p0", "p1"]
