"""`TritonAttention`: the engine's attention backend on CUDA, and the prefix-sharing gate.

It lives with the engine's other backends (`attention.py`); the kernels it launches
(`parrot_backend.kernels`) take tensors and plans and know nothing of the engine.

Per forward step the backend sorts the batch's sequences into three launches:
- prefill / extend rows (more than one new token) -> `extend` (causal, paged context);
- decode rows in a `PrefixGroup` -> `shared_prefix` (prefix once per group, then suffix,
  merged by LSE);
- other decode rows -> `decode` (split-KV when the GPU would be underfilled).
The plans (tile tables) are built once per step and cached in `meta.cache`, so every layer
reuses them. The engine decides which groups exist, asking `should_share_prefix`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parrot_backend.kernels._triton import require_triton
from parrot_backend.kernels.decode import DecodePlan, plan_decode, run_decode
from parrot_backend.kernels.extend import ExtendPlan, plan_extend, run_extend
from parrot_backend.kernels.kv_store import store_kv_triton
from parrot_backend.kernels.shared_prefix import (
    GroupSpec,
    SharedPrefixPlan,
    plan_shared_prefix,
    run_shared_prefix,
)

from .attention import AttentionBackend, AttentionMetadata

# The gate's thresholds. Published measurements put cascade kernels behind plain paged
# decode at a 64-token prefix, and vLLM takes its cascade path only from a 256-token
# common prefix and 8 requests. We start from the same numbers; retune them from
# benchmarks/kernels/bench_attention.py on the target GPU.
MIN_SHARED_PREFIX_LEN = 256
MIN_SHARED_GROUP_SIZE = 8


def should_share_prefix(prefix_len: int, group_size: int) -> bool:
    """Whether a decode group with this common prefix should take the shared-prefix path.

    Sharing saves `(group_size - 1) * prefix_len` token reads of K/V but costs a second
    pass and a merge; below the thresholds the saving does not pay for the extra launches.
    """
    return prefix_len >= MIN_SHARED_PREFIX_LEN and group_size >= MIN_SHARED_GROUP_SIZE


@dataclass(slots=True)
class _StepPlan:
    block_tables: torch.Tensor
    extend: ExtendPlan | None
    decode: DecodePlan | None
    decode_rows: torch.Tensor | None
    shared: SharedPrefixPlan | None
    shared_rows: torch.Tensor | None


class TritonAttention(AttentionBackend):
    """Paged attention with Triton kernels; see the module docstring for the dispatch."""

    name = "triton"

    def __init__(self) -> None:
        require_triton()
        # how the output is allocated; tests poison it to catch rows no kernel writes
        self.alloc_out = torch.empty_like

    def share_prefix(self, prefix_len: int, group_size: int) -> bool:
        return should_share_prefix(prefix_len, group_size)

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping):
        store_kv_triton(k, v, k_cache, v_cache, slot_mapping)

    def forward(self, q, k_cache, v_cache, meta, scale):
        q = q.contiguous()  # the kernels index q by its shape (the model may pass a view)
        plan = self._plan(meta, q, k_cache)
        out = self.alloc_out(q)
        bt = plan.block_tables
        if plan.extend is not None:
            run_extend(plan.extend, q, k_cache, v_cache, bt, scale, out)
        if plan.decode is not None:
            o, _ = run_decode(plan.decode, q, k_cache, v_cache, bt, scale)
            out[plan.decode_rows] = o
        if plan.shared is not None:
            o, _ = run_shared_prefix(plan.shared, q[plan.shared_rows], k_cache, v_cache, bt, scale)
            out[plan.shared_rows] = o
        return out

    def _plan(self, meta: AttentionMetadata, q: torch.Tensor, k_cache: torch.Tensor):
        hq, hkv = q.shape[1], k_cache.shape[2]
        key = ("triton", str(q.device), q.dtype, hq, hkv)
        if key not in meta.cache:
            meta.cache[key] = build_plan(meta, hq // hkv, hkv, q.device, q.dtype)
        return meta.cache[key]


def build_plan(
    meta: AttentionMetadata,
    group: int,
    num_kv_heads: int,
    device: torch.device,
    dtype: torch.dtype | None = None,
) -> _StepPlan:
    """Sort the step's sequences into extend, plain decode and shared-prefix launches."""
    n = meta.num_seqs
    grouped: dict[int, int] = {}
    for gi, g in enumerate(meta.prefix_groups):
        for i in g.seq_indices:
            if not 0 <= i < n:
                raise ValueError(f"prefix group {gi} names sequence {i} of {n}")
            if meta.query_len(i) != 1:
                raise ValueError(f"prefix group {gi}: sequence {i} is not a decode row")
            if i in grouped:
                raise ValueError(f"sequence {i} is in prefix groups {grouped[i]} and {gi}")
            grouped[i] = gi
    extend_seqs = [i for i in range(n) if meta.query_len(i) > 1]
    plain = [i for i in range(n) if meta.query_len(i) == 1 and i not in grouped]
    bt = meta.block_tables.to(device=device, dtype=torch.int32)

    extend = None
    if extend_seqs:
        extend = plan_extend(
            extend_seqs, meta.query_start, meta.seq_lens, group, device, dtype=dtype
        )

    decode = decode_rows = None
    if plain:
        rows = [meta.query_start[i] for i in plain]
        decode = plan_decode(
            rows,
            [meta.seq_lens[i] for i in plain],
            None,
            group,
            num_kv_heads,
            device,
            table_rows=plain,
            dtype=dtype,
        )
        decode_rows = torch.tensor(rows, dtype=torch.long, device=device)

    shared = shared_rows = None
    specs, rows = [], []
    for g in meta.prefix_groups:
        if not g.seq_indices:
            continue
        specs.append(
            GroupSpec(
                list(g.seq_indices),
                [meta.seq_lens[i] for i in g.seq_indices],
                g.prefix_len,
                list(g.prefix_blocks),
            )
        )
        rows += [meta.query_start[i] for i in g.seq_indices]
    if specs:
        shared = plan_shared_prefix(
            specs, group, num_kv_heads, meta.block_size, device, dtype=dtype
        )
        shared_rows = torch.tensor(rows, dtype=torch.long, device=device)
    return _StepPlan(bt, extend, decode, decode_rows, shared, shared_rows)
