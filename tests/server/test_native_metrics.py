"""/metrics exports the manager's queue and load when the app serves native runs."""

from __future__ import annotations

from parrot_backend.contract.engine import EngineStats
from parrot_backend.engine.engine import Engine
from parrot_backend.server.metrics import ServerMetrics
from parrot_backend.testing.fake_engine import FakeEngine, block_stats

from .native_support import native_app, run_body, sse_events
from .test_native_api import CHAIN


def _value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


async def test_metrics_count_dispatched_calls_and_shared_prefix_use(tmp_path):
    async with native_app(tmp_path) as (c, _):
        before = (await c.get("/metrics")).text
        assert _value(before, "parrot_manager_calls_dispatched_total") == 0
        rid = (
            await c.post(
                "/v1/runs", json=run_body(*CHAIN, inputs={"x": "go"}, outputs={"z": "latency"})
            )
        ).json()["run_id"]
        assert (
            await c.get(f"/v1/runs/{rid}/variables/z", params={"timeout": 10})
        ).status_code == 200
        after = (await c.get("/metrics")).text
    assert _value(after, "parrot_manager_calls_dispatched_total") == len(CHAIN)
    # native tokens count in the server's token total (it counted only the OpenAI routes)
    native = _value(after, "parrot_manager_tokens_generated_total")
    assert native > 0 and _value(after, "parrot_tokens_generated_total") == native
    assert _value(after, "parrot_manager_pending_calls") == 0
    assert _value(after, "parrot_manager_engines") == 1


SYSTEM = "You are a careful assistant who answers questions about birds in one sentence. "


async def test_metrics_count_tokens_computed_and_prompt_tokens_forked(tiny_model_dir, tmp_path):
    engine = Engine.from_pretrained(tiny_model_dir, num_blocks=256, progress=False)
    calls = [
        {
            "name": f"c{i}",
            "template": SYSTEM + f"Question: {{{{input:q{i}}}}} Answer: {{{{output:a{i}}}}}",
            "outputs": {f"a{i}": {"max_tokens": 4}},
        }
        for i in range(3)
    ]
    inputs = {"q0": "What do parrots eat?", "q1": "Can owls swim?", "q2": "Why sing?"}
    await engine.start()
    try:
        async with native_app(tmp_path, engine=engine) as (c, rt):
            before = (await c.get("/metrics")).text
            assert _value(before, "parrot_engine_tokens_computed_total") == 0
            assert _value(before, "parrot_manager_prefix_fork_tokens_total") == 0
            rid = (await c.post("/v1/runs", json=run_body(*calls, inputs=inputs))).json()["run_id"]
            events = sse_events((await c.get(f"/v1/runs/{rid}/events")).text)
            assert events[-1]["data"]["status"] == "finished", events[-3:]
            after = (await c.get("/metrics")).text
            stats = engine.stats_now()
            table = rt.manager.sharing.table
            [prefix] = [table.get(k) for k in table.held("e0")]
    finally:
        await engine.stop()
    computed = _value(after, "parrot_engine_tokens_computed_total")
    assert computed == stats.tokens_computed > 0
    # the system prompt is one prefix context, filled once; each call forks from it
    forked = _value(after, "parrot_manager_prefix_fork_tokens_total")
    assert forked == 3 * prefix.n_tokens and prefix.n_tokens > 10
    # ... and its tokens are not computed again: at most the prefix once, each call's own
    # prompt tokens and one token per generated one
    prompts = sum(e["data"]["prompt_tokens"] for e in events if e["event"] == "call_finished")
    assert computed <= prefix.n_tokens + prompts - forked + stats.tokens_generated
    # prompt tokens the engine itself reused (token-level cache) keep their own counter
    assert _value(after, "parrot_prefix_cache_hit_tokens_total") == stats.prefix_cache_hits
    # the in-process engine tells prompt tokens from decode tokens: the prefix once plus
    # each call's own prompt tokens, less what its token-level cache served
    prefill = _value(after, "parrot_engine_prefill_tokens_computed_total")
    assert prefill == stats.prefill_tokens_computed
    assert prefill == prefix.n_tokens + prompts - forked - stats.prefix_cache_hits


