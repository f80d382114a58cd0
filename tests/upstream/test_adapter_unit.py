"""The upstream adapter's bookkeeping against a scripted server (httpx MockTransport): the
context tree, whole prompts as token ids, warm-up before fan-out, cancel, errors, stats."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from parrot_backend.contract.errors import (
    ContextBusy,
    ContextNotFound,
    EngineUnavailable,
    InvalidRequest,
)
from parrot_backend.contract.sampling import Constraint, SamplingParams
from parrot_backend.engines.upstream import UpstreamEngine, connect_all
from parrot_backend.engines.upstream.metrics import read_load

from .fake_upstream import EOS, CharTokenizer, FakeUpstream


async def connect(fake: FakeUpstream, **kw) -> UpstreamEngine:
    if fake.kind != "llama.cpp":
        kw.setdefault("tokenizer", CharTokenizer())
    return await UpstreamEngine.connect(
        "http://up:1/v1", transport=fake.transport(), sync_transport=fake.sync_transport(), **kw
    )


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


async def run(engine, ctx, parent=None, **sampling) -> list:
    return [d async for d in engine.generate(ctx, parent, SamplingParams(**sampling))]


async def test_connect_reads_what_llama_cpp_says() -> None:
    fake = FakeUpstream(n_ctx=300, slots=3)
    engine = await connect(fake)
    assert (engine.kind, engine.model_name) == ("llama.cpp", "fake-model")
    assert engine.max_model_len == 300
    assert engine.vocab_size == 256 and engine.eos_ids == {ord(EOS)}
    assert engine.capacity_tokens == 900  # slots x per-slot context
    assert engine.tokenize("hi") == ids("hi")  # the server's /tokenize
    await engine.aclose()


async def test_generate_sends_the_whole_prompt_of_a_forked_context() -> None:
    fake = FakeUpstream()
    engine = await connect(fake, warm_prefixes=False)
    assert await engine.fill("p", None, ids("system: ")) == 8
    assert await engine.fill("c", "p", ids("hello ")) == 14
    deltas = await run(engine, "c", max_tokens=3)
    [(path, body)] = fake.requests
    assert path == "/completion" and body["prompt"] == ids("system: hello ")
    assert body["n_predict"] == 3 and body["return_tokens"] and body["cache_prompt"]
    assert body["temperature"] == 0 and body["min_p"] == 0 and body["repeat_penalty"] == 1
    assert body["presence_penalty"] == body["frequency_penalty"] == 0
    assert "repeat_last_n" not in body
    assert [d.token_id for d in deltas] == [*ids("abc"), None]
    assert "".join(d.text for d in deltas) == "abc" and deltas[-1].finish_reason == "length"
    # the generated tokens stay in the context; the parent is untouched
    assert engine.tree.get("c").tokens == ids("system: hello abc")
    assert engine.tree.get("p").tokens == ids("system: ")
    await engine.aclose()


async def test_eos_ends_with_stop_and_stays_out_of_the_context() -> None:
    fake = FakeUpstream()
    fake.script = lambda prompt, n: ids("ok" + EOS)
    engine = await connect(fake)
    await engine.fill("c", None, ids("q"))
    deltas = await run(engine, "c", max_tokens=10)
    assert deltas[-1].finish_reason == "stop"
    assert "".join(d.text for d in deltas) == "ok"
    assert engine.tree.get("c").tokens == ids("qok")
    await engine.aclose()


async def test_stop_token_ids_are_honoured_by_the_adapter_on_llama_cpp() -> None:
    fake = FakeUpstream()
    fake.delay = 0.01
    engine = await connect(fake)
    await engine.fill("c", None, ids("q"))
    deltas = await run(engine, "c", max_tokens=20, stop_token_ids=[ord("d")])
    assert [d.text for d in deltas] == ["a", "b", "c", ""]
    assert deltas[-1].token_id == ord("d") and deltas[-1].finish_reason == "stop"
    assert engine.tree.get("c").tokens == ids("qabc")
    assert fake.cancelled == 1  # the rest of the upstream stream was closed
    await engine.aclose()


async def test_sampling_and_max_tokens_are_sent_and_capped_by_the_context() -> None:
    fake = FakeUpstream(n_ctx=20)
    engine = await connect(fake)
    await engine.fill("c", None, ids("0123456789abcdef"))  # 16 of 20 tokens
    await run(
        engine,
        "c",
        max_tokens=50,
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        seed=2**40 + 7,
        stop=["x"],
        ignore_eos=True,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
    )
    body = fake.requests[-1][1]
    assert body["n_predict"] == 4  # what is left of the slot's context
    assert (body["presence_penalty"], body["frequency_penalty"]) == (0.5, -0.25)
    assert body["repeat_last_n"] == -1 and body["repeat_penalty"] == 1
    assert (body["temperature"], body["top_p"], body["top_k"]) == (0.7, 0.9, 5)
    assert body["seed"] == 7 and body["stop"] == ["x"] and body["ignore_eos"] is True
    await engine.fill("full", None, ids("x" * 20))
    with pytest.raises(InvalidRequest, match="no room"):
        await run(engine, "full")
    with pytest.raises(InvalidRequest, match="would hold"):
        await engine.fill("c", None, ids("y" * 30))
    await engine.aclose()


async def test_constraints_llama_cpp_gets_json_schema_and_choice_grammar() -> None:
    fake = FakeUpstream()
    engine = await connect(fake)
    await engine.fill("c", None, ids("q"))
    schema = Constraint("json_schema", '{"type": "object"}')
    await run(engine, "c", max_tokens=2, constraint=schema)
    assert fake.requests[-1][1]["json_schema"] == {"type": "object"}
    await engine.fill("d", None, ids("q"))
    await run(engine, "d", max_tokens=2, constraint=Constraint("choice", ("yes", "no")))
    assert fake.requests[-1][1]["grammar"] == 'root ::= "yes" | "no"'
    await engine.fill("e", None, ids("q"))
    with pytest.raises(InvalidRequest, match="regex"):
        await run(engine, "e", constraint=Constraint("regex", "a+"))
    await engine.aclose()


async def test_context_tree_rules_follow_the_in_process_engine() -> None:
    fake = FakeUpstream()
    engine = await connect(fake)
    await engine.fill("p", None, ids("root"))
    await engine.fill("c", "p", ids("x"))
    with pytest.raises(ContextBusy):
        await engine.free("p")  # a live child
    with pytest.raises(InvalidRequest, match="different parent"):
        await engine.fill("c", "other", ids("y"))
    with pytest.raises(ContextNotFound):
        await engine.fill("d", "nope", ids("y"))
    with pytest.raises(ContextNotFound):
        await run(engine, "never")
    await engine.fill("empty", None, [])
    with pytest.raises(InvalidRequest, match="empty"):
        await run(engine, "empty")
    with pytest.raises(InvalidRequest, match="vocabulary"):
        await engine.fill("e", None, [300])
    await engine.free("c")
    await engine.free("p")
    with pytest.raises(ContextNotFound):
        await engine.free("p")
    assert len(engine.tree) == 1  # "empty"
    assert await engine.reset() == 1 and len(engine.tree) == 0
    await engine.aclose()


async def test_a_context_is_busy_while_it_generates_and_free_after() -> None:
    fake = FakeUpstream()
    fake.delay = 0.01
    engine = await connect(fake)
    await engine.fill("c", None, ids("q"))
    stream = engine.generate("c", None, SamplingParams(max_tokens=50))
    await anext(stream)
    with pytest.raises(ContextBusy):
        await engine.free("c")
    await stream.aclose()
    assert fake.cancelled == 1  # closing our stream closed the upstream's
    assert engine.tree.get("c").tokens == ids("qa")  # what was generated so far stays
    assert engine.stats_now().running == 0 or engine.running == 0
    await engine.free("c")
    await engine.aclose()


async def test_fan_out_waits_for_one_warm_up_of_the_shared_prefix() -> None:
    fake = FakeUpstream()
    fake.warm_gate = asyncio.Event()
    engine = await connect(fake, warm_prefixes=True)
    prefix = ids("You are a helpful assistant. ")
    await engine.fill("p", None, prefix)
    assert fake.requests == []  # a fill sends nothing

    async def child(i: int) -> str:
        await engine.fill(f"c{i}", "p", ids(f"q{i} "))
        return "".join(d.text for d in await run(engine, f"c{i}", max_tokens=2))

    tasks = [asyncio.create_task(child(i)) for i in range(5)]
    for _ in range(6000):  # the warm-up is sent (however loaded the machine)
        if fake.requests:
            break
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.05)  # and the children have had time to send (they must not)
    # one warm-up of exactly the prefix, and no child sent before it is done
    assert [(p, b["prompt"], b["stream"]) for p, b in fake.requests] == [
        ("/completion", prefix, False)
    ]
    fake.warm_gate.set()
    assert await asyncio.gather(*tasks) == ["ab"] * 5
    warm, *children = fake.requests
    assert warm[1]["n_predict"] == 0
    assert sorted(b["prompt"] for _, b in children) == sorted(
        prefix + ids(f"q{i} ") for i in range(5)
    )
    assert engine.warmups == 1
    # a later fork of the same prefix is not warmed again
    await engine.fill("late", "p", ids("z"))
    assert len(fake.requests) == 6
    await engine.aclose()


async def test_short_prefixes_and_unforked_contexts_are_not_warmed() -> None:
    fake = FakeUpstream()
    engine = await connect(fake)
    await engine.fill("p", None, ids("short"))  # under warm_min_tokens
    await engine.fill("c", "p", ids("x"))
    await run(engine, "c", max_tokens=1)
    await engine.fill("alone", None, ids("a long prompt that nobody forks at all"))
    await run(engine, "alone", max_tokens=1)
    assert [b["stream"] for _, b in fake.requests] == [True, True]
    await engine.aclose()


async def test_a_failed_warm_up_does_not_fail_the_children() -> None:
    fake = FakeUpstream()
    engine = await connect(fake)
    fake.fail["/completion"] = [500]
    await engine.fill("p", None, ids("a prefix long enough to be warmed"))
    await engine.fill("c", "p", ids("x"))
    assert "".join(d.text for d in await run(engine, "c", max_tokens=2)) == "ab"
    assert engine.warmups == 0
    await engine.aclose()


@pytest.mark.parametrize(
    "status, error",
    [
        (400, InvalidRequest),
        (413, InvalidRequest),
        (500, EngineUnavailable),
        (503, EngineUnavailable),
        (401, EngineUnavailable),
        (404, EngineUnavailable),
    ],
)
async def test_error_answers_map_onto_the_contract(status, error) -> None:
    fake = FakeUpstream()
    engine = await connect(fake)
    await engine.fill("c", None, ids("q"))
    fake.fail["/completion"] = [status]
    with pytest.raises(error):
        await run(engine, "c")
    await engine.aclose()


async def test_429_is_retried() -> None:
    fake = FakeUpstream()
    engine = await connect(fake)
    await engine.fill("c", None, ids("q"))
    fake.fail["/completion"] = [429, 429]
    assert "".join(d.text for d in await run(engine, "c", max_tokens=2)) == "ab"
    await engine.aclose()


async def test_a_dead_or_broken_upstream_is_unavailable() -> None:
    fake = FakeUpstream()
    engine = await connect(fake)
    await engine.fill("c", None, ids("q"))
    fake.cut_after = 2  # the stream ends before its last event
    with pytest.raises(EngineUnavailable, match="before the end"):
        await run(engine, "c", max_tokens=5)
    fake.cut_after = None
    fake.down = True
    with pytest.raises(EngineUnavailable):
        await run(engine, "c", max_tokens=5)
    engine._scraped_at = float("-inf")
    await engine._refresh()
    with pytest.raises(EngineUnavailable):
        await engine.stats()
    fake.down = False
    await engine._refresh()
    assert (await engine.stats()).blocks_total == engine.capacity_tokens
    await engine.aclose()
    with pytest.raises(EngineUnavailable):
        await engine.fill("x", None, [1])


async def test_stats_combine_upstream_metrics_with_own_reservations() -> None:
    fake = FakeUpstream(n_ctx=100, slots=2)
    engine = await connect(fake)
    stats = await engine.stats()
    assert (stats.running, stats.waiting, stats.block_size, stats.blocks_total) == (1, 3, 1, 200)
    fake.delay = 0.01
    await engine.fill("c", None, ids("0123456789"))
    stream = engine.generate("c", None, SamplingParams(max_tokens=30))
    await anext(stream)
    assert engine.stats_now().blocks_used == 40  # prompt + max new tokens, in flight
    await stream.aclose()
    assert engine.stats_now().blocks_used == 0
    await engine.aclose()


async def test_stats_count_the_prompt_tokens_the_upstream_computed() -> None:
    fake = FakeUpstream()  # it reports 2 of every prompt's tokens as cached
    engine = await connect(fake, warm_prefixes=False)
    await engine.fill("c", None, ids("0123456789"))
    await run(engine, "c", max_tokens=3)
    stats = engine.stats_now()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (10, 2)
    assert stats.prefill_tokens_computed == 8
    assert stats.tokens_computed == 8 + stats.tokens_generated
    await engine.aclose()


async def test_openai_upstream_streams_text_and_retokenizes_into_the_context() -> None:
    fake = FakeUpstream(kind="parrot", n_ctx=64)
    engine = await connect(fake)
    assert engine.kind == "parrot" and engine.max_model_len == 64
    await engine.fill("c", None, ids("hi "))
    deltas = await run(engine, "c", max_tokens=3, seed=5, stop=["\n"])
    path, body = fake.requests[-1]
    assert path == "/v1/completions" and body["prompt"] == ids("hi ")
    assert body["max_tokens"] == 3 and body["model"] == "fake-model" and body["seed"] == 5
    assert "return_token_ids" not in body and "cache_salt" not in body  # vLLM only
    assert [d.token_id for d in deltas] == [None] * 3
    assert "".join(d.text for d in deltas) == "abc" and deltas[-1].finish_reason == "length"
    assert engine.tree.get("c").tokens == ids("hi abc")
    assert engine.prompt_tokens == 3  # from the usage chunk after the last delta
    await engine.aclose()


async def test_an_upstream_without_tokenize_needs_a_local_tokenizer() -> None:
    fake = FakeUpstream(kind="parrot")
    with pytest.raises(ValueError, match="local tokenizer"):
        await UpstreamEngine.connect("http://up:1/v1", transport=fake.transport())


def test_metrics_of_each_server_kind() -> None:
    vllm = read_load(
        'vllm:num_requests_running{model_name="m"} 3\n'
        'vllm:num_requests_waiting{model_name="m"} 2\n'
        'vllm:kv_cache_usage_perc{model_name="m"} 0.25\n'
        'vllm:prefix_cache_hits_total{model_name="m"} 40\n'
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="1000"} 1\n'
    )
    assert (vllm.running, vllm.waiting, vllm.kv_usage, vllm.kv_tokens) == (3, 2, 0.25, 16000)
    assert vllm.prefix_hits == 40
    sgl = read_load(
        '# HELP x\nsglang:num_running_reqs{tp_rank="0"} 4\n'
        'sglang:num_queue_reqs{tp_rank="0"} 1\nsglang:token_usage 0.5\n'
        "sglang:max_total_num_tokens 5000\n"
    )
    assert (sgl.running, sgl.waiting, sgl.kv_usage, sgl.kv_tokens) == (4, 1, 0.5, 5000)
    ours = read_load(
        "parrot_engine_running 2\nparrot_kv_blocks_total 10\nparrot_kv_blocks_used 5\n"
    )
    assert (ours.running, ours.kv_usage) == (2, 0.5)
    assert read_load("garbage line\n").running is None


async def test_connect_all_shares_one_tokenizer_that_survives_its_first_server() -> None:
    fakes = {"a": FakeUpstream(), "b": FakeUpstream()}

    async def route(request):
        return await fakes[request.url.host].handle(request)

    def route_sync(request):
        return fakes[request.url.host].handle_sync(request)

    a, b = await connect_all(
        ["http://a:1/v1", "http://b:1/v1"],
        transport=httpx.MockTransport(route),
        sync_transport=httpx.MockTransport(route_sync),
    )
    assert a._tok is b._tok
    fakes["a"].down = True
    assert a.tokenize("new text") == ids("new text")  # answered by the second server
    fakes["b"].down = True
    with pytest.raises(EngineUnavailable):
        a.tokenize("more new text")
    await a.aclose()
    await b.aclose()
