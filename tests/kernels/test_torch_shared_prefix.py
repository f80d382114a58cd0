"""The torch backend's shared-prefix decode (a group's prefix K/V read once, merged with
each row's suffix by log-sum-exp) equals its plain per-row decode, on mixed and random
batches laid out as the engine's forks are."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_kernel_backend import MIXED, _batch, _random_spec

from parrot_backend.engine.attention import TorchAttention


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
    assert backend.share_prefix(768, 8) and backend.share_prefix(512, 12)
    assert backend.share_prefix(4096, 2) and backend.share_prefix(1024, 16)
    assert not backend.share_prefix(511, 16) and not backend.share_prefix(1024, 4)
    assert not backend.share_prefix(256, 64) and not backend.share_prefix(2048, 2)


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
