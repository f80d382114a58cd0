"""Decode rows forked from one context are grouped by their shared prefix blocks."""

from __future__ import annotations

import asyncio

import torch

from parrot_backend.contract.sampling import SamplingParams
from parrot_backend.engine.attention import TorchAttention
from parrot_backend.engine.engine import Engine

from .helpers import complete


class RecordingTorch(TorchAttention):
    """The torch backend with a gate that always groups; records the groups it sees."""

    def __init__(self) -> None:
        self.seen: list[tuple[tuple[int, ...], int]] = []

    def share_prefix(self, prefix_len, group_size):
        return True

    def forward(self, q, k_cache, v_cache, meta, scale):
        if "seen" not in meta.cache:
            meta.cache["seen"] = True
            self.seen += [(tuple(g.seq_indices), g.prefix_len) for g in meta.prefix_groups]
        return super().forward(q, k_cache, v_cache, meta, scale)


def test_forked_decodes_form_one_group_with_the_parents_full_blocks(tiny_model_dir):
    engine = Engine.from_pretrained(
        tiny_model_dir, num_blocks=64, progress=False, prefix_cache=False
    )
    engine.runner.backend = backend = RecordingTorch()
    g = torch.Generator().manual_seed(2)
    prefix = torch.randint(3, 49152, (40,), generator=g).tolist()
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)

    async def go():
        async with engine:
            await engine.fill("p", None, prefix)
            await engine.fill("solo", None, torch.randint(3, 49152, (20,), generator=g).tolist())
            return await asyncio.gather(
                *(complete(engine, f"c{i}", [7 + i, 8], sampling, parent="p") for i in range(3)),
                complete(engine, "solo2", [5], sampling, parent="solo"),
            )

    asyncio.run(go())
    grouped = [(rows, plen) for rows, plen in backend.seen if len(rows) == 3]
    assert grouped, backend.seen
    assert all(plen == 32 for _, plen in grouped)  # the parent's two full blocks
    assert all(len(rows) != 1 for rows, _ in backend.seen)  # a lone fork is never a group


class PlainTorch(TorchAttention):
    """The torch backend without its shared-prefix paths (the default gates' opposite)."""

    def share_prefix(self, prefix_len, group_size):
        return False

    def share_prefill_prefix(self, prefix_len, group_size):
        return False


class CountingTorch(TorchAttention):
    """The torch backend counting the grouped rows it computes, with a gate the tiny
    model (512 positions) can reach: the default one asks for prefixes of 512 tokens."""

    grouped_rows = 0

    grouped_chunks = 0

    def share_prefix(self, prefix_len, group_size):
        return prefix_len >= 256 and group_size >= 4

    def share_prefill_prefix(self, prefix_len, group_size):
        return prefix_len >= 256 and group_size >= 2

    def forward(self, q, k_cache, v_cache, meta, scale):
        if "counted" not in meta.cache:
            meta.cache["counted"] = True
            self.grouped_rows += sum(len(g.seq_indices) for g in meta.prefix_groups)
            self.grouped_chunks += sum(len(g.seq_indices) for g in meta.prefill_groups)
        return super().forward(q, k_cache, v_cache, meta, scale)


def test_torch_shared_prefix_decode_generates_what_plain_decode_generates(tiny_model_dir):
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(3, 49152, (300,), generator=g).tolist()  # past the test's gate
    suffixes = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (1, 7, 20, 3)]
    sampling = SamplingParams(max_tokens=12, ignore_eos=True)

    def run(backend):
        engine = Engine.from_pretrained(tiny_model_dir, num_blocks=96, progress=False)
        engine.runner.backend = backend

        async def go():
            async with engine:
                await engine.fill("p", None, prefix)
                return await asyncio.gather(
                    *(
                        complete(engine, f"c{i}", s, sampling, parent="p")
                        for i, s in enumerate(suffixes)
                    )
                )

        return asyncio.run(go())

    grouped = CountingTorch()
    assert run(grouped) == run(PlainTorch())
    assert grouped.grouped_rows >= 4 * (sampling.max_tokens - 1)  # the path really ran
    # the forks' suffixes of 7 and 20 tokens were prefilled in one step, as a group
    assert grouped.grouped_chunks >= 2


def test_grouped_fork_prefill_gives_the_logits_of_plain_prefill(tiny_model_dir):
    """All-position logits of forks prefilling after a shared prefix, in one step: grouped
    (the prefix read once for every chunk) equal the plain prefill's."""
    from parrot_backend.engine.context import Request
    from parrot_backend.engine.scheduler import Work

    g = torch.Generator().manual_seed(9)
    prefix = torch.randint(3, 49152, (300,), generator=g).tolist()  # 18 full blocks + 12
    chunks = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (5, 17, 2, 33)]

    def run(backend):
        engine = Engine.from_pretrained(tiny_model_dir, num_blocks=96, progress=False)
        engine.runner.backend = backend

        async def go():
            async with engine:
                await engine.fill("p", None, prefix)
                work = []
                for i, chunk in enumerate(chunks):  # forks of "p", attached by hand
                    ctx = engine.tree.open(f"c{i}", "p", None)
                    engine.tree.register(ctx)
                    engine.scheduler._attach(ctx)
                    start = ctx.num_computed
                    ctx.tokens.extend(chunk)
                    req = Request("fill", ctx)
                    assert engine.scheduler._reserve(req, start, len(chunk), set())
                    work.append(Work(req, start, len(chunk)))
                return engine.runner.logits_for(work)

        return asyncio.run(go())

    grouped = CountingTorch()
    got = run(grouped)
    assert grouped.grouped_chunks == len(chunks)
    want = run(PlainTorch())
    assert got.shape == want.shape == (sum(map(len, chunks)), want.shape[1])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
