"""Shared-prefix (cascade) decode: a group forked from one ancestor reads its prefix once.

Every sequence of a group has the ancestor's first `prefix_len` tokens (stored in
`prefix_blocks`; `prefix_len` need not be block-aligned) followed by its own suffix,
positions prefix_len..seq_len-1 of its own block table. Attention splits into:

1. prefix pass: all the group's queries × the GQA heads of one KV head are stacked as the
   M dimension of one tile, so each prefix K/V tile is loaded once and serves the whole
   group (a group taller than one tile is cut into M tiles that run side by side and
   share the loads through L2);
2. suffix pass: per-sequence paged decode over the suffix (`decode`, with kv_start);
3. merge of both partial states by log-sum-exp (`merge`, natural log, fp32).

Nesting: prefixes are grouped at ONE level. A sequence belongs to at most one group; if
its ancestors nest (a system prompt shared by 64 sequences, then a document shared by 8
of them), the engine picks one ancestor per group and everything after it is suffix. The
kernel and merge already take any number of partial states, so a multi-level cascade
would add one prefix pass per level; it needs nested groups in the metadata first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import attention_kernel as ak
from ._ref import attend, gather_kv
from ._triton import require_triton
from .decode import DecodePlan, plan_decode
from .merge import merge_states_triton


def shared_prefix_decode_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: Sequence[int],
    prefix_len: int,
    prefix_blocks: Sequence[int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for one group: q `[n, Hq, D]`, query i the last token of sequence i.

    Sequence i's keys are the prefix (from `prefix_blocks`) then its suffix (from
    `block_tables[i]`), attended with one plain softmax. Returns (out, lse `[n, Hq]`).
    """
    pk = gather_kv(k_cache, list(prefix_blocks), 0, prefix_len)
    pv = gather_kv(v_cache, list(prefix_blocks), 0, prefix_len)
    outs, lses = [], []
    for i, n_ctx in enumerate(seq_lens):
        k = torch.cat([pk, gather_kv(k_cache, block_tables[i], prefix_len, n_ctx)])
        v = torch.cat([pv, gather_kv(v_cache, block_tables[i], prefix_len, n_ctx)])
        o, lse = attend(q[i : i + 1], k, v, scale)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs).to(q.dtype), torch.cat(lses)


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One group as the kernels see it; its members are consecutive rows of packed q."""

    table_rows: Sequence[int]  # each member's row in the block table
    seq_lens: Sequence[int]
    prefix_len: int
    prefix_blocks: Sequence[int]


@dataclass(frozen=True, slots=True)
class SharedPrefixPlan:
    """Tiles for the prefix pass and the suffix pass (reusable across layers)."""

    prefix_tiles: torch.Tensor
    prefix_tables: torch.Tensor  # [groups, max prefix blocks] int32
    prefix_splits: int
    prefix_split_len: int
    prefix_block_m: int
    block_n: int
    suffix: DecodePlan
    num_rows: int


def plan_shared_prefix(
    groups: Sequence[GroupSpec],
    group: int,
    num_kv_heads: int,
    block_size: int,
    device: torch.device,
    *,
    prefix_splits: int | None = None,
    suffix_splits: int | None = None,
    block_n: int | None = None,
    max_block_m: int = 128,
    dtype: torch.dtype | None = None,
) -> SharedPrefixPlan:
    """Plan the passes for groups whose members are packed in order in q.

    The prefix tile is as tall as the largest group (up to `max_block_m` rows).
    """
    block_n = block_n or ak.default_block_n(dtype)
    largest = max((len(g.table_rows) for g in groups), default=1)
    block_m = ak.block_m_for(largest * group, group, cap=max_block_m)
    items, q_rows, tables, starts, lens = [], [], [], [], []
    row = 0
    width = 1
    for gi, g in enumerate(groups):
        n = len(g.table_rows)
        if len(g.seq_lens) != n:
            raise ValueError("a group needs one seq_len per member")
        if g.prefix_len < 0 or any(g.prefix_len > s for s in g.seq_lens):
            raise ValueError(f"prefix_len {g.prefix_len} exceeds a member's context")
        need = math.ceil(g.prefix_len / block_size)
        if len(g.prefix_blocks) < need:
            raise ValueError(
                f"prefix of {g.prefix_len} tokens needs {need} blocks, got {len(g.prefix_blocks)}"
            )
        width = max(width, len(g.prefix_blocks))
        # prefix pass: non-causal (every prefix position precedes each member's query)
        items.append((row, n, gi, 0, g.prefix_len, 0, row))
        q_rows += range(row, row + n)
        tables += g.table_rows
        starts += [g.prefix_len] * n
        lens += g.seq_lens
        row += n
    prefix_tables = torch.zeros(len(groups), width, dtype=torch.int32)
    for gi, g in enumerate(groups):
        prefix_tables[gi, : len(g.prefix_blocks)] = torch.as_tensor(list(g.prefix_blocks))
    tiles = ak.make_tiles(items, group, block_m, device)
    longest = max((g.prefix_len for g in groups), default=0)
    if prefix_splits is None:
        prefix_splits = ak.choose_splits(tiles.shape[0] * num_kv_heads, longest, block_n, device)
    split_len = math.ceil(max(longest, 1) / max(1, prefix_splits) / block_n) * block_n
    prefix_splits = math.ceil(max(longest, 1) / split_len)
    suffix = plan_decode(
        q_rows,
        lens,
        starts,
        group,
        num_kv_heads,
        device,
        num_splits=suffix_splits,
        block_n=block_n,
        table_rows=tables,
        dtype=dtype,
    )
    return SharedPrefixPlan(
        tiles, prefix_tables.to(device), prefix_splits, split_len, block_m, block_n, suffix, row
    )


def run_shared_prefix(
    plan: SharedPrefixPlan,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: packed members `[rows, Hq, D]` -> (out `[rows, Hq, D]`, lse `[rows, Hq]`)."""
    _, hq, d = q.shape
    s1, s2 = plan.prefix_splits, plan.suffix.num_splits
    parts = torch.empty(s1 + s2, plan.num_rows, hq, d, dtype=torch.float32, device=q.device)
    lse_parts = torch.empty(s1 + s2, plan.num_rows, hq, dtype=torch.float32, device=q.device)
    ak.launch(
        q,
        k_cache,
        v_cache,
        plan.prefix_tables,
        plan.prefix_tiles,
        parts[:s1],
        lse_parts[:s1],
        scale,
        split_len=plan.prefix_split_len,
        causal=False,
        block_m=plan.prefix_block_m,
        block_n=plan.block_n,
    )
    ak.launch(
        q,
        k_cache,
        v_cache,
        block_tables,
        plan.suffix.tiles,
        parts[s1:],
        lse_parts[s1:],
        scale,
        split_len=plan.suffix.split_len,
        causal=False,
        block_m=plan.suffix.block_m,
        block_n=plan.suffix.block_n,
    )
    out, lse = merge_states_triton(parts, lse_parts, q.dtype, out=out)
    assert lse is not None
    return out, lse


def shared_prefix_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: Sequence[int],
    prefix_len: int,
    prefix_blocks: Sequence[int],
    scale: float,
    *,
    prefix_splits: int | None = None,
    suffix_splits: int | None = None,
    block_n: int | None = None,
    max_block_m: int = 128,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `shared_prefix_decode_ref` (one group)."""
    require_triton()
    spec = GroupSpec(list(range(q.shape[0])), list(seq_lens), prefix_len, list(prefix_blocks))
    hkv = k_cache.shape[2]
    plan = plan_shared_prefix(
        [spec],
        q.shape[1] // hkv,
        hkv,
        k_cache.shape[1],
        q.device,
        prefix_splits=prefix_splits,
        suffix_splits=suffix_splits,
        block_n=block_n,
        max_block_m=max_block_m,
        dtype=q.dtype,
    )
    return run_shared_prefix(plan, q, k_cache, v_cache, block_tables, scale, out)


def prefix_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_len: int,
    prefix_blocks: Sequence[int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefix pass alone: every query against the prefix -> (o fp32, lse)."""
    k = gather_kv(k_cache, list(prefix_blocks), 0, prefix_len)
    v = gather_kv(v_cache, list(prefix_blocks), 0, prefix_len)
    return attend(q, k, v, scale)
