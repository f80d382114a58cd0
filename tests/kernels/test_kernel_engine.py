"""Engine level: the Triton backend generates the same greedy tokens as the torch backend.

Runs the tiny random Llama (GQA 4/2) through the real engine: a parent context is filled
and three children forked from it generate together, so the step mixes prefill chunks that
read the parent's blocks and decode rows that share its prefix. The engine groups those
decode rows by their shared leading blocks; a test backend opens the gate so the
shared-prefix path runs inside the engine at interpreter-sized shapes.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("triton")

from parrot_backend.contract.sampling import SamplingParams  # noqa: E402
from parrot_backend.engine.engine import Engine  # noqa: E402
from parrot_backend.engine.triton_attention import TritonAttention  # noqa: E402

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


class GroupingTriton(TritonAttention):
    """TritonAttention whose gate always groups (the real gate wants >= 256-token prefixes
    and >= 8 sequences, too big for the interpreter); counts the grouped decode rows that
    the engine's `find_prefix_groups` hands it."""

    def __init__(self) -> None:
        super().__init__()
        self.grouped_rows = 0

    def share_prefix(self, prefix_len, group_size):
        return True

    def forward(self, q, k_cache, v_cache, meta, scale):
        if "test-groups" not in meta.cache:  # once per step
            meta.cache["test-groups"] = True
            self.grouped_rows += sum(len(g.seq_indices) for g in meta.prefix_groups)
        return super().forward(q, k_cache, v_cache, meta, scale)


def _forked_generation(engine: Engine, prefix: list[int], suffixes: list[list[int]]):
    async def go():
        async with engine:
            await engine.fill("parent", None, prefix)

            async def child(i, s):
                await engine.fill(f"c{i}", "parent", s)
                return [d.token_id async for d in engine.generate(f"c{i}", None, GREEDY)]

            return await asyncio.gather(*(child(i, s) for i, s in enumerate(suffixes)))

    return asyncio.run(go())


def test_triton_backend_generates_the_torch_backend_tokens_with_a_shared_prefix(
    tiny_model_dir,
):
    def engine(backend: str) -> Engine:
        return Engine.from_pretrained(
            tiny_model_dir,
            num_blocks=48,
            progress=False,
            prefix_cache=False,
            attention_backend=backend,
        )

    g = torch.Generator().manual_seed(5)
    torch_engine = engine("torch")
    vocab = torch_engine.vocab_size
    prefix = torch.randint(3, vocab, (40,), generator=g).tolist()  # 2.5 blocks: COW tail
    suffixes = [torch.randint(3, vocab, (k,), generator=g).tolist() for k in (5, 9, 1)]
    want = _forked_generation(torch_engine, prefix, suffixes)

    plain = engine("triton")
    assert isinstance(plain.runner.backend, TritonAttention)
    assert _forked_generation(plain, prefix, suffixes) == want

    grouped = engine("triton")
    grouped.runner.backend = GroupingTriton()
    assert _forked_generation(grouped, prefix, suffixes) == want
    assert grouped.runner.backend.grouped_rows > 0, "no step took the shared-prefix path"


def test_triton_backend_checks_drafts_as_the_torch_backend_does(tiny_model_dir, monkeypatch):
    """A greedy row with draft tokens (`engine/speculate.py`) is a small prefill chunk
    over the context's blocks: the Triton backend keeps the same drafts and yields the
    same tokens. An oracle proposes the plain tokens, every third check with one wrong."""
    from parrot_backend.engine.speculate import Drafter

    known: list[list[int]] = []

    class Oracle(Drafter):
        def propose(self, tokens, k):
            for seq in known:
                if seq[: len(tokens)] == list(tokens) and len(seq) > len(tokens):
                    draft = seq[len(tokens) : len(tokens) + k]
                    if len(tokens) % 3 == 0 and len(draft) > 1:
                        draft[1] = (draft[1] + 1) % 49152
                    return draft
            return []

    def run(backend: str, speculate: int):
        engine = Engine.from_pretrained(
            tiny_model_dir,
            num_blocks=48,
            progress=False,
            attention_backend=backend,
            speculate=speculate,
        )

        async def go():
            async with engine:
                await engine.fill("p", None, prompt)
                return [d.token_id async for d in engine.generate("p", None, sampling)]

        return asyncio.run(go()), engine.stats_now()

    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(3, 49152, (21,), generator=g).tolist()
    sampling = SamplingParams(max_tokens=10, ignore_eos=True)
    want, _ = run("torch", 0)
    known.append(prompt + want)
    monkeypatch.setattr("parrot_backend.engine.engine.Drafter", Oracle)
    got, stats = run("triton", 4)
    assert got == want
    assert 0 < stats.draft_tokens_accepted < stats.draft_tokens
