"""The torch backend's shared-prefix decode (a group's prefix K/V read once, merged with
each row's suffix by log-sum-exp) equals its plain per-row decode, and its grouped prefill
of forks' chunks equals their plain prefill, on mixed and random batches laid out as the
engine's forks are."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from test_kernel_backend import MIXED, B, _batch, _random_spec

from parrot_backend.engine.attention import TorchAttention, find_prefix_groups


def _both(q, kc, vc, k_new, v_new, meta):
    torch_backend = TorchAttention()
    torch_backend.store_kv(k_new, v_new, kc, vc, meta.slot_mapping)
    scale = q.shape[-1] ** -0.5
    shared = torch_backend.forward(q, kc, vc, meta, scale)
    plain_meta = dataclasses.replace(meta, prefix_groups=[], cache={})
    plain = torch_backend.forward(q, kc, vc, plain_meta, scale)
    return shared, plain


@pytest.mark.parametrize(
    "group,d,dtype",
    [(3, 64, torch.float32), (4, 128, torch.float16), (1, 64, torch.float32)],
    ids=["gqa3-d64-fp32", "gqa4-d128-fp16", "mha-d64-fp32"],
)
def test_grouped_decode_equals_plain_decode_on_a_mixed_batch(group, d, dtype):
    q, kc, vc, k_new, v_new, meta = _batch(MIXED, group, d, dtype, torch.device("cpu"), seed=d)
    assert meta.prefix_groups  # the batch has groups: the shared path runs
    shared, plain = _both(q, kc, vc, k_new, v_new, meta)
    tol = {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 4e-3, "rtol": 4e-3}
    torch.testing.assert_close(shared, plain, **tol)


@pytest.mark.parametrize("seed", range(12))
def test_grouped_decode_equals_plain_decode_on_random_shuffled_batches(seed):
    spec = _random_spec(seed)
    q, kc, vc, k_new, v_new, meta = _batch(
        spec, 3, 32, torch.float32, torch.device("cpu"), seed=seed, shuffle=True
    )
    shared, plain = _both(q, kc, vc, k_new, v_new, meta)
    torch.testing.assert_close(shared, plain, atol=2e-5, rtol=2e-5)


def test_the_gate_groups_long_prefixes_read_by_enough_rows():
    backend = TorchAttention()
    assert backend.groups_prefixes
    assert backend.share_prefix(768, 4) and backend.share_prefix(256, 12)
    assert backend.share_prefix(1536, 2) and backend.share_prefix(1024, 16)
    assert not backend.share_prefix(255, 64) and not backend.share_prefix(1024, 2)
    assert not backend.share_prefix(256, 8) and not backend.share_prefix(512, 4)
    # forks' prefill chunks: from 512-token prefixes and 2,048 prefix tokens in all
    assert backend.groups_prefill
    assert backend.share_prefill_prefix(1024, 2) and backend.share_prefill_prefix(512, 4)
    assert not backend.share_prefill_prefix(512, 2) and not backend.share_prefill_prefix(256, 64)
    backend.group_prefill = False  # the A/B switch
    assert not backend.share_prefill_prefix(4096, 64)


def test_the_fused_kernel_path_runs_and_equals_the_unfused_one(monkeypatch):
    """On a CPU a group's attention takes SDPA's fused kernel (two calls and a merge by
    their log-sum-exp); it gives the unfused matmuls' values, empty prefixes included."""
    from parrot_backend.engine import attention

    real = attention._FLASH_CPU
    assert real is not None  # the pinned torch has the op; a torch without it would skip
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[1].shape[2])  # keys in the call
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "_FLASH_CPU", spy)
    unfused = TorchAttention()
    unfused.fused_shared_decode = False
    for seed in range(8):
        q, kc, vc, k_new, v_new, meta = _batch(
            _random_spec(seed), 3, 32, torch.float32, torch.device("cpu"), seed=seed, shuffle=True
        )
        fused = TorchAttention()
        fused.store_kv(k_new, v_new, kc, vc, meta.slot_mapping)
        scale = q.shape[-1] ** -0.5
        got = fused.forward(q, kc, vc, meta, scale)
        want = unfused.forward(q, kc, vc, dataclasses.replace(meta, cache={}), scale)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert calls and all(n > 0 for n in calls)


