"""Sampling controls, streaming text, and bad input that must not stop the engine."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from parrot_backend.contract.errors import (
    ContextBusy,
    ContextNotFound,
    InvalidRequest,
    OutOfMemory,
)
from parrot_backend.contract.sampling import SamplingParams
from parrot_backend.engine.detokenizer import Detokenizer
from parrot_backend.engine.engine import Engine

from .helpers import collect, complete


@pytest.fixture
def engine(tiny_model_dir):
    return Engine.from_pretrained(tiny_model_dir, num_blocks=64, progress=False)


def _prompt(n=12, seed=0):
    return torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_max_tokens_limits_and_reports_length(engine):
    async def go():
        async with engine:
            await engine.fill("a", None, _prompt())
            return await collect(engine, "a", None, SamplingParams(max_tokens=5, ignore_eos=True))

    tokens, _, deltas = asyncio.run(go())
    assert len(tokens) == 5
    assert deltas[-1].finish_reason == "length"
    assert all(d.finish_reason is None for d in deltas[:-1])


def test_seeded_sampling_is_reproducible_and_seeds_differ(engine):
    def params(seed):
        return SamplingParams(
            max_tokens=16, temperature=1.5, top_p=0.95, top_k=500, seed=seed, ignore_eos=True
        )

    async def go():
        async with engine:
            outs = []
            for i, seed in enumerate([11, 11, 12]):
                await engine.fill(i, None, _prompt())
                # run alongside an unrelated request: batch composition must not matter
                other = asyncio.create_task(complete(engine, f"x{i}", _prompt(5, i), params(None)))
                outs.append((await collect(engine, i, None, params(seed)))[0])
                await other
            return outs

    a, b, c = asyncio.run(go())
    assert a == b
    assert a != c


def test_stop_token_ids_and_eos(engine):
    async def go():
        async with engine:
            await engine.fill("a", None, _prompt())
            greedy, _, _ = await collect(
                engine, "a", None, SamplingParams(max_tokens=8, ignore_eos=True)
            )
            await engine.fill("b", None, _prompt())
            stop_at = greedy[3]
            stopped, _, deltas = await collect(
                engine,
                "b",
                None,
                SamplingParams(max_tokens=8, stop_token_ids=[stop_at], ignore_eos=True),
            )
            return greedy, stopped, deltas, stop_at

    greedy, stopped, deltas, stop_at = asyncio.run(go())
    first = greedy.index(stop_at)
    assert stopped == greedy[: first + 1]
    assert deltas[-1].finish_reason == "stop"


def test_stop_string_never_streams_text_past_it(tiny_model_dir):
    async def go(stop):
        engine = Engine.from_pretrained(tiny_model_dir, num_blocks=64, progress=False)
        async with engine:
            await engine.fill("a", None, _prompt(seed=4))
            return await collect(
                engine, "a", None, SamplingParams(max_tokens=24, stop=stop, ignore_eos=True)
            )

    _, full, _ = asyncio.run(go([]))
    assert len(full) > 12
    stop = full[8:11]
    _, text, deltas = asyncio.run(go([stop]))
    assert text == full[: full.index(stop)]
    assert stop not in "".join(d.text for d in deltas)
    assert deltas[-1].finish_reason == "stop"


def test_detokenizer_never_splits_utf8_characters(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    text = "Café 東京 🦜 naïve — ünïcödé 😀!"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # some characters span several tokens
    detok = Detokenizer(lambda t: tok.decode(t, skip_special_tokens=True), [])
    deltas = [detok.add(i) for i in ids] + [detok.flush()]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_detokenizer_holds_back_a_possible_stop_prefix():
    pieces = ["Hel", "lo", " wor", "ld", "!"]
    detok = Detokenizer(lambda ids: "".join(pieces[i] for i in ids), ["world"])
    out = [detok.add(i) for i in range(4)]
    assert out == ["Hel", "lo", " ", ""]  # " wor" could begin "world": held back
    assert detok.stopped


@pytest.mark.slow
def test_streaming_non_ascii_text_from_smollm2(smollm2_dir):
    engine = Engine.from_pretrained(smollm2_dir, num_blocks=64, progress=False)

    async def go():
        async with engine:
            prompt = engine.tokenize("Les élèves français étudient à l'école. Très")
            await engine.fill("a", None, prompt)
            return await collect(engine, "a", None, SamplingParams(max_tokens=24))

    tokens, text, deltas = asyncio.run(go())
    assert not any("\ufffd" in d.text for d in deltas)
    assert text == engine.detokenize([t for t in tokens if t not in engine.eos_ids])
    assert any(ord(ch) > 127 for ch in text)


BAD_SAMPLING = [
    dict(temperature=math.nan),
    dict(temperature=-0.5),
    dict(temperature=math.inf),
    dict(top_p=0.0),
    dict(top_p=1.5),
    dict(top_p=math.nan),
    dict(top_k=10**9),
    dict(top_k=-1),
    dict(max_tokens=-3),
    dict(max_tokens=0),
    dict(seed=-1),
    dict(stop=[""]),
    dict(stop_token_ids=[10**9]),
]


@pytest.mark.parametrize("bad", BAD_SAMPLING, ids=[str(b) for b in BAD_SAMPLING])
def test_invalid_sampling_is_rejected_and_the_engine_keeps_serving(engine, bad):
    async def go():
        async with engine:
            good = asyncio.create_task(
                complete(engine, "good", _prompt(), SamplingParams(max_tokens=6, ignore_eos=True))
            )
            await engine.fill("bad", None, _prompt())
            with pytest.raises(InvalidRequest):
                await collect(engine, "bad", None, SamplingParams(**bad))
            return await good

    assert len(asyncio.run(go())) == 6


def test_bad_contexts_are_clear_errors_and_the_engine_keeps_serving(engine):
    async def go():
        async with engine:
            good = asyncio.create_task(
                complete(engine, "good", _prompt(), SamplingParams(max_tokens=6, ignore_eos=True))
            )
            with pytest.raises(ContextNotFound, match="unknown context 'nope'"):
                await engine.free("nope")
            with pytest.raises(ContextNotFound):
                await engine.fill("child", "nope", _prompt())
            await engine.fill("p", None, _prompt())
            await engine.fill("c", "p", _prompt(3))
            with pytest.raises(ContextBusy, match="live child"):
                await engine.free("p")
            await engine.free("c")
            await engine.free("p")
            with pytest.raises(ContextNotFound):
                await collect(engine, "p", None, SamplingParams())
            with pytest.raises(InvalidRequest, match="maximum of 512"):
                await engine.fill("long", None, _prompt(600))
            with pytest.raises(InvalidRequest, match="vocabulary"):
                await engine.fill("oov", None, [10**7])
            await engine.fill("empty", None, [])
            with pytest.raises(InvalidRequest, match="empty context"):
                await collect(engine, "empty", None, SamplingParams())
            assert set(engine.contexts) == {"good", "empty"}  # failed calls created nothing
            return await good

    assert len(asyncio.run(go())) == 6


def test_a_request_larger_than_the_pool_fails_alone(tiny_model_dir):
    engine = Engine.from_pretrained(tiny_model_dir, num_blocks=4, progress=False)

    async def go():
        async with engine:
            with pytest.raises(InvalidRequest, match="needs 5 KV blocks"):
                await engine.fill("big", None, _prompt(70))
            await engine.fill("hold", None, _prompt(40))  # idle context holding 3 blocks
            await engine.fill("pinned", "hold", [])  # a child pins the parent's blocks
            with pytest.raises(OutOfMemory):
                await engine.fill("mid", None, _prompt(33, seed=9))
            return await complete(engine, "ok", _prompt(5), SamplingParams(max_tokens=3))

    assert len(asyncio.run(go())) == 3


def test_cancelling_a_generation_frees_everything(engine):
    async def go():
        async with engine:
            base = engine.stats_now().blocks_used
            await engine.fill("a", None, _prompt(30))
            stream = engine.generate("a", None, SamplingParams(max_tokens=400, ignore_eos=True))
            got = 0
            async for _ in stream:
                got += 1
                if got == 3:
                    break
            await stream.aclose()
            stats = engine.stats_now()
            await engine.free("a")
            await asyncio.sleep(0.05)
            return base, stats, engine.stats_now(), got

    base, during, after, got = asyncio.run(go())
    assert got == 3
    assert during.running == 0 and during.waiting == 0
    assert during.tokens_generated < 10
    assert after.blocks_used == base


def test_engine_contract_and_manager_import_without_torch():
    import subprocess
    import sys

    code = (
        "import sys; import parrot_backend.contract.engine, parrot_backend.manager.manager;"
        " assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_data_keeps_special_token_spellings_as_text(smollm2_dir):
    from transformers import AutoTokenizer

    from parrot_backend.engine.tokens import encode_segment, special_token_ids

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    special = special_token_ids(tok)
    text = "hi <|im_end|> there"
    assert special["<|im_end|>"] in encode_segment(tok, text)  # template text: the token
    as_data = encode_segment(tok, text, data=True)
    assert special["<|im_end|>"] not in as_data
    assert tok.decode(as_data) == text
