"""Runs one scheduled step on the model: builds the flat batch, forwards, samples."""

from __future__ import annotations

import torch

from .attention import AttentionBackend, AttentionMetadata, find_prefix_groups
from .scheduler import Work


class ModelRunner:
    """Owns the model, the paged KV cache tensors and the attention backend."""

    def __init__(
        self,
        model,
        config,
        *,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        backend: AttentionBackend,
    ) -> None:
        self.model = model
        self.config = config
        self.block_size = block_size
        self.device = device
        self.backend = backend
        self.pending_copies: list[tuple[int, int]] = []
        n_kv = config.num_key_value_heads or config.num_attention_heads
        head_dim = model.model.layers[0].self_attn.head_dim
        shape = (num_blocks, block_size, n_kv, head_dim)
        # zeros, not empty: masked-out slots must never hold NaN (0 * NaN poisons attention)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            for _ in range(config.num_hidden_layers)
        ]

    @staticmethod
    def bytes_per_block(config, block_size: int, dtype: torch.dtype) -> int:
        n_kv = config.num_key_value_heads or config.num_attention_heads
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        elem = torch.tensor([], dtype=dtype).element_size()
        return 2 * config.num_hidden_layers * block_size * n_kv * head_dim * elem

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write of one block, done on the compute thread before the next forward."""
        self.pending_copies.append((src, dst))

    def _flush_copies(self) -> None:
        for src, dst in self.pending_copies:  # in order: a freed source may be a later dst
            for k, v in self.kv_caches:
                k[dst].copy_(k[src])
                v[dst].copy_(v[src])
        self.pending_copies.clear()

    def build(self, work: list[Work]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        self._flush_copies()
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        width = max(len(w.req.ctx.blocks) for w in work)
        tables = torch.zeros((len(work), width), dtype=torch.int32)
        for i, w in enumerate(work):
            ctx = w.req.ctx
            end = w.start + w.n
            ids.extend(ctx.tokens[w.start : end])
            positions.extend(range(w.start, end))
            blocks = ctx.blocks
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(w.start, end))
            starts.append(starts[-1] + w.n)
            seq_lens.append(end)
            tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start=starts,
            seq_lens=seq_lens,
            block_tables=tables.to(dev),
            block_size=bs,
        )
        if self.backend.groups_prefixes and any(w.n == 1 for w in work):
            meta.prefix_groups = find_prefix_groups(meta, self.backend.share_prefix)
        return (
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            meta,
        )

    @torch.inference_mode()
    def execute(self, work: list[Work]) -> list[int | None]:
        """Compute KV for every work item; sample a token for those that reach their end."""
        ids, positions, meta = self.build(work)
        hidden = self.model(ids, positions, self.kv_caches, meta, self.backend)
        rows = [meta.query_start[i + 1] - 1 for i, w in enumerate(work) if w.samples]
        out: list[int | None] = [None] * len(work)
        if rows:
            logits = self.model.logits(hidden[rows])
            k = 0
            for i, w in enumerate(work):
                if w.samples:
                    out[i] = w.req.sampler(logits[k])
                    k += 1
        return out

    @torch.inference_mode()
    def logits_for(self, work: list[Work]) -> torch.Tensor:
        """All-position logits of one step (tests compare them with transformers)."""
        ids, positions, meta = self.build(work)
        return self.model.logits(self.model(ids, positions, self.kv_caches, meta, self.backend))
