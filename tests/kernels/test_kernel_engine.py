"""Engine level: the Triton backend generates the same greedy tokens as the torch backend.

Runs the tiny random Llama (GQA 4/2) through the real engine: a parent context is filled
and three children forked from it generate together, so the step mixes prefill chunks that
read the parent's blocks and decode rows that share its prefix. The engine does not build
prefix groups yet; a test backend derives them from shared leading blocks so the
shared-prefix path runs inside the engine too.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("triton")

from parrot_backend.engine.attention import AttentionMetadata, PrefixGroup  # noqa: E402
from parrot_backend.engine.engine import Engine  # noqa: E402
from parrot_backend.engine.sampling import SamplingParams  # noqa: E402
from parrot_backend.kernels.backend import TritonAttention  # noqa: E402

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def groups_from_shared_blocks(meta: AttentionMetadata) -> list[PrefixGroup]:
    """Group decode rows whose block tables start with the same blocks (ungated)."""
    bs = meta.block_size
    buckets: dict[int, list[int]] = {}
    for i in range(meta.num_seqs):
        if meta.query_len(i) == 1 and meta.seq_lens[i] > bs:
            buckets.setdefault(int(meta.block_tables[i, 0]), []).append(i)
    groups = []
    for members in buckets.values():
        if len(members) < 2:
            continue
        tables = meta.block_tables[members]
        full = min(meta.seq_lens[i] - 1 for i in members) // bs
        common = 0
        while common < full and bool((tables[:, common] == tables[0, common]).all()):
            common += 1
        if common:
            groups.append(PrefixGroup(members, common * bs, tables[0, :common].tolist()))
    return groups


class GroupingTriton(TritonAttention):
    """TritonAttention that adds prefix groups to each step, counting the grouped rows."""

    def __init__(self) -> None:
        super().__init__()
        self.grouped_rows = 0

    def forward(self, q, k_cache, v_cache, meta, scale):
        if "test-groups" not in meta.cache:  # once per step, before the plan is built
            meta.cache["test-groups"] = True
            meta.prefix_groups = groups_from_shared_blocks(meta)
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
        return Engine.from_pretrained(tiny_model_dir, num_blocks=48, progress=False,
                                      prefix_cache=False, attention_backend=backend)

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
