"""KV store kernel vs its torch reference."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import BLOCK_SIZE, poisoned, randn  # noqa: E402

from parrot_backend.kernels.kv_store import store_kv_ref, store_kv_triton  # noqa: E402

# slots at, just below and across block boundaries, plus padding (-1) that must be skipped
SLOTS = [0, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 2 * BLOCK_SIZE - 1, -1, 5 * BLOCK_SIZE + 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hkv,d", [(1, 64), (3, 64), (2, 128)])
def test_store_kv_writes_each_row_at_its_slot_and_skips_padding(hkv, d, dtype, device):
    gen = torch.Generator().manual_seed(hkv * 1000 + d)
    slots = torch.tensor(SLOTS, dtype=torch.int64, device=device)
    k = randn(len(SLOTS), hkv, d, dtype=dtype, device=device, gen=gen)
    v = randn(len(SLOTS), hkv, d, dtype=dtype, device=device, gen=gen)
    caches = [poisoned(8, BLOCK_SIZE, hkv, d, dtype=dtype, device=device) for _ in range(4)]
    store_kv_ref(k, v, caches[0], caches[1], slots)
    store_kv_triton(k, v, caches[2], caches[3], slots)
    # written slots match exactly; every other slot (padding included) is still NaN
    torch.testing.assert_close(caches[2], caches[0], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(caches[3], caches[1], rtol=0, atol=0, equal_nan=True)
    assert int((~caches[2].isnan()).any(-1).any(-1).sum()) == len(SLOTS) - 1


def test_store_kv_casts_fp32_rows_into_an_fp16_cache(device):
    gen = torch.Generator().manual_seed(7)
    slots = torch.tensor([3, 17], device=device)
    k = randn(2, 2, 64, dtype=torch.float32, device=device, gen=gen)
    v = randn(2, 2, 64, dtype=torch.float32, device=device, gen=gen)
    kc = poisoned(2, BLOCK_SIZE, 2, 64, dtype=torch.float16, device=device)
    vc = poisoned(2, BLOCK_SIZE, 2, 64, dtype=torch.float16, device=device)
    store_kv_triton(k, v, kc, vc, slots)
    torch.testing.assert_close(kc[1, 1], k[1].half(), rtol=0, atol=0)
    torch.testing.assert_close(vc[0, 3], v[0].half(), rtol=0, atol=0)
