"""Shared builders for the kernel tests: random paged caches, block tables, tolerances."""

from __future__ import annotations

import math

import torch

BLOCK_SIZE = 16


def tol(dtype: torch.dtype) -> dict[str, float]:
    """assert_close tolerances: fp32 kernels run IEEE dots; fp16 keeps ~3 decimal digits."""
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 4e-3, "rtol": 4e-3}


def random_cache(
    num_blocks: int,
    hkv: int,
    d: int,
    dtype: torch.dtype,
    device: torch.device,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches full of random (never zero) values."""
    shape = (num_blocks, BLOCK_SIZE, hkv, d)
    k = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
    v = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
    return k, v


def random_tables(
    lens: list[int],
    num_blocks: int,
    gen: torch.Generator,
    device: torch.device,
    reserved: int = 0,
) -> torch.Tensor:
    """Block tables whose blocks are distinct, shuffled, and never the first `reserved`."""
    need = [math.ceil(n / BLOCK_SIZE) for n in lens]
    width = max(max(need, default=1), 1)
    pool = torch.randperm(num_blocks - reserved, generator=gen) + reserved
    assert sum(need) <= len(pool), "cache too small for these lengths"
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = pool[used : used + n]
        used += n
    return table.to(device)


def poisoned(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An output buffer full of NaN, so any element no kernel writes fails the check."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def randn(
    *shape: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator
) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype=dtype, device=device)


def forked_group(
    kc: torch.Tensor,
    vc: torch.Tensor,
    prefix_len: int,
    suffix_lens: list[int],
    first_free: int,
    gen: torch.Generator,
) -> tuple[list[int], torch.Tensor, int]:
    """Lay out a group forked from one ancestor, the way the engine's context tree does.

    The ancestor's prefix fills blocks first_free.. ; each member shares its full blocks,
    copies a partly filled last block (copy-on-write, then overwrites the tail with its own
    tokens) and appends fresh blocks. Returns (prefix_blocks, member tables, next free).
    """
    bs = BLOCK_SIZE
    n_full, tail = divmod(prefix_len, bs)
    prefix_blocks = list(range(first_free, first_free + n_full + (1 if tail else 0)))
    nxt = first_free + len(prefix_blocks)
    rows = []
    for s in suffix_lens:
        row = prefix_blocks[:n_full]
        if tail:
            kc[nxt], vc[nxt] = kc[prefix_blocks[-1]], vc[prefix_blocks[-1]]
            own = torch.randn((bs - tail, *kc.shape[2:]), generator=gen)
            kc[nxt, tail:] = own.to(kc.dtype)
            vc[nxt, tail:] = (own * 0.5 + 0.1).to(vc.dtype)
            row = row + [nxt]
            nxt += 1
        need = math.ceil((prefix_len + s) / bs) - len(row)
        row = row + list(range(nxt, nxt + need))
        nxt += need
        rows.append(row)
    width = max(len(r) for r in rows)
    table = torch.zeros(len(rows), width, dtype=torch.int32)
    for i, r in enumerate(rows):
        table[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
    assert nxt <= kc.shape[0], "cache too small for this group"
    return prefix_blocks, table.to(kc.device), nxt