async def test_metrics_count_the_prompt_tokens_n_choices_fork(tiny_model_dir, tmp_path):
    engine = Engine.from_pretrained(tiny_model_dir, num_blocks=256, progress=False)
    request = {"prompt": SYSTEM + "Question: Can owls swim?", "max_tokens": 4, "n": 3}
    await engine.start()
    try:
        async with native_app(tmp_path, engine=engine) as (c, _):
            before = (await c.get("/metrics")).text
            assert _value(before, "parrot_choice_fork_tokens_total") == 0
            r = await c.post("/v1/completions", json={"model": engine.model_name, **request})
            assert r.status_code == 200, r.text
            after = (await c.get("/metrics")).text
            stats = engine.stats_now()
    finally:
        await engine.stop()
    usage = r.json()["usage"]
    assert len(r.json()["choices"]) == 3 and usage["prompt_tokens"] > 10
    # the prompt is filled once; each of the three choices forks its context
    forked = _value(after, "parrot_choice_fork_tokens_total")
    assert forked == 3 * usage["prompt_tokens"]
    assert stats.tokens_computed <= usage["prompt_tokens"] + usage["completion_tokens"]
    assert _value(after, "parrot_manager_prefix_fork_tokens_total") == 0  # no native run


async def test_prefill_tokens_are_exported_when_the_engine_counts_them():
    counted, uncounted = FakeEngine(), FakeEngine()

    async def counting() -> EngineStats:
        return block_stats(16, 1600, 0, tokens_computed=30, prefill_tokens_computed=24)

    counted.stats = counting
    text = (await ServerMetrics().render(counted)).decode()
    assert _value(text, "parrot_engine_tokens_computed_total") == 30
    assert _value(text, "parrot_engine_prefill_tokens_computed_total") == 24
    # an engine that does not tell prompt tokens from decode tokens gets no series, not a 0
    text = (await ServerMetrics().render(uncounted)).decode()
    assert "parrot_engine_prefill_tokens_computed" not in text
    assert "parrot_engine_draft_tokens" not in text  # nor one that does not draft
    assert "parrot_engine_prompt_scores_reused" not in text  # nor one that keeps no scores


async def test_prompt_scores_reused_are_exported_when_the_engine_keeps_scores():
    keeping = FakeEngine()

    async def stats() -> EngineStats:
        return block_stats(16, 1600, 0, prompt_scores_reused=47)

    keeping.stats = stats
    text = (await ServerMetrics().render(keeping)).decode()
    assert _value(text, "parrot_engine_prompt_scores_reused_total") == 47


async def test_draft_tokens_are_exported_when_the_engine_drafts():
    drafting = FakeEngine()

    async def stats() -> EngineStats:
        return block_stats(16, 1600, 0, draft_tokens=40, draft_tokens_accepted=25)

    drafting.stats = stats
    text = (await ServerMetrics().render(drafting)).decode()
    assert _value(text, "parrot_engine_draft_tokens_total") == 40
    assert _value(text, "parrot_engine_draft_tokens_accepted_total") == 25


async def test_new_work_gets_429_while_the_backlog_is_full(tmp_path):
    import asyncio

    from parrot_backend.manager.manager import ManagerConfig
    from parrot_backend.manager.policy import PolicyConfig
    from parrot_backend.server import ServerSettings
    from parrot_backend.testing.fake_engine import ScriptedEngine

    from .native_support import KEYS, echo

    gate = asyncio.Event()  # the engine holds its one call: later calls wait in the queue
    settings = ServerSettings(api_keys=dict(KEYS), max_pending_calls=2, retry_after_s=3)
    async with native_app(
        tmp_path,
        engine=ScriptedEngine(reply=echo, gate=gate),
        settings=settings,
        manager_config=ManagerConfig(policy=PolicyConfig(max_batch=1)),
    ) as (c, rt):
        statuses = []
        for _ in range(6):
            r = await c.post("/v1/runs", json=run_body(*CHAIN, inputs={"x": "go"}))
            statuses.append(r.status_code)
            if r.status_code == 429:
                assert r.headers["Retry-After"] == "3"
                assert "retry later" in r.json()["error"]["message"]
            await asyncio.sleep(0.05)  # let the dispatcher place what it can
        assert statuses[0] == 201 and 429 in statuses, statuses
        assert rt.manager.counts()["pending_calls"] <= 2 + 1
        assert (await c.get("/v1/runs")).status_code == 200  # reads are never refused
        gate.set()
