"""LSE merge kernel vs its reference, and the merge identity itself."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import poisoned, randn  # noqa: E402

from parrot_backend.kernels._ref import attend  # noqa: E402
from parrot_backend.kernels.merge import merge_states_ref, merge_states_triton  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("parts", [1, 2, 5])
def test_merge_matches_reference_with_empty_parts(parts, dtype, device):
    gen = torch.Generator().manual_seed(parts)
    o = randn(parts, 5, 3, 64, dtype=torch.float32, device=device, gen=gen)
    lse = randn(parts, 5, 3, dtype=torch.float32, device=device, gen=gen) * 4
    lse[0, 1] = float("-inf")  # an empty part for one row
    lse[:, 2, 0] = float("-inf")  # a row with no keys at all
    o[:, 2, 0] = 0.0
    out = poisoned(5, 3, 64, dtype=dtype, device=device)
    got, got_lse = merge_states_triton(o, lse, dtype, out=out)
    want, want_lse = merge_states_ref(o, lse, dtype)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-3, "rtol": 2e-3}
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(got_lse, want_lse)
    assert torch.all(got[2, 0] == 0) and got_lse[2, 0] == float("-inf")


def test_merging_two_key_halves_equals_attention_over_all_keys(device):
    gen = torch.Generator().manual_seed(3)
    q = randn(4, 6, 64, dtype=torch.float32, device=device, gen=gen)
    k = randn(40, 2, 64, dtype=torch.float32, device=device, gen=gen)
    v = randn(40, 2, 64, dtype=torch.float32, device=device, gen=gen)
    o1, l1 = attend(q, k[:13], v[:13], 0.125)
    o2, l2 = attend(q, k[13:], v[13:], 0.125)
    got, got_lse = merge_states_triton(torch.stack([o1, o2]), torch.stack([l1, l2]))
    want, want_lse = attend(q, k, v, 0.125)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_lse, want_lse, atol=1e-5, rtol=1e-5)
