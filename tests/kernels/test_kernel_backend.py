"""TritonAttention vs TorchAttention on a real mixed batch, the gate, and the import guard."""

from __future__ import annotations

import math
import random
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
from parrot_backend.engine.triton_attention import TritonAttention, should_share_prefix  # noqa: E402

HKV = 2
B = BLOCK_SIZE


# a step: ("fresh", seq_len, new tokens) or ("group", prefix_len, [suffix lengths]); a
# group's members decode one token each unless a fourth entry lists their new tokens
MIXED = [
    ("fresh", 20, 20),  # prefill of a fresh context
    ("fresh", B + 1, 1),  # plain decode across a block boundary
    ("group", 20, [1, B, B + 1]),  # prefix ends mid-block: members hold COW copies
    ("group", 1, [B]),
    ("group", 0, [3]),
    ("fresh", B + 5, 5),  # a forked child's prefill: 5 new tokens after B cached
]


def _batch(
    spec,
    group: int,
    d: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    shuffle: bool = False,
):
    """Build one step from `spec` on a random paged cache, with real AttentionMetadata.

    Group members decode one token each. With `shuffle`, sequences are permuted so that a
    group's rows are scattered through the batch. Returns q, k/v caches holding the cached
    context, the new tokens' k/v and the metadata.
    """
    gen = torch.Generator().manual_seed(seed)
    kc, vc = random_cache(96, HKV, d, dtype, device, gen)
    seqs: list[tuple[list[int], int, int]] = []  # (blocks, seq_len, new tokens)
    members_of: list[tuple[list[int], int, list[int]]] = []
    nxt = 1  # block 0 stays the padding entry of the block tables
    for kind, a, b, *news in spec:
        if kind == "fresh":
            n = math.ceil(a / B)
            seqs.append((list(range(nxt, nxt + n)), a, b))
            nxt += n
            continue
        blocks, rows, nxt = forked_group(kc, vc, a, b, nxt, gen)
        members = []
        for j, suffix in enumerate(b):
            members.append(len(seqs))
            ql = news[0][j] if news else 1  # ("group", prefix, suffixes, new tokens)
            seqs.append((rows[j, : math.ceil((a + suffix) / B)].tolist(), a + suffix, ql))
        members_of.append((members, a, blocks))
    order = torch.randperm(len(seqs), generator=gen).tolist() if shuffle else list(range(len(seqs)))
    where = {old: new for new, old in enumerate(order)}
    seqs = [seqs[i] for i in order]
    groups = [PrefixGroup([where[m] for m in ms], p, blk) for ms, p, blk in members_of]

    width = max(len(t) for t, _, _ in seqs)
    block_tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    query_start, slots = [0], []
    for i, (table, n, ql) in enumerate(seqs):
        block_tables[i, : len(table)] = torch.tensor(table)
        query_start.append(query_start[-1] + ql)
        slots += [table[p // B] * B + p % B for p in range(n - ql, n)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start=query_start,
        seq_lens=[n for _, n, _ in seqs],
        block_tables=block_tables.to(device),
        block_size=B,
        prefix_groups=groups,
    )
    t = query_start[-1]
    q = randn(t, HKV * group, d, dtype=dtype, device=device, gen=gen)
    k_new = randn(t, HKV, d, dtype=dtype, device=device, gen=gen)
    v_new = randn(t, HKV, d, dtype=dtype, device=device, gen=gen)
    return q, kc, vc, k_new, v_new, meta


def _mixed_batch(group: int, d: int, dtype: torch.dtype, device: torch.device):
    return _batch(MIXED, group, d, dtype, device, seed=group * 100 + d)


def _random_spec(seed: int):
    """A random step: a few fresh sequences (prefill, extend or decode) and groups."""
    rng = random.Random(seed)
    spec = []
    for _ in range(rng.randint(0, 3)):
        n = rng.randint(1, 3 * B)
        spec.append(("fresh", n, rng.choice([1, 1, rng.randint(1, n)])))
    for _ in range(rng.randint(1, 2)):
        spec.append(
            (
                "group",
                rng.choice([0, 1, B - 1, B, rng.randint(2, 3 * B)]),
                [rng.randint(1, 2 * B) for _ in range(rng.randint(1, 4))],
            )
        )
    return spec


@pytest.mark.parametrize(
    "group,d,dtype",
    [(3, 64, torch.float32), (4, 128, torch.float16), (1, 64, torch.float16)],
    ids=["gqa3-d64-fp32", "gqa4-d128-fp16", "mha-d64-fp16"],
)
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


@pytest.mark.parametrize("seed", range(6))
def test_triton_backend_matches_torch_backend_on_random_shuffled_batches(seed, device):
    group, d, dtype = [(1, 64, torch.float32), (3, 64, torch.float16), (4, 128, torch.float32)][
        seed % 3
    ]
    q, kc, vc, k_new, v_new, meta = _batch(
        _random_spec(seed), group, d, dtype, device, seed=seed, shuffle=True
    )
    ref, tri = TorchAttention(), TritonAttention()
    tri.alloc_out = lambda x: torch.full_like(x, float("nan"))
    ref.store_kv(k_new, v_new, kc, vc, meta.slot_mapping)
    want = ref.forward(q, kc, vc, meta, d**-0.5)
    got = tri.forward(q, kc, vc, meta, d**-0.5)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 5e-3, "rtol": 5e-3}
    torch.testing.assert_close(got, want, **tol)


def test_triton_backend_reads_q_k_v_sliced_from_one_fused_projection(device):
    """Models split q, k, v out of one qkv matmul: row strides larger than the rows."""
    q, kc, vc, k_new, v_new, meta = _mixed_batch(3, 64, torch.float32, device)
    hq = q.shape[1]
    qkv = torch.cat([q, k_new, v_new], dim=1)  # [T, Hq + 2 Hkv, D]
    q_s, k_s, v_s = qkv[:, :hq], qkv[:, hq : hq + HKV], qkv[:, hq + HKV :]
    assert not q_s.is_contiguous() and not k_s.is_contiguous()
    ref, tri = TorchAttention(), TritonAttention()
    kc_t, vc_t = kc.clone(), vc.clone()
    ref.store_kv(k_new, v_new, kc, vc, meta.slot_mapping)
    tri.store_kv(k_s, v_s, kc_t, vc_t, meta.slot_mapping)
    assert torch.equal(kc_t, kc) and torch.equal(vc_t, vc)
    torch.testing.assert_close(
        tri.forward(q_s, kc, vc, meta, 0.125),
        ref.forward(q, kc, vc, meta, 0.125),
        atol=1e-5,
        rtol=1e-5,
    )


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


@pytest.mark.parametrize(
    "prefix_len,group_size,share",
    [
        (64, 256, False),  # published: slower than plain decode at a 64-token prefix
        (255, 64, False),
        (256, 7, False),
        (256, 8, True),
        (32768, 256, True),
        (8192, 1, False),
    ],
)
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
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "ERR" in res.stdout and "torch' backend" in res.stdout


def test_triton_backend_gate_is_should_share_prefix():
    backend = TritonAttention()
    assert backend.share_prefix(256, 8) is True
    assert backend.share_prefix(64, 64) is False
