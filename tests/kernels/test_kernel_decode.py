"""Paged decode kernel (GQA, ragged lengths, split-KV) vs its torch reference."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import BLOCK_SIZE, poisoned, randn, random_cache, random_tables, tol  # noqa: E402

from parrot_backend.kernels import attention_kernel as ak  # noqa: E402
from parrot_backend.kernels.decode import (  # noqa: E402
    paged_decode_ref,
    paged_decode_triton,
    plan_decode,
)

HKV = 2
# one token, just below / at / just past one block, just below two blocks, past two
LENGTHS = [1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 2 * BLOCK_SIZE - 1, 2 * BLOCK_SIZE + 1]
SHAPES = [(1, 64), (3, 64), (4, 64), (1, 128), (3, 128), (4, 128)]  # (GQA ratio, head dim)


def _case(group, d, dtype, device, seed, lens=LENGTHS):
    gen = torch.Generator().manual_seed(seed)
    kc, vc = random_cache(16, HKV, d, dtype, device, gen)
    tables = random_tables(lens, 16, gen, device)
    q = randn(len(lens), HKV * group, d, dtype=dtype, device=device, gen=gen)
    return q, kc, vc, tables


@pytest.mark.parametrize("splits", [None, 3], ids=["one-split", "three-splits"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("group,d", SHAPES)
def test_paged_decode_matches_reference(group, d, dtype, splits, device):
    q, kc, vc, tables = _case(group, d, dtype, device, seed=group * 7 + d)
    scale = d**-0.5
    out = poisoned(*q.shape, dtype=dtype, device=device)
    # block_n=16 makes three splits real even for these short contexts
    got, got_lse = paged_decode_triton(
        q,
        kc,
        vc,
        tables,
        LENGTHS,
        scale,
        num_splits=splits,
        block_n=16 if splits else None,
        out=out,
    )
    want, want_lse = paged_decode_ref(q, kc, vc, tables, LENGTHS, scale)
    torch.testing.assert_close(got, want, **tol(dtype))
    torch.testing.assert_close(got_lse, want_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("group", [1, 3])
def test_paged_decode_from_kv_start_attends_only_to_the_suffix(group, device):
    lens = [17, 33, 20]
    starts = [1, 16, 20]  # prefix lengths 1, one whole block, and the whole context
    q, kc, vc, tables = _case(group, 64, torch.float32, device, seed=11, lens=lens)
    got, got_lse = paged_decode_triton(q, kc, vc, tables, lens, 0.125, kv_start=starts)
    want, want_lse = paged_decode_ref(q, kc, vc, tables, lens, 0.125, kv_start=starts)
    torch.testing.assert_close(got, want, **tol(torch.float32))
    torch.testing.assert_close(got_lse, want_lse)
    assert torch.all(got_lse[2] == float("-inf")) and torch.all(got[2] == 0)


def test_every_split_writes_its_partial_even_when_empty(device):
    """Short sequences leave later splits empty: they must write o=0, lse=-inf, not skip."""
    lens = [3, 40]
    q, kc, vc, tables = _case(4, 64, torch.float32, device, seed=5, lens=lens)
    plan = plan_decode(range(2), lens, None, 4, HKV, device, num_splits=3, block_n=16)
    assert plan.num_splits == 3 and plan.split_len == 16
    parts = poisoned(3, 2, 8, 64, dtype=torch.float32, device=device)
    lse = poisoned(3, 2, 8, dtype=torch.float32, device=device)
    ak.launch(
        q,
        kc,
        vc,
        tables,
        plan.tiles,
        parts,
        lse,
        0.125,
        split_len=plan.split_len,
        causal=False,
        block_m=plan.block_m,
        block_n=plan.block_n,
    )
    assert not parts.isnan().any() and not lse.isnan().any()
    assert torch.all(lse[1:, 0] == float("-inf")) and torch.all(parts[1:, 0] == 0)
    assert torch.isfinite(lse[:, 1]).all()


@pytest.mark.parametrize("splits", [None, 2], ids=["one-split", "two-splits"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_paged_decode_longer_contexts_loop_over_many_kv_steps(dtype, splits, device):
    """Contexts of several KV steps (32 or 64 keys each) with unaligned ends."""
    lens = [100, 130, 64]
    gen = torch.Generator().manual_seed(21)
    kc, vc = random_cache(24, HKV, 64, dtype, device, gen)
    tables = random_tables(lens, 24, gen, device)
    q = randn(3, HKV * 4, 64, dtype=dtype, device=device, gen=gen)
    got, got_lse = paged_decode_triton(
        q,
        kc,
        vc,
        tables,
        lens,
        0.125,
        num_splits=splits,
        out=poisoned(*q.shape, dtype=dtype, device=device),
    )
    want, want_lse = paged_decode_ref(q, kc, vc, tables, lens, 0.125)
    torch.testing.assert_close(got, want, **tol(dtype))
    torch.testing.assert_close(got_lse, want_lse, atol=1e-4, rtol=1e-4)
