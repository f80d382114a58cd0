"""TritonAttention vs TorchAttention on a real mixed batch, the gate, and the import guard."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import BLOCK_SIZE, forked_group, randn, random_cache  # noqa: E402

from parrot_backend.engine.attention import (  # noqa: E402
    AttentionMetadata,
    PrefixGroup,
    TorchAttention,
    make_backend,
)
from parrot_backend.kernels.backend import TritonAttention, should_share_prefix  # noqa: E402

HKV = 2
B = BLOCK_SIZE


def _mixed_batch(group: int, d: int, dtype: torch.dtype, device: torch.device):
    """Prefill, extend, plain decode and three prefix groups (sizes 3, 1, 1) in one step.

    Returns q, k/v caches holding the cached context, the new tokens' k/v and the metadata.
    """
    gen = torch.Generator().manual_seed(group * 100 + d)
    kc, vc = random_cache(64, HKV, d, dtype, device, gen)
    tables: list[list[int]] = []
    seq_lens: list[int] = []
    q_lens: list[int] = []
    nxt = 1  # block 0 stays the padding entry of the block tables

    def fresh(n_tokens: int) -> list[int]:
        nonlocal nxt
        n = math.ceil(n_tokens / B)
        nxt += n
        return list(range(nxt - n, nxt))

    def add(table: list[int], seq_len: int, q_len: int) -> int:
        tables.append(table)
        seq_lens.append(seq_len)
        q_lens.append(q_len)
        return len(tables) - 1

    add(fresh(20), 20, 20)  # prefill of a fresh context
    add(fresh(B + 1), B + 1, 1)  # plain decode across a block boundary
    groups = []
    for prefix_len, suffixes in ((20, [1, B, B + 1]), (1, [B]), (0, [3])):
        blocks, rows, nxt = forked_group(kc, vc, prefix_len, suffixes, nxt, gen)
        members = [add(rows[j, : math.ceil((prefix_len + s) / B)].tolist(), prefix_len + s, 1)
                   for j, s in enumerate(suffixes)]
        groups.append(PrefixGroup(members, prefix_len, blocks))
    add(fresh(B + 5), B + 5, 5)  # a forked child's prefill: 5 new tokens after B cached

    width = max(len(t) for t in tables)
    block_tables = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = torch.tensor(t)
    query_start = [0]
    slots = []
    for i, (n, ql) in enumerate(zip(seq_lens, q_lens, strict=True)):
        query_start.append(query_start[-1] + ql)
        slots += [tables[i][p // B] * B + p % B for p in range(n - ql, n)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start=query_start, seq_lens=seq_lens, block_tables=block_tables.to(device),
        block_size=B, prefix_groups=groups)
    t = query_start[-1]
    q = randn(t, HKV * group, d, dtype=dtype, device=device, gen=gen)
    k_new = randn(t, HKV, d, dtype=dtype, device=device, gen=gen)
    v_new = randn(t, HKV, d, dtype=dtype, device=device, gen=gen)
    return q, kc, vc, k_new, v_new, meta


@pytest.mark.parametrize("group,d,dtype", [(3, 64, torch.float32), (4, 128, torch.float16),
                                           (1, 64, torch.float16)],
                         ids=["gqa3-d64-fp32", "gqa4-d128-fp16", "mha-d64-fp16"])
def test_triton_backend_matches_torch_backend_on_a_mixed_batch(group, d, dtype, device):
    q, kc, vc, k_new, v_new, meta = _mixed_batch(group, d, dtype, device)
    ref, tri = TorchAttention(), TritonAttention()
    tri.alloc_out = lambda x: torch.full_like(x, float("nan"))
    kc_t, vc_t = kc.clone(), vc.clone()
    ref.store_kv(k_new, v_new, kc, vc, meta.slot_mapping)
    tri.store_kv(k_new, v_new, kc_t, vc_t, meta.slot_mapping)
    assert torch.equal(kc_t, kc) and torch.equal(vc_t, vc)
    scale = d**-0.5
    want = ref.forward(q, kc, vc, meta, scale)
    got = tri.forward(q, kc, vc, meta, scale)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 5e-3, "rtol": 5e-3}
    torch.testing.assert_close(got, want, **tol)
    # a second layer reuses the step's plan
    assert sum(1 for k in meta.cache if k[0] == "triton") == 1
    torch.testing.assert_close(tri.forward(q, kc, vc, meta, scale), got, rtol=0, atol=0)


def test_prefix_group_with_a_prefill_row_is_rejected(device):
    q, kc, vc, _, _, meta = _mixed_batch(1, 64, torch.float32, device)
    meta.prefix_groups.append(PrefixGroup([0], 4, [1]))  # sequence 0 is a prefill
    with pytest.raises(ValueError, match="not a decode row"):
        TritonAttention().forward(q, kc, vc, meta, 0.125)


def test_sequence_in_two_prefix_groups_is_rejected(device):
    q, kc, vc, _, _, meta = _mixed_batch(1, 64, torch.float32, device)
    meta.prefix_groups.append(PrefixGroup([1], 1, [1]))
    meta.prefix_groups.append(PrefixGroup([1], 1, [1]))
    with pytest.raises(ValueError, match="groups"):
        TritonAttention().forward(q, kc, vc, meta, 0.125)


@pytest.mark.parametrize("prefix_len,group_size,share", [
    (64, 256, False),  # published: slower than plain decode at a 64-token prefix
    (255, 64, False), (256, 7, False), (256, 8, True), (32768, 256, True), (8192, 1, False),
])
def test_should_share_prefix_gate(prefix_len, group_size, share):
    assert should_share_prefix(prefix_len, group_size) is share


def test_make_backend_builds_the_triton_backend():
    assert isinstance(make_backend("triton"), TritonAttention)


def test_without_triton_kernels_import_and_the_backend_fails_clearly():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from parrot_backend.kernels.decode import paged_decode_ref\n"
        "from parrot_backend.engine.attention import make_backend\n"
        "try:\n"
        "    make_backend('triton')\n"
        "except ImportError as e:\n"
        "    print('ERR', e)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert "ERR" in res.stdout and "torch' backend" in res.stdout
