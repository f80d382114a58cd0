"""Shared-prefix decode (prefix once per group, per-sequence suffix, LSE merge)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import (  # noqa: E402
    BLOCK_SIZE,
    forked_group,
    poisoned,
    randn,
    random_cache,
    tol,
)

from parrot_backend.kernels import attention_kernel as ak  # noqa: E402
from parrot_backend.kernels.decode import paged_decode_ref  # noqa: E402
from parrot_backend.kernels.shared_prefix import (  # noqa: E402
    GroupSpec,
    plan_shared_prefix,
    prefix_attention_ref,
    shared_prefix_decode_ref,
    shared_prefix_decode_triton,
)

HKV = 2
B = BLOCK_SIZE
SUFFIXES = [1, B, B + 1]  # members' own tokens: one, a block's worth, across a boundary
SHAPES = [(1, 64), (3, 64), (4, 64), (1, 128), (3, 128), (4, 128)]


def _group(group, d, dtype, device, prefix_len, n_members, seed):
    gen = torch.Generator().manual_seed(seed)
    kc, vc = random_cache(40, HKV, d, dtype, device, gen)
    suffixes = [SUFFIXES[i % len(SUFFIXES)] for i in range(n_members)]
    blocks, tables, _ = forked_group(kc, vc, prefix_len, suffixes, 1, gen)
    lens = [prefix_len + s for s in suffixes]
    q = randn(n_members, HKV * group, d, dtype=dtype, device=device, gen=gen)
    return q, kc, vc, tables, lens, blocks


def _check(q, kc, vc, tables, lens, blocks, prefix_len, dtype, **kw):
    scale = q.shape[-1] ** -0.5
    out = poisoned(*q.shape, dtype=dtype, device=q.device)
    got, got_lse = shared_prefix_decode_triton(
        q, kc, vc, tables, lens, prefix_len, blocks, scale, out=out, **kw
    )
    want, want_lse = shared_prefix_decode_ref(q, kc, vc, tables, lens, prefix_len, blocks, scale)
    torch.testing.assert_close(got, want, **tol(dtype))
    torch.testing.assert_close(got_lse, want_lse, atol=1e-4, rtol=1e-4)
    # the shared path must equal plain decode over each member's own (COW) block table
    plain, _ = paged_decode_ref(q, kc, vc, tables, lens, scale)
    torch.testing.assert_close(got, plain, **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("members", [1, 3])
@pytest.mark.parametrize("prefix_len", [0, 1, B - 1, B, B + 1, 2 * B + 8])
def test_shared_prefix_matches_reference(prefix_len, members, dtype, device):
    case = _group(4, 64, dtype, device, prefix_len, members, seed=prefix_len * 10 + members)
    _check(*case, prefix_len=prefix_len, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("group,d", SHAPES)
def test_shared_prefix_head_shapes(group, d, dtype, device):
    case = _group(group, d, dtype, device, 20, 3, seed=group * d)
    _check(*case, prefix_len=20, dtype=dtype)


def test_shared_prefix_with_splits_and_several_m_tiles(device):
    """Split both passes and cut a 6-member × 3-head group into 16-row M tiles."""
    case = _group(3, 64, torch.float32, device, 2 * B + 8, 6, seed=1)
    _check(
        *case,
        prefix_len=2 * B + 8,
        dtype=torch.float32,
        prefix_splits=3,
        suffix_splits=2,
        block_n=16,
        max_block_m=16,
    )


@pytest.mark.parametrize("prefix_len", [0, 1, 2 * B + 8])
def test_prefix_pass_partials_match_reference_for_every_member(prefix_len, device):
    """The prefix pass alone (poisoned partials): o and LSE per member, -inf when empty."""
    q, kc, vc, _, lens, blocks = _group(4, 64, torch.float32, device, prefix_len, 3, seed=2)
    plan = plan_shared_prefix([GroupSpec([0, 1, 2], lens, prefix_len, blocks)], 4, HKV, B, device)
    parts = poisoned(plan.prefix_splits, 3, 8, 64, dtype=torch.float32, device=device)
    lse = poisoned(plan.prefix_splits, 3, 8, dtype=torch.float32, device=device)
    ak.launch(
        q,
        kc,
        vc,
        plan.prefix_tables,
        plan.prefix_tiles,
        parts,
        lse,
        0.125,
        split_len=plan.prefix_split_len,
        causal=False,
        block_m=plan.prefix_block_m,
        block_n=plan.block_n,
    )
    want, want_lse = prefix_attention_ref(q, kc, vc, prefix_len, blocks, 0.125)
    torch.testing.assert_close(parts[0], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[0], want_lse)
    assert (lse[0] == float("-inf")).all() == (prefix_len == 0)


def test_prefix_longer_than_a_member_context_is_rejected(device):
    with pytest.raises(ValueError, match="exceeds"):
        plan_shared_prefix([GroupSpec([0], [5], 6, [0])], 1, 1, B, device)
