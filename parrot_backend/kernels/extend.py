"""Prefill / extend attention over a paged KV cache.

Sequence i owns q rows `query_start[i]:query_start[i+1]` and has `seq_lens[i]` tokens of
context, its new tokens included and already stored in the cache (so a forked child's
prefill reads its parent's blocks through its own block table). Query j of sequence i sits
at position `seq_lens[i] - q_len + j` and attends causally to positions 0..itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import attention_kernel as ak
from ._ref import attend, gather_kv
from ._triton import require_triton


def extend_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: Sequence[int],
    seq_lens: Sequence[int],
    scale: float,
) -> torch.Tensor:
    """Reference: q `[T, Hq, D]` -> `[T, Hq, D]` (rows outside every sequence stay zero)."""
    out = torch.zeros_like(q)
    for i, n_ctx in enumerate(seq_lens):
        s, e = query_start[i], query_start[i + 1]
        if e == s:
            continue
        k = gather_kv(k_cache, block_tables[i], 0, n_ctx)
        v = gather_kv(v_cache, block_tables[i], 0, n_ctx)
        q_pos = torch.arange(n_ctx - (e - s), n_ctx, device=q.device)
        mask = torch.arange(n_ctx, device=q.device)[None, :] <= q_pos[:, None]
        out[s:e] = attend(q[s:e], k, v, scale, mask)[0].to(q.dtype)
    return out


@dataclass(frozen=True, slots=True)
class ExtendPlan:
    """Tiles for one extend launch (reusable across layers)."""

    tiles: torch.Tensor
    split_len: int
    block_m: int
    block_n: int


def plan_extend(
    seqs: Sequence[int],
    query_start: Sequence[int],
    seq_lens: Sequence[int],
    group: int,
    device: torch.device,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    dtype: torch.dtype | None = None,
) -> ExtendPlan:
    """Tiles of consecutive new tokens for the listed sequences; output rows = q rows."""
    block_n = block_n or ak.default_block_n(dtype)
    block_m = block_m or ak.block_m_for(64, group, cap=64)
    items = []
    for i in seqs:
        s, e = query_start[i], query_start[i + 1]
        if e > s:
            items.append((s, e - s, i, 0, seq_lens[i], seq_lens[i] - (e - s), s))
    longest = max((seq_lens[i] for i in seqs), default=1)
    return ExtendPlan(
        ak.make_tiles(items, group, block_m, device), max(longest, 1), block_m, block_n
    )


def run_extend(
    plan: ExtendPlan,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Write the planned rows of `out` (`[T, Hq, D]`, same dtype as q)."""
    ak.launch(
        q,
        k_cache,
        v_cache,
        block_tables,
        plan.tiles,
        out.unsqueeze(0),
        None,
        scale,
        split_len=plan.split_len,
        causal=True,
        block_m=plan.block_m,
        block_n=plan.block_n,
    )


def extend_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: Sequence[int],
    seq_lens: Sequence[int],
    scale: float,
    *,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Triton version of `extend_attention_ref` (rows outside every sequence are untouched)."""
    require_triton()
    out = torch.empty_like(q) if out is None else out
    plan = plan_extend(
        range(len(seq_lens)),
        query_start,
        seq_lens,
        q.shape[1] // k_cache.shape[2],
        q.device,
        block_m=block_m,
        block_n=block_n,
        dtype=q.dtype,
    )
    run_extend(plan, q, k_cache, v_cache, block_tables, scale, out)
    return out
