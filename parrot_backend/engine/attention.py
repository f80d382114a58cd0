"""Attention over a paged KV cache: the backend interface and the torch backend.

The Triton backend is `triton_attention.py`. KV layout (shared with
`parrot_backend.kernels`): per layer, `k_cache` and `v_cache` are
`[num_blocks, block_size, num_kv_heads, head_dim]`. A token's slot is
`block_id * block_size + offset`; a sequence's blocks are listed in its block table.

A forward step carries a flat batch of T new tokens from B sequences. Sequence i owns
rows `query_start[i]:query_start[i+1]` of q, and its context is `seq_lens[i]` tokens long
(cached tokens plus its new ones); new tokens sit at the end of the context, so query j of
sequence i is at position `seq_lens[i] - q_len_i + j` and attends causally up to itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefixGroup:
    """Decode sequences forked from one ancestor: its first `prefix_len` tokens (blocks
    `prefix_blocks`) are shared, so a shared-prefix kernel can read them once."""

    seq_indices: list[int]
    prefix_len: int
    prefix_blocks: list[int]


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs for one forward step (built once, used by every layer)."""

    slot_mapping: torch.Tensor  # [T] int64, where each new token's K/V is written
    query_start: list[int]  # [B + 1] offsets of each sequence's rows in the flat batch
    seq_lens: list[int]  # [B] context length per sequence, new tokens included
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0 (masked by seq_lens)
    block_size: int
    prefix_groups: list[PrefixGroup] = field(default_factory=list)
    # prefill chunks of forks of one ancestor (`PrefixGroup`s of prefill sequences): a
    # backend that groups them reads the common prefix once for all the chunks' queries
    prefill_groups: list[PrefixGroup] = field(default_factory=list)
    # rows whose K/V is also written at a second slot (`copy_slots`): the parent's partial
    # block in the copy of a fork that joined the parent's step
    copy_rows: torch.Tensor | None = None
    copy_slots: torch.Tensor | None = None
    # lazily built helpers for the torch backend
    cache: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def query_len(self, i: int) -> int:
        return self.query_start[i + 1] - self.query_start[i]


