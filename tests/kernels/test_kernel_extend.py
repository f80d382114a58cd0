"""Prefill / extend kernel (causal over new tokens plus cached paged context) vs reference."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import BLOCK_SIZE, poisoned, randn, random_cache, random_tables, tol  # noqa: E402

from parrot_backend.kernels.extend import (  # noqa: E402
    extend_attention_ref,
    extend_attention_triton,
)

HKV = 2
B = BLOCK_SIZE
# (cached tokens, new tokens): fresh prefills at / below a block, one token, extends that
# cross a block boundary, and a chunk that starts exactly on a boundary
CHUNKS = [(0, B), (0, B - 1), (0, 1), (5, B - 4), (B, 1), (2 * B - 1, 2), (B, B + 1)]
SHAPES = [(1, 64), (3, 64), (4, 64), (1, 128), (3, 128), (4, 128)]


def _case(group, d, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    lens = [c + n for c, n in CHUNKS]
    starts = [0]
    for _, n in CHUNKS:
        starts.append(starts[-1] + n)
    kc, vc = random_cache(24, HKV, d, dtype, device, gen)
    tables = random_tables(lens, 24, gen, device)
    q = randn(starts[-1], HKV * group, d, dtype=dtype, device=device, gen=gen)
    return q, kc, vc, tables, starts, lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("group,d", SHAPES)
def test_extend_matches_reference(group, d, dtype, device):
    q, kc, vc, tables, starts, lens = _case(group, d, dtype, device, seed=group + d)
    scale = d**-0.5
    out = poisoned(*q.shape, dtype=dtype, device=device)
    got = extend_attention_triton(q, kc, vc, tables, starts, lens, scale, out=out)
    want = extend_attention_ref(q, kc, vc, tables, starts, lens, scale)
    torch.testing.assert_close(got, want, **tol(dtype))


@pytest.mark.parametrize("group", [1, 3, 4])
def test_extend_with_small_tiles_crosses_tiles_and_kv_steps(group, device):
    """16-row tiles and 16-key steps: many tiles per sequence and several loop steps."""
    q, kc, vc, tables, starts, lens = _case(group, 64, torch.float32, device, seed=3)
    out = poisoned(*q.shape, dtype=q.dtype, device=device)
    got = extend_attention_triton(
        q, kc, vc, tables, starts, lens, 0.125, out=out, block_m=16, block_n=16
    )
    want = extend_attention_ref(q, kc, vc, tables, starts, lens, 0.125)
    torch.testing.assert_close(got, want, **tol(torch.float32))


def test_extend_is_causal_within_the_new_tokens(device):
    """Changing a later token's K/V must not change an earlier token's output."""
    q, kc, vc, tables, starts, lens = _case(1, 64, torch.float32, device, seed=9)
    before = extend_attention_triton(q, kc, vc, tables, starts, lens, 0.125)
    i = len(CHUNKS) - 1  # (B cached, B + 1 new): perturb its last token
    last = lens[i] - 1
    blk = int(tables[i, last // BLOCK_SIZE])
    kc[blk, last % BLOCK_SIZE] += 1.0
    after = extend_attention_triton(q, kc, vc, tables, starts, lens, 0.125)
    s, e = starts[i], starts[i + 1]
    torch.testing.assert_close(after[s : e - 1], before[s : e - 1], rtol=0, atol=0)
    assert not torch.equal(after[e - 1], before[e - 1])