def _prefill_spec(seed: int):
    """A random step with forks prefilling chunks (2+ new tokens each) after a prefix of
    0-3 blocks (partial blocks too), beside fresh sequences and decoding forks."""
    rng = random.Random(seed)
    spec = [
        ("fresh", rng.randint(2, 3 * B), rng.choice([1, 2, 9])) for _ in range(rng.randint(0, 2))
    ]
    for _ in range(rng.randint(1, 3)):
        prefix = rng.choice([B, 2 * B, B + 5, 3 * B - 1, rng.randint(1, 3 * B)])
        suffixes = [rng.randint(2, 2 * B + 3) for _ in range(rng.randint(2, 4))]
        news = [rng.randint(2, s) for s in suffixes]
        spec.append(("group", prefix, suffixes, news))
    if rng.random() < 0.5:
        spec.append(("group", 2 * B + 1, [3, 1, 5]))  # decoding forks in the same step
    return spec


@pytest.mark.parametrize("seed", range(10))
def test_grouped_fork_prefill_equals_plain_prefill_on_random_shuffled_batches(seed, monkeypatch):
    """Forks' chunks that share full blocks are grouped (the finder sees them), the group
    path really calls the fused kernel, and every row equals the ungrouped prefill."""
    from parrot_backend.engine import attention

    dtype = torch.float32 if seed % 3 else torch.float16
    spec = _prefill_spec(seed)
    q, kc, vc, k_new, v_new, meta = _batch(
        spec, 3, 32, dtype, torch.device("cpu"), seed=seed, shuffle=True
    )
    meta.prefix_groups = find_prefix_groups(meta, lambda p, n: True)
    meta.prefill_groups = find_prefix_groups(meta, lambda p, n: True, prefill=True)
    # every prefilling group with a full block of prefix is found, and nothing else
    want = sorted(len(e[2]) for e in spec if len(e) == 4 and e[1] >= B)
    assert sorted(len(g.seq_indices) for g in meta.prefill_groups) == want
    for g in meta.prefill_groups:
        assert len(g.seq_indices) >= 2 and g.prefix_len % B == 0 and g.prefix_len >= B
        assert all(meta.query_len(i) > 1 for i in g.seq_indices)
        assert all(meta.seq_lens[i] - meta.query_len(i) >= g.prefix_len for i in g.seq_indices)
    backend = TorchAttention()
    backend.store_kv(k_new, v_new, kc, vc, meta.slot_mapping)
    real, calls = attention._FLASH_CPU, []

    def spy(*args, **kwargs):
        calls.append(args[0].shape[2])  # queries in the call
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "_FLASH_CPU", spy)
    scale = q.shape[-1] ** -0.5
    got = backend.forward(q, kc, vc, meta, scale)
    plain = backend.forward(
        q, kc, vc, dataclasses.replace(meta, prefill_groups=[], cache={}), scale
    )
    tol = {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 4e-3, "rtol": 4e-3}
    torch.testing.assert_close(got, plain, **tol)
    # the grouped path ran: one call per group over all its chunks' queries (3 heads each)
    for g in meta.prefill_groups:
        assert 3 * sum(meta.query_len(i) for i in g.seq_indices) in calls


def test_the_prefill_finder_keeps_decode_rows_and_lone_forks_out():
    spec = [("group", 2 * B, [5, 7], [5, 3]), ("group", 2 * B, [4, 6]), ("group", B, [9], [4])]
    q, kc, vc, k_new, v_new, meta = _batch(spec, 3, 32, torch.float32, torch.device("cpu"), 0)
    groups = find_prefix_groups(meta, lambda p, n: True, prefill=True)
    assert [(g.seq_indices, g.prefix_len) for g in groups] == [([0, 1], 2 * B)]
    decode = find_prefix_groups(meta, lambda p, n: True)
    assert [(g.seq_indices, g.prefix_len) for g in decode] == [([2, 3], 2 * B)]
    assert find_prefix_groups(meta, lambda p, n: False, prefill=True) == []
