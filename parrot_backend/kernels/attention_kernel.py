"""The one Triton attention kernel behind decode, extend and shared-prefix attention.

All three are the same computation on a different schedule: a tile of M rows attends to a
range of one paged KV sequence. An M row is a (query token, query head) pair; the query
heads that share a KV head (GQA) are stacked into M, so each K/V tile loaded from memory
serves all of them. The host describes the work as a table of tiles, one int32 row each:

    q_tok0    first query token of the tile (row of q)
    n_tok     tokens in the tile (<= BLOCK_M // GROUP)
    table     row of the block table that maps the KV positions to blocks
    kv_lo     first KV position to attend to
    kv_hi     one past the last KV position
    pos0      position of token q_tok0 in its sequence (token j sits at pos0 + j)
    o_row0    output row of token q_tok0

The grid is (tiles, kv heads, splits). Split s covers KV positions
`[kv_lo + s * split_len, kv_lo + (s + 1) * split_len) ∩ [kv_lo, kv_hi)` and writes a
partial output and its natural-log LSE to `out[s]`, `lse[s]`; `merge.merge_states_*`
combines them. A split with no keys writes output 0 and LSE -inf.

- decode: one token per tile, the sequence's whole context (or, for a shared-prefix
  group's suffix pass, positions prefix_len..seq_len-1).
- extend: a run of consecutive new tokens of one sequence, causal.
- shared prefix: tokens from many sequences of one group, all against the prefix blocks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ._triton import jit, launch_guard, next_pow2, require_triton, tl

TILE_FIELDS = 7


@jit
def _paged_attn_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    bt_ptr,
    tiles_ptr,
    o_ptr,
    lse_ptr,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ko,
    stride_kh,
    stride_vb,
    stride_vo,
    stride_vh,
    stride_bt,
    stride_os,
    stride_ot,
    stride_oh,
    stride_ls,
    stride_lt,
    scale,
    split_len,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    STORE_LSE: tl.constexpr,
    IEEE: tl.constexpr,
):
    # HEAD_DIM and BLOCK_SIZE are compile-time so that a head-dim mask known to be all-true
    # lets K/V loads vectorize, and block lookups become shifts
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    desc = tiles_ptr + tile * 7
    q_tok0 = tl.load(desc + 0)
    n_tok = tl.load(desc + 1)
    trow = tl.load(desc + 2).to(tl.int64)
    kv_lo = tl.load(desc + 3)
    kv_hi = tl.load(desc + 4)
    pos0 = tl.load(desc + 5)
    o_row0 = tl.load(desc + 6)

    # M row -> (token of the tile, query head); rows past the last whole token are padding
    rows = tl.arange(0, BLOCK_M)
    tok = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = (rows < (BLOCK_M // GROUP) * GROUP) & (tok < n_tok)
    ds = tl.arange(0, BLOCK_D)
    d_ok = ds < HEAD_DIM
    q_off = (q_tok0 + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_ptr + q_off + ds[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    lo = kv_lo + split * split_len
    hi = tl.minimum(lo + split_len, kv_hi)
    q_pos = pos0 + tok
    if CAUSAL:
        # no key after the tile's last token is visible to any of its rows
        hi = tl.minimum(hi, pos0 + n_tok)

    # online softmax state; a finite floor keeps fully masked rows free of inf - inf
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        k_ok = pos < hi
        blk = tl.load(bt_ptr + trow * stride_bt + pos // BLOCK_SIZE, mask=k_ok, other=0)
        off = (pos % BLOCK_SIZE).to(tl.int64)
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k_addr = blk.to(tl.int64) * stride_kb + off * stride_ko + kvh * stride_kh
        k = tl.load(kc_ptr + k_addr[:, None] + ds[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
        s = s * scale
        mask = row_ok[:, None] & k_ok[None, :]
        if CAUSAL:
            mask = mask & (pos[None, :] <= q_pos[:, None])
        s = tl.where(mask, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_addr = blk.to(tl.int64) * stride_vb + off * stride_vo + kvh * stride_vh
        v = tl.load(vc_ptr + v_addr[:, None] + ds[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    o_tok = (o_row0 + tok).to(tl.int64)
    o_off = split * stride_os + o_tok[:, None] * stride_ot + head[:, None] * stride_oh
    tl.store(
        o_ptr + o_off + ds[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )
    if STORE_LSE:
        lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + split * stride_ls + o_tok * stride_lt + head, lse, mask=row_ok)


def tokens_per_tile(block_m: int, group: int) -> int:
    """Whole query tokens that fit in a tile of `block_m` rows (GQA heads stacked in M)."""
    if group > block_m:
        raise ValueError(f"GQA group {group} does not fit in BLOCK_M={block_m}")
    return block_m // group


def block_m_for(rows: int, group: int, cap: int = 128) -> int:
    """A tile height (power of two, >= 16 for tl.dot) for `rows` M rows."""
    return max(16, next_pow2(group), min(cap, next_pow2(rows)))


def make_tiles(
    items: Sequence[tuple[int, int, int, int, int, int, int]],
    group: int,
    block_m: int,
    device: torch.device,
) -> torch.Tensor:
    """Cut work items (same fields as a tile, any number of tokens) into tiles."""
    per = tokens_per_tile(block_m, group)
    rows: list[tuple[int, ...]] = []
    for q_tok0, n_tok, table, kv_lo, kv_hi, pos0, o_row0 in items:
        for j in range(0, n_tok, per):
            rows.append(
                (q_tok0 + j, min(per, n_tok - j), table, kv_lo, kv_hi, pos0 + j, o_row0 + j)
            )
    return torch.tensor(rows, dtype=torch.int32, device=device).reshape(-1, TILE_FIELDS)


def choose_splits(programs: int, max_kv: int, block_n: int, device: torch.device) -> int:
    """Split the KV range when the other grid axes leave the GPU underfilled.

    Aims for about two programs per SM, with at least four KV tiles per split so the
    partial results stay cheap to merge. On the CPU interpreter splits only cost time.
    """
    if device.type != "cuda" or programs <= 0:
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = math.ceil(2 * sms / programs)
    by_len = math.ceil(max_kv / (4 * block_n))
    return max(1, min(want, by_len, 128))


def default_block_n(dtype: torch.dtype | None) -> int:
    """KV positions per loop iteration (a multiple of 16 for tl.dot).

    64 keeps bf16/fp16 tiles in registers on sm_80/sm_90 (see `aot_check`); fp32 runs
    IEEE dots on the FMA path and spills less with 32.
    """
    return 32 if dtype == torch.float32 else 64


def launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    tiles: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    scale: float,
    *,
    split_len: int,
    causal: bool,
    block_m: int,
    block_n: int = 64,
) -> None:
    """Run the kernel. q `[T, Hq, D]`; out `[S, rows, Hq, D]`; lse `[S, rows, Hq]` fp32.

    S (the number of KV splits) is out.shape[0]; `split_len` KV positions per split.
    """
    require_triton()
    n_tiles = tiles.shape[0]
    if n_tiles == 0:
        return
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    if hq % hkv:
        raise ValueError(f"{hq} query heads do not divide into {hkv} KV heads")
    group = hq // hkv
    for t in (q, k_cache, v_cache, out):
        if t.stride(-1) != 1:
            raise ValueError("attention tensors need a unit stride in the head dim")
    if lse is not None and (lse.stride(-1) != 1 or lse.dtype != torch.float32):
        raise ValueError("lse must be fp32 with unit stride over heads")
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    lse_arg = lse if lse is not None else out  # unused when STORE_LSE is off
    grid = (n_tiles, hkv, out.shape[0])
    with launch_guard():
        _paged_attn_kernel[grid](
            q,
            k_cache,
            v_cache,
            block_tables,
            tiles,
            out,
            lse_arg,
            q.stride(0),
            q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            v_cache.stride(0),
            v_cache.stride(1),
            v_cache.stride(2),
            block_tables.stride(0),
            out.stride(0),
            out.stride(1),
            out.stride(2),
            lse.stride(0) if lse is not None else 0,
            lse.stride(1) if lse is not None else 0,
            float(scale),
            max(1, int(split_len)),
            GROUP=group,
            HEAD_DIM=d,
            BLOCK_SIZE=k_cache.shape[1],
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_D=max(16, next_pow2(d)),
            CAUSAL=causal,
            STORE_LSE=lse is not None,
            IEEE=q.dtype == torch.float32,
            num_warps=4 if block_m <= 64 else 8,
        )
