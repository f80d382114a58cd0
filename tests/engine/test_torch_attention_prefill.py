"""The torch backend's prefill attention: right against plain math, and on SDPA's fused kernel.

A prefill chunk after cached tokens needs a causal mask offset by the cached length. SDPA
takes its fused CPU kernel for that only with 4-D inputs; 3-D ones fell back to the math
path, which made prefill ~1.7x slower than transformers at 1,000 tokens. The kernel
choice is checked by the profiler's op names, not by timing.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from parrot_backend.engine.attention import AttentionMetadata, TorchAttention

HQ, HKV, D, BS = 6, 2, 16, 4


def _step(seqs: list[tuple[int, int]], seed: int = 0):
    """A step of sequences given as (context length, new tokens), on a random paged cache
    whose blocks are handed out in a scrambled order; returns q, caches, metadata."""
    gen = torch.Generator().manual_seed(seed)
    nblocks = 1 + sum((n + BS - 1) // BS for n, _ in seqs)
    k_cache = torch.randn(nblocks, BS, HKV, D, generator=gen)
    v_cache = torch.randn(nblocks, BS, HKV, D, generator=gen)
    order = (torch.randperm(nblocks - 1, generator=gen) + 1).tolist()  # block 0: padding
    tables, slots, starts, lens = [], [], [0], []
    for n_ctx, n_new in seqs:
        own = [order.pop() for _ in range((n_ctx + BS - 1) // BS)]
        tables.append(own)
        slots.extend(own[p // BS] * BS + p % BS for p in range(n_ctx - n_new, n_ctx))
        starts.append(starts[-1] + n_new)
        lens.append(n_ctx)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start=starts,
        seq_lens=lens,
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        block_size=BS,
    )
    q = torch.randn(starts[-1], HQ, D, generator=gen)
    return q, k_cache, v_cache, meta


def _reference(q, k_cache, v_cache, meta, scale):
    """Softmax attention written out, one sequence and one query at a time."""
    out = torch.empty_like(q)
    for i, n_ctx in enumerate(meta.seq_lens):
        s, e = meta.query_start[i], meta.query_start[i + 1]
        table = meta.block_tables[i].tolist()
        slots = [table[p // BS] * BS + p % BS for p in range(n_ctx)]
        k = k_cache.view(-1, HKV, D)[slots].repeat_interleave(HQ // HKV, dim=1)  # [L, HQ, D]
        v = v_cache.view(-1, HKV, D)[slots].repeat_interleave(HQ // HKV, dim=1)
        for j in range(e - s):
            pos = n_ctx - (e - s) + j
            scores = torch.einsum("hd,lhd->hl", q[s + j], k[: pos + 1]) * scale
            out[s + j] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v[: pos + 1])
    return out


@pytest.mark.parametrize(
    "seqs",
    [
        [(24, 24)],  # a fresh prompt
        [(37, 13)],  # a chunk after 24 cached tokens (the mask's offset)
        [(30, 7), (9, 9), (21, 1)],  # two prefills beside a decode row
    ],
)
def test_prefill_attention_equals_plain_softmax(seqs):
    q, kc, vc, meta = _step(seqs)
    scale = D**-0.5
    got = TorchAttention().forward(q, kc, vc, meta, scale)
    want = _reference(q, kc, vc, meta, scale)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_prefill_after_cached_tokens_takes_sdpa_fused_cpu_kernel():
    q, kc, vc, meta = _step([(37, 13), (40, 40)], seed=1)
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        TorchAttention().forward(q, kc, vc, meta, D**-0.5)
    ops = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops, sorted(ops)
    assert "aten::_scaled_dot_product_attention_math" not in ops