def gather(flat: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`flat[slots]` for a cache laid out `[slots, Hkv, D]` and any shape of `slots`, by
    `index_select`: PyTorch's advanced indexing took 5-20x longer for the same rows on a
    CPU (8 x 300 slots: 203 vs 36 us; 12 x 1,100: 7.9 vs 0.37 ms)."""
    rows = flat.index_select(0, slots.reshape(-1))
    return rows.view(*slots.shape, *flat.shape[1:])


class AttentionBackend(ABC):
    """Writes new K/V into the paged cache and computes attention for a flat batch."""

    name: str = "abstract"

    def share_prefix(self, prefix_len: int, group_size: int) -> bool:
        """Whether decode rows sharing this many prefix tokens should be grouped; backends
        without a shared-prefix kernel never group."""
        return False

    def share_prefill_prefix(self, prefix_len: int, group_size: int) -> bool:
        """Whether prefill chunks of forks sharing this many prefix tokens should be grouped
        (`AttentionMetadata.prefill_groups`); backends without such a path never group."""
        return False

    @property
    def groups_prefill(self) -> bool:
        """Whether this backend has a grouped path for forks' prefill chunks."""
        return type(self).share_prefill_prefix is not AttentionBackend.share_prefill_prefix

    @property
    def groups_prefixes(self) -> bool:
        """Whether this backend has a shared-prefix path (it overrides `share_prefix`);
        the engine builds prefix groups only for such backends."""
        return type(self).share_prefix is not AttentionBackend.share_prefix

    @abstractmethod
    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """k, v: [T, Hkv, D]; write each row at its slot."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """q: [T, Hq, D] -> [T, Hq, D]; K/V of the new tokens are already stored."""


# The torch backend's gate: a group of decode rows reads its common prefix once when the
# prefix is at least this long and the rows' prefix tokens together (prefix x rows) at
# least this many. On a 2-core CPU (SmolLM2, benchmarks/shared_decode_cpu.py), once the
# gather had become cheap (index_select) and the matmuls packed, the grouped step was
# 0.80-0.95x of the plain one for 4-16 forks of 256-512 tokens and 4 of 768, level at 2
# forks, and faster from ~6,000 prefix tokens: 8 x 768 1.31x, 16 x 512 1.18x,
# 16 x 1,024 2.33x, 8 x 2,048 2.47x (before those changes, 256 tokens x 4 rows paid).
# Rechecked after GQA without expanded K/V and the group's slots built once a step (every
# size grouped vs plain, 12 tokens per fork): 0.81-0.97x below 4,096 prefix tokens,
# 512 x 8 1.06x, 1,024 x 4 0.96x, 512 x 16 1.25x, 1,024 x 8 1.85x, 1,024 x 16 1.93x.
# The gate was then 512 tokens and 6,144 in all. With the group on SDPA's fused kernel
# (AVX2 host, each grouped step beside a plain one on the same contexts, 32-64 tokens a
# fork; benchmarks/results/apps/overhead-probe/gate_ab.py, three runs): 2,048 prefix tokens
# 0.95-1.03x (256 x 8, 512 x 4, 1,024 x 2), 3,072 1.03-1.13x (256 x 12, 384 x 8,
# 512 x 6, 768 x 4, 1,536 x 2), 4,096 1.02-1.21x (256 x 16, 512 x 8, 1,024 x 4, 2,048 x 2).
TORCH_MIN_SHARED_PREFIX_LEN = 256
TORCH_MIN_SHARED_PREFIX_TOKENS = 3072
# ... and forks' prefill chunks read theirs once from these sizes. One SmolLM2 layer's
# attention, grouped vs plain (benchmarks/results/apps/overhead-probe/
# prefill_group_layer.py, ~19 new tokens a fork unless said): 2 x 1,024 1.08x, 4 x 512
# (40 new) 1.09x, 4 x 1,024 (200 new) 1.26x, 8 x 1,024 1.61x, 16 x 2,048 1.79x,
# 64 x 4,096 2.28x; below the gate noisy and often slower: 2 x 512 1.01x, 3 x 256
# (60 new) 0.89x, 4 x 256 0.69-1.67x, 2 x 128 0.75x, 8 x 64 0.61x.
TORCH_MIN_SHARED_PREFILL_PREFIX_LEN = 512
TORCH_MIN_SHARED_PREFILL_TOKENS = 2048


# SDPA's fused CPU kernel, called directly for the log-sum-exp it also returns (the public
# function drops it); None where this torch lacks it (the unfused path then runs)
try:
    _FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
except (AttributeError, RuntimeError):  # pragma: no cover - older or newer torch
    _FLASH_CPU = None


class TorchAttention(AttentionBackend):
    """Reference backend: gathers each sequence's K/V from its blocks and calls SDPA.

    Decode rows (one query per sequence) are batched with padding; prefill chunks run one
    sequence at a time with a causal mask offset by the cached length. Decode rows in a
    prefix group (`meta.prefix_groups`) attend to the group's shared prefix together: its
    K/V is gathered once and every row's queries meet it in one matmul; each row's own
    suffix is attended separately and the two partial states are merged by their
    log-sum-exp (the shared-prefix kernel's method, in torch). On a CPU, forks' prefill
    chunks in a prefix group (`meta.prefill_groups`) do the same.
    """

    name = "torch"
    # a prefix group's attention by SDPA's fused CPU kernel (`_shared_decode_fused`); off,
    # the unfused matmuls run (benchmarks/shared_decode_cpu.py measures both)
    fused_shared_decode = True
    # forks' prefill chunks over a common prefix read it once (`_shared_prefill`); off,
    # each chunk attends to its whole context by itself
    group_prefill = True

    def share_prefix(self, prefix_len: int, group_size: int) -> bool:
        return (
            prefix_len >= TORCH_MIN_SHARED_PREFIX_LEN
            and prefix_len * group_size >= TORCH_MIN_SHARED_PREFIX_TOKENS
        )

    def share_prefill_prefix(self, prefix_len: int, group_size: int) -> bool:
        return (
            self.group_prefill
            and prefix_len >= TORCH_MIN_SHARED_PREFILL_PREFIX_LEN
            and prefix_len * group_size >= TORCH_MIN_SHARED_PREFILL_TOKENS
        )

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping):
        nb, bs, h, d = k_cache.shape
        k_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))

    def forward(self, q, k_cache, v_cache, meta, scale):
        nb, bs, hkv, d = k_cache.shape
        flat_k = k_cache.view(nb * bs, hkv, d)
        flat_v = v_cache.view(nb * bs, hkv, d)
        gqa = q.shape[1] > hkv
        decode, prefill = self._split(meta)
        grouped = [g for g in meta.prefix_groups if g.seq_indices]
        if grouped:
            members = {i for g in grouped for i in g.seq_indices}
            decode = [i for i in decode if i not in members]
        pgroups = []
        if meta.prefill_groups and self._fused_ok(q):
            pgroups = [g for g in meta.prefill_groups if g.seq_indices]
            members = {i for g in pgroups for i in g.seq_indices}
            prefill = [i for i in prefill if i not in members]
        out = None if not (prefill or grouped or pgroups) else torch.empty_like(q)
        for g in pgroups:
            self._shared_prefill(q, out, flat_k, flat_v, meta, g, scale)
        for g in grouped:
            rows = [meta.query_start[i] for i in g.seq_indices]
            out[rows] = self._shared_decode(q[rows], flat_k, flat_v, meta, g, scale)
        if decode:
            rows, slots, mask = self._decode_plan(meta, decode, q.device)
            # [n, L, Hkv, D] -> [n, Hkv, L, D]
            k = gather(flat_k, slots).transpose(1, 2).to(q.dtype)
            v = gather(flat_v, slots).transpose(1, 2).to(q.dtype)
            n, hq, d = len(decode), q.shape[1], q.shape[2]
            # GQA: each KV head's query heads become that head's queries, [n, Hkv, Hq/Hkv,
            # D], so SDPA never expands K/V to the query heads (as `enable_gqa` does on a
            # CPU). The same values; a one-row decode step of SmolLM2 at 1,024 tokens took
            # 37-47 ms against 49-52 ms (benchmarks/shared_decode_cpu.py, N = 1)
            qd = (q if out is None else q[rows]).reshape(n, hkv, hq // hkv, d)
            o = F.scaled_dot_product_attention(qd, k, v, attn_mask=mask, scale=scale)
            o = o.reshape(n, hq, d)
            if out is None:
                return o  # a pure decode step: rows are 0..n-1 in order
            out[rows] = o
        for i in prefill:
            s, e = meta.query_start[i], meta.query_start[i + 1]
            slots, mask = self._prefill_plan(meta, i, q.device)
            # [1, Hkv, L, D]: SDPA takes its fused CPU kernel (with the mask and GQA) only
            # for 4-D inputs; 3-D ones fall back to the math path, ~3x slower at 512 tokens
            k = gather(flat_k, slots).transpose(0, 1).unsqueeze(0).to(q.dtype)
            v = gather(flat_v, slots).transpose(0, 1).unsqueeze(0).to(q.dtype)
            o = F.scaled_dot_product_attention(
                q[s:e].transpose(0, 1).unsqueeze(0),
                k,
                v,
                attn_mask=mask,
                scale=scale,
                enable_gqa=gqa,
            )
            out[s:e] = o[0].transpose(0, 1)
        return out

    def _shared_decode(
        self,
        q: torch.Tensor,
        flat_k: torch.Tensor,
        flat_v: torch.Tensor,
        meta: AttentionMetadata,
        g: PrefixGroup,
        scale: float,
    ) -> torch.Tensor:
        """Decode attention of one prefix group: q `[G, Hq, D]` -> `[G, Hq, D]`."""
        # (the fused kernel dies of SIGFPE on zero keys: an empty prefix takes this path)
        if self.fused_shared_decode and self._fused_ok(q) and g.prefix_len > 0:
            return self._shared_decode_fused(q, flat_k, flat_v, meta, g, scale)
        n, hq, d = q.shape
        hkv = flat_k.shape[1]
        r = hq // hkv
        slots, suffix, pad = self._shared_plan(meta, g, q.device)
        # the shared prefix, read once: the G rows' queries of each KV head in one matmul
        kp = gather(flat_k, slots).permute(1, 2, 0).float()  # [Hkv, D, Lp]
        vp = gather(flat_v, slots).transpose(0, 1).float()  # [Hkv, Lp, D]
        qf = q.float().view(n, hkv, r, d)
        sp = torch.matmul(qf.permute(1, 0, 2, 3).reshape(hkv, n * r, d), kp) * scale
        lse_p = torch.logsumexp(sp, dim=-1)  # [Hkv, G*r]
        o_p = torch.matmul(torch.softmax(sp, dim=-1), vp)  # [Hkv, G*r, D]
        lse_p = lse_p.view(hkv, n, r).permute(1, 0, 2)  # [G, Hkv, r]
        o_p = o_p.view(hkv, n, r, d).permute(1, 0, 2, 3)  # [G, Hkv, r, D]
        ks = gather(flat_k, suffix).permute(0, 2, 3, 1).float()  # [G, Hkv, D, Ls]
        vs = gather(flat_v, suffix).transpose(1, 2).float()  # [G, Hkv, Ls, D]
        ss = torch.matmul(qf, ks) * scale  # [G, Hkv, r, Ls]
        if pad is not None:
            ss = ss.masked_fill(pad, float("-inf"))
        lse_s = torch.logsumexp(ss, dim=-1)  # [G, Hkv, r]
        o_s = torch.matmul(torch.softmax(ss, dim=-1), vs)  # [G, Hkv, r, D]
        # merge the two partial states by their log-sum-exp (both are non-empty)
        m = torch.maximum(lse_p, lse_s)
        w_p = torch.exp(lse_p - m).unsqueeze(-1)
        w_s = torch.exp(lse_s - m).unsqueeze(-1)
        o = (o_p * w_p + o_s * w_s) / (w_p + w_s)
        return o.reshape(n, hq, d).to(q.dtype)

    def _shared_decode_fused(
        self,
        q: torch.Tensor,
        flat_k: torch.Tensor,
        flat_v: torch.Tensor,
        meta: AttentionMetadata,
        g: PrefixGroup,
        scale: float,
    ) -> torch.Tensor:
        """`_shared_decode` by SDPA's fused CPU kernel, which also returns each query's
        log-sum-exp: one call for the prefix (the G rows' queries of each KV head as one
        batch of G*r queries) and one for the rows' suffixes, merged as before. The same
        values; one SmolLM2 layer of 8 rows over a 1,024-token prefix took 644-883 against
        1,370-1,481 us, a whole decode step ~10% less (the unfused path's bmm, softmax,
        log-sum-exp and merge are ten ops; benchmarks/README.md)."""
        n, hq, d = q.shape
        hkv = flat_k.shape[1]
        r = hq // hkv
        slots, suffix, pad = self._shared_plan(meta, g, q.device)
        qg = q.view(n, hkv, r, d)
        kp = gather(flat_k, slots).transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, Hkv, Lp, D]
        vp = gather(flat_v, slots).transpose(0, 1).unsqueeze(0).to(q.dtype)
        qp = qg.permute(1, 0, 2, 3).reshape(1, hkv, n * r, d)
        o_p, lse_p = _FLASH_CPU(qp, kp, vp, 0.0, False, scale=scale)
        ks = gather(flat_k, suffix).transpose(1, 2).to(q.dtype)  # [G, Hkv, Ls, D]
        vs = gather(flat_v, suffix).transpose(1, 2).to(q.dtype)
        bias = None
        if pad is not None:  # padding as an additive mask, built once a step
            key = ("shared-bias", g.prefix_len, tuple(g.seq_indices), q.dtype)
            bias = meta.cache.get(key)
            if bias is None:
                bias = torch.zeros(pad.shape, dtype=q.dtype, device=q.device)
                bias = meta.cache[key] = bias.masked_fill(pad, float("-inf"))
        o_s, lse_s = _FLASH_CPU(qg, ks, vs, 0.0, False, attn_mask=bias, scale=scale)
        # merge: the prefix's weight is exp(lse_p) / (exp(lse_p) + exp(lse_s))
        w_p = torch.sigmoid(lse_p.view(hkv, n, r).permute(1, 0, 2) - lse_s).unsqueeze(-1)
        o_p = o_p.view(hkv, n, r, d).permute(1, 0, 2, 3).float()
        o_s = o_s.float()
        return (o_s + (o_p - o_s) * w_p).reshape(n, hq, d).to(q.dtype)

    @staticmethod
    def _fused_ok(q: torch.Tensor) -> bool:
        """Whether SDPA's fused CPU kernel (with its log-sum-exp) can run on `q`."""
        return _FLASH_CPU is not None and q.device.type == "cpu"

    def _shared_prefill(
        self,
        q: torch.Tensor,
        out: torch.Tensor,
        flat_k: torch.Tensor,
        flat_v: torch.Tensor,
        meta: AttentionMetadata,
        g: PrefixGroup,
        scale: float,
    ) -> None:
        """Prefill attention of forks' chunks that share a block-aligned prefix, into `out`.

        Every new token of every chunk sits after the prefix, so all of them see all of it:
        the prefix's K/V is gathered once and meets all the chunks' queries in one call of
        the fused kernel (query heads folded into the query length, as in decode). The
        chunks' own tokens after the prefix are attended causally in a second call (the
        chunks padded to one length), and the two partial states are merged by their
        log-sum-exp. Ungrouped, each fork gathered and attended to the whole prefix by
        itself, with its K/V expanded to the query heads."""
        hkv, d = flat_k.shape[1], q.shape[2]
        r = q.shape[1] // hkv
        rows, slots, pad_rows, valid, suffix, bias = self._prefill_group_plan(
            meta, g, r, q.dtype, q.device
        )
        t, f = rows.shape[0], suffix.shape[0]
        qg = q.index_select(0, rows).view(t, hkv, r, d)  # the chunks' rows, in order
        kp = gather(flat_k, slots).transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, Hkv, Lp, D]
        vp = gather(flat_v, slots).transpose(0, 1).unsqueeze(0).to(q.dtype)
        # [1, Hkv, r*Tg, D]: a KV head's r query heads, each over all the chunks' tokens
        qp = qg.permute(1, 2, 0, 3).reshape(1, hkv, r * t, d)
        o_p, lse_p = _FLASH_CPU(qp, kp, vp, 0.0, False, scale=scale)
        # the suffixes: chunk c's token j at padded row c*n + j, [F, Hkv, r*n, D]
        n = pad_rows.shape[0] // f
        qs = qg.index_select(0, pad_rows).view(f, n, hkv, r, d).permute(0, 2, 3, 1, 4)
        ks = gather(flat_k, suffix).transpose(1, 2).to(q.dtype)  # [F, Hkv, Ls, D]
        vs = gather(flat_v, suffix).transpose(1, 2).to(q.dtype)
        o_s, lse_s = _FLASH_CPU(
            qs.reshape(f, hkv, r * n, d), ks, vs, 0.0, False, attn_mask=bias, scale=scale
        )
        # both back to the chunks' rows: [Tg, Hkv, r, D] and [Tg, Hkv, r]
        o_s = o_s.view(f, hkv, r, n, d).permute(0, 3, 1, 2, 4).reshape(f * n, hkv, r, d)
        o_s = o_s.index_select(0, valid).float()
        lse_s = lse_s.view(f, hkv, r, n).permute(0, 3, 1, 2).reshape(f * n, hkv, r)
        lse_s = lse_s.index_select(0, valid)
        o_p = o_p.view(hkv, r, t, d).permute(2, 0, 1, 3).float()
        w_p = torch.sigmoid(lse_p.view(hkv, r, t).permute(2, 0, 1) - lse_s).unsqueeze(-1)
        o = o_s + (o_p - o_s) * w_p
        out.index_copy_(0, rows, o.reshape(t, hkv * r, d).to(q.dtype))

    def _prefill_group_plan(self, meta: AttentionMetadata, g: PrefixGroup, r: int, dtype, device):
        """A prefill group's plan, built once per step: its rows of q `[Tg]`, the prefix's
        slots `[Lp]`; for the suffix call, which of those rows fills each padded query row
        `[F*n]` and back `[Tg]`, the chunks' slots after the prefix `[F, Ls]` (padded with
        slot 0), and their causal mask as an additive bias `[F, 1, r*n, Ls]` (a padded
        query row sees key 0 only, so no row is empty)."""
        key = ("prefill-group", tuple(g.seq_indices), r, dtype)
        plan = meta.cache.get(key)
        if plan is not None:
            return plan
        bs = meta.block_size
        blocks = torch.tensor(g.prefix_blocks, dtype=torch.long, device=device)
        slots = (blocks.unsqueeze(1) * bs + torch.arange(bs, device=device)).flatten()
        slots = slots[: g.prefix_len]
        news = [meta.query_len(i) for i in g.seq_indices]
        lens = [meta.seq_lens[i] - g.prefix_len for i in g.seq_indices]
        f, n, ls = len(news), max(news), max(lens)
        rows, pad_rows, valid, a = [], [], [], 0
        suffix = torch.zeros(f, ls, dtype=torch.long, device=device)
        allowed = torch.zeros(f, n, ls, dtype=torch.bool, device=device)
        allowed[:, :, 0] = True
        for c, i in enumerate(g.seq_indices):
            s, e = meta.query_start[i], meta.query_start[i + 1]
            rows.extend(range(s, e))
            pad_rows.extend(list(range(a, a + news[c])) + [a] * (n - news[c]))
            valid.extend(range(c * n, c * n + news[c]))
            a += news[c]
            suffix[c, : lens[c]] = self._slots(meta, i, meta.seq_lens[i], device)[g.prefix_len :]
            # query j sits at suffix position lens - news + j and sees suffix keys 0..that
            pos_q = torch.arange(lens[c] - news[c], lens[c], device=device).unsqueeze(1)
            allowed[c, : news[c]] = torch.arange(ls, device=device).unsqueeze(0) <= pos_q
        bias = torch.zeros(allowed.shape, dtype=dtype, device=device)
        bias = bias.masked_fill(~allowed, float("-inf")).repeat(1, r, 1).unsqueeze(1)
        plan = (
            torch.tensor(rows, dtype=torch.long, device=device),
            slots,
            torch.tensor(pad_rows, dtype=torch.long, device=device),
            torch.tensor(valid, dtype=torch.long, device=device),
            suffix,
            bias,
        )
        meta.cache[key] = plan
        return plan

    def _shared_plan(self, meta: AttentionMetadata, g: PrefixGroup, device):
        """A prefix group's slots, built once per step (every layer reads the same): the
        prefix's `[Lp]`, each row's own tokens after it `[G, Ls]` (padded with slot 0),
        and where that padding is `[G, 1, 1, Ls]` (None when the rows are equally long)."""
        key = ("shared", g.prefix_len, tuple(g.seq_indices))
        plan = meta.cache.get(key)
        if plan is not None:
            return plan
        bs = meta.block_size
        blocks = torch.tensor(g.prefix_blocks, dtype=torch.long, device=device)
        slots = (blocks.unsqueeze(1) * bs + torch.arange(bs, device=device)).flatten()
        slots = slots[: g.prefix_len]
        # each row's own tokens after the prefix (its new token at least), padded
        lens = [meta.seq_lens[i] - g.prefix_len for i in g.seq_indices]
        width = max(lens)
        pos = g.prefix_len + torch.arange(width, device=device)
        rows = torch.tensor(g.seq_indices, dtype=torch.long, device=device)
        tables = meta.block_tables[rows].to(device=device, dtype=torch.long)
        lens_t = torch.tensor(lens, device=device)
        valid = torch.arange(width, device=device).unsqueeze(0) < lens_t.unsqueeze(1)
        idx = (pos // bs).clamp(max=tables.shape[1] - 1).unsqueeze(0).expand(len(lens), -1)
        suffix = (tables.gather(1, idx) * bs + pos % bs).masked_fill(~valid, 0)
        pad = None if min(lens) == width else ~valid[:, None, None, :]
        plan = (slots, suffix, pad)
        meta.cache[key] = plan
        return plan

    def _prefill_plan(self, meta: AttentionMetadata, i: int, device):
        """Slots of sequence i's context and its causal mask (built once per step)."""
        key = ("prefill", i)
        if key not in meta.cache:
            n_ctx, n_new = meta.seq_lens[i], meta.query_len(i)
            # query j sits at position n_ctx - n_new + j and sees keys 0..that position
            pos_q = torch.arange(n_ctx - n_new, n_ctx, device=device).unsqueeze(1)
            pos_k = torch.arange(n_ctx, device=device).unsqueeze(0)
            meta.cache[key] = (self._slots(meta, i, n_ctx, device), pos_k <= pos_q)
        return meta.cache[key]

    @staticmethod
    def _split(meta: AttentionMetadata) -> tuple[list[int], list[int]]:
        decode, prefill = [], []
        for i in range(meta.num_seqs):
            (decode if meta.query_len(i) == 1 else prefill).append(i)
        return decode, prefill

    @staticmethod
    def _slots(meta: AttentionMetadata, i: int, n: int, device) -> torch.Tensor:
        bs = meta.block_size
        nblocks = (n + bs - 1) // bs
        blocks = meta.block_tables[i, :nblocks].to(device=device, dtype=torch.long)
        slots = (blocks.unsqueeze(1) * bs + torch.arange(bs, device=device)).flatten()
        return slots[:n]

    def _decode_plan(self, meta: AttentionMetadata, decode: list[int], device):
        key = ("decode", tuple(decode))
        if key in meta.cache:
            return meta.cache[key]
        bs = meta.block_size
        lens = torch.tensor([meta.seq_lens[i] for i in decode], device=device)
        max_len = int(lens.max())
        nblocks = (max_len + bs - 1) // bs
        tables = meta.block_tables[decode, :nblocks].to(device=device, dtype=torch.long)
        slots = (tables.unsqueeze(2) * bs + torch.arange(bs, device=device)).flatten(1)
        slots = slots[:, :max_len]
        valid = torch.arange(max_len, device=device).unsqueeze(0) < lens.unsqueeze(1)
        slots = slots.masked_fill(~valid, 0)
        rows = torch.tensor([meta.query_start[i] for i in decode], device=device)
        # equal lengths need no mask, which lets SDPA take its fastest kernel
        mask = None if bool(valid.all()) else valid[:, None, None, :]  # [n, 1, 1, L]
        plan = (rows, slots, mask)
        meta.cache[key] = plan
        return plan


def find_prefix_groups(
    meta: AttentionMetadata, gate: Callable[[int, int], bool], prefill: bool = False
) -> list[PrefixGroup]:
    """Group decode rows (or, with `prefill`, prefill chunks) whose block tables start with
    the same physical blocks.

    Forked contexts share their ancestor's full blocks by reference (a shared partial block
    is copied on the child's first write), so equal leading block ids mean an equal,
    block-aligned prefix. Groups form at one level: the longest common run of blocks of all
    rows that share a first block. `gate(prefix_len, group_size)` decides if a group pays.
    The prefix ends before any row's first new token.
    """
    bs = meta.block_size
    buckets: dict[int, list[int]] = {}
    for i in range(meta.num_seqs):
        n = meta.query_len(i)
        if (n > 1 if prefill else n == 1) and meta.seq_lens[i] - n >= bs:
            buckets.setdefault(int(meta.block_tables[i, 0]), []).append(i)
    groups = []
    for members in buckets.values():
        if len(members) < 2:
            continue
        tables = meta.block_tables[members]
        # the blocks written this step are never part of the prefix
        full = min(meta.seq_lens[i] - meta.query_len(i) for i in members) // bs
        common = 0
        while common < full and bool((tables[:, common] == tables[0, common]).all()):
            common += 1
        if common and gate(common * bs, len(members)):
            groups.append(PrefixGroup(members, common * bs, tables[0, :common].tolist()))
    return groups


def make_backend(name: str) -> AttentionBackend:
    """Look up an attention backend by name ("torch" or "triton")."""
    if name == "torch":
        return TorchAttention()
    if name == "triton":
        from .triton_attention import TritonAttention

        return TritonAttention()
    raise ValueError(f"unknown attention backend {name!r} (choose 'torch' or 'triton')")
