"""Paged decode attention: one query token per sequence against its whole paged context.

GQA (the query heads of one KV head share each loaded K/V tile), ragged lengths, block
tables, and split-KV: when sequences × KV heads leave the GPU underfilled, each context
is cut into splits whose partial outputs are merged by log-sum-exp (`merge`).
`kv_start` lets a sequence attend only to positions kv_start..seq_len-1 (the suffix pass
of shared-prefix decode).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import attention_kernel as ak
from ._ref import attend, gather_kv
from ._triton import require_triton
from .merge import merge_states_triton


def paged_decode_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: Sequence[int],
    scale: float,
    kv_start: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference. q `[n, Hq, D]` (query i is the last token of sequence i).

    Returns (out `[n, Hq, D]` in q's dtype, lse `[n, Hq]` fp32).
    """
    outs, lses = [], []
    for i, n_ctx in enumerate(seq_lens):
        lo = kv_start[i] if kv_start is not None else 0
        k = gather_kv(k_cache, block_tables[i], lo, n_ctx)
        v = gather_kv(v_cache, block_tables[i], lo, n_ctx)
        o, lse = attend(q[i : i + 1], k, v, scale)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs).to(q.dtype), torch.cat(lses)


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """Tiles and split layout for one decode launch (reusable across layers)."""

    tiles: torch.Tensor
    num_rows: int  # output rows
    num_splits: int
    split_len: int
    block_m: int
    block_n: int


def plan_decode(
    q_rows: Sequence[int],
    seq_lens: Sequence[int],
    kv_start: Sequence[int] | None,
    group: int,
    num_kv_heads: int,
    device: torch.device,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    table_rows: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
) -> DecodePlan:
    """One tile per sequence: query row `q_rows[i]` -> output row i, block-table row
    `table_rows[i]` (default i), KV positions `kv_start[i]..seq_lens[i]-1`. `dtype` (of q)
    picks the default KV step."""
    block_n = block_n or ak.default_block_n(dtype)
    block_m = ak.block_m_for(group, group)
    starts = list(kv_start) if kv_start is not None else [0] * len(seq_lens)
    tables = list(table_rows) if table_rows is not None else list(range(len(seq_lens)))
    items = [
        (r, 1, t, s, n, n - 1, i)
        for i, (r, t, s, n) in enumerate(zip(q_rows, tables, starts, seq_lens, strict=True))
    ]
    longest = max((n - s for s, n in zip(starts, seq_lens, strict=True)), default=0)
    if num_splits is None:
        num_splits = ak.choose_splits(len(items) * num_kv_heads, longest, block_n, device)
    num_splits = max(1, min(num_splits, math.ceil(max(longest, 1) / 16)))
    # splits start on a block_n boundary so each split's loop has no extra partial tile
    split_len = math.ceil(max(longest, 1) / num_splits / block_n) * block_n
    num_splits = math.ceil(max(longest, 1) / split_len)
    tiles = ak.make_tiles(items, group, block_m, device)
    return DecodePlan(tiles, len(items), num_splits, split_len, block_m, block_n)


def run_decode(
    plan: DecodePlan,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a plan; returns (out `[rows, Hq, D]` in q's dtype, lse `[rows, Hq]`).

    `out`, if given, must be contiguous `[rows, Hq, D]` in q's dtype.
    """
    _, hq, d = q.shape
    rows = plan.num_rows
    if out is None:
        out = torch.empty(rows, hq, d, dtype=q.dtype, device=q.device)
    if plan.num_splits == 1:
        lse = torch.empty(rows, hq, dtype=torch.float32, device=q.device)
        ak.launch(
            q,
            k_cache,
            v_cache,
            block_tables,
            plan.tiles,
            out.unsqueeze(0),
            lse.unsqueeze(0),
            scale,
            split_len=plan.split_len,
            causal=False,
            block_m=plan.block_m,
            block_n=plan.block_n,
        )
        return out, lse
    parts = torch.empty(plan.num_splits, rows, hq, d, dtype=torch.float32, device=q.device)
    lse_parts = torch.empty(plan.num_splits, rows, hq, dtype=torch.float32, device=q.device)
    ak.launch(
        q,
        k_cache,
        v_cache,
        block_tables,
        plan.tiles,
        parts,
        lse_parts,
        scale,
        split_len=plan.split_len,
        causal=False,
        block_m=plan.block_m,
        block_n=plan.block_n,
    )
    _, lse = merge_states_triton(parts, lse_parts, q.dtype, out=out)
    return out, lse


def paged_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: Sequence[int],
    scale: float,
    kv_start: Sequence[int] | None = None,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `paged_decode_ref`; `num_splits` forces the split-KV count."""
    require_triton()
    plan = plan_decode(
        range(q.shape[0]),
        seq_lens,
        kv_start,
        q.shape[1] // k_cache.shape[2],
        k_cache.shape[2],
        q.device,
        num_splits=num_splits,
        block_n=block_n,
        dtype=q.dtype,
    )
    return run_decode(plan, q, k_cache, v_cache, block_tables, scale, out)
