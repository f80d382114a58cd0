"""Long polls of a live run's variables read the store once together: a fan-out's
outputs, answered at once, take one read of the run's variables (`read_variable`), and
each answer equals what the store's own per-variable read gives; the polls read no run
record (the manager holds the run). An unknown variable and another tenant's run stay
404s."""

from __future__ import annotations

import asyncio

from parrot_backend.testing.fake_engine import ScriptedEngine

from .native_support import BOB, echo, native_app, run_body

FAN = 6


async def test_a_fan_outs_long_polls_share_one_store_read(tmp_path) -> None:
    gate = asyncio.Event()
    engine = ScriptedEngine(reply=echo, gate=gate)
    async with native_app(tmp_path, engine=engine) as (c, rt):
        body = run_body(
            *(
                {"name": f"m{i}", "template": f"Part {i} of {{{{input:x}}}} {{{{output:p{i}}}}}"}
                for i in range(FAN)
            ),
            inputs={"x": "doc"},
            outputs={f"p{i}": "latency" for i in range(FAN)},
        )
        rid = (await c.post("/v1/runs", json=body)).json()["run_id"]
        reads: list[str] = []
        many: list[str] = []
        one, all_ = rt.store.get_variable, rt.store.get_variables

        def get_variable(tenant_id, run_id, name):
            reads.append(name)
            return one(tenant_id, run_id, name)

        def get_variables(tenant_id, run_id):
            many.append(run_id)
            return all_(tenant_id, run_id)

        runs_read: list[str] = []
        whole = rt.store.get_run

        def get_run(tenant_id, run_id):
            runs_read.append(run_id)
            return whole(tenant_id, run_id)

        rt.store.get_variable = get_variable  # type: ignore[method-assign]
        rt.store.get_variables = get_variables  # type: ignore[method-assign]
        rt.store.get_run = get_run  # type: ignore[method-assign]
        polls = [
            asyncio.create_task(c.get(f"/v1/runs/{rid}/variables/p{i}", params={"timeout": 20}))
            for i in range(FAN)
        ]
        run = rt.manager.runs[rid]
        for _ in range(6000):  # every call generating (held), every poll waiting
            if len(engine.generations) == FAN and all(f"p{i}" in run.futures for i in range(FAN)):
                break
            await asyncio.sleep(0.005)
        # another tenant's poll of the live run: a 404, as for a missing run
        other = await c.get(f"/v1/runs/{rid}/variables/p0", params={"timeout": 1}, headers=BOB)
        assert other.status_code == 404
        gate.set()  # the calls end together: their values are committed as one group
        answers = [(await p).json() for p in polls]
        assert [a["status"] for a in answers] == ["ready"] * FAN
        assert reads == []
        # the polls checked the live run's tenant in memory (only bob's poll read the run)
        assert runs_read == [rid]
        assert 1 <= len(many) < FAN  # shared: fewer reads than polls (one when they coincide)
        tenant = await rt.tenant_id("alice")
        for i, a in enumerate(answers):
            stored = one(tenant, rid, f"p{i}")
            assert a["value"] == stored.value == "<doc>"
            assert a["producer_call"] == stored.producer_call
            assert a["set_at"] is not None
        # a finished run's variable: answered after the manager forgets it as before
        again = await c.get(f"/v1/runs/{rid}/variables/p0", params={"timeout": 1})
        assert again.json()["value"] == answers[0]["value"]
        missing = await c.get(f"/v1/runs/{rid}/variables/nope", params={"timeout": 1})
        assert missing.status_code == 404
        other = await c.get(f"/v1/runs/{rid}/variables/p0", params={"timeout": 1}, headers=BOB)
        assert other.status_code == 404
