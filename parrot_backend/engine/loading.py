"""Loading a checkpoint for an engine, and sizing its KV pool from free memory."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from parrot_backend.contract.errors import EngineError

from .config import EngineConfig, pick_device, pick_dtype
from .model_files import DEFAULT_MODEL, resolve_model
from .models.loader import load_config, load_model
from .runner import ModelRunner


@dataclass(slots=True)
class Loaded:
    """What `Engine.__init__` takes: the model and its config, the tokenizer, the engine
    settings, and where and how it computes."""

    model: Any
    model_config: Any
    tokenizer: Any
    config: EngineConfig
    device: torch.device
    dtype: torch.dtype
    model_name: str


def load(model: str | Path | None, progress: bool, overrides: dict[str, Any]) -> Loaded:
    """Load a local checkpoint (or the default SmolLM2) with engine settings `overrides`.
    Runs on the compute thread (`step_loop.compute_executor`)."""
    from transformers import AutoTokenizer

    config = EngineConfig(**overrides)
    if model is not None:
        config = replace(config, model=str(model))
    path = resolve_model(config.model, progress=progress)
    device = pick_device(config.device)
    dtype = pick_dtype(config.dtype, device)
    mconf = load_config(path)  # refuses unsupported architectures before any loading
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    max_pos = min(
        config.max_model_len or mconf.max_position_embeddings, mconf.max_position_embeddings
    )
    net, mconf = load_model(path, dtype, device, max_pos)
    name = DEFAULT_MODEL if config.model == DEFAULT_MODEL else Path(config.model).name
    return Loaded(net, mconf, tokenizer, config, device, dtype, name)


def pool_blocks(mconf: Any, config: EngineConfig, dtype: torch.dtype, device: torch.device) -> int:
    """How many KV blocks fit `kv_memory_fraction` of the free memory (GPU) or of the
    available memory, at most `kv_memory_max_bytes` (CPU, shared with everything else)."""
    per_block = ModelRunner.bytes_per_block(mconf, config.block_size, dtype)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = free * config.kv_memory_fraction
    else:
        import psutil

        available = psutil.virtual_memory().available
        budget = min(available * config.kv_memory_fraction, config.kv_memory_max_bytes)
    blocks = int(budget // per_block)
    if blocks < 1:
        raise EngineError(f"not enough memory for one KV block ({per_block} bytes)")
    return blocks


def eos_ids(mconf: Any, tokenizer: Any) -> set[int]:
    """The end-of-sequence ids of the model's config and of its tokenizer."""
    ids = set()
    for src in (getattr(mconf, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(i) for i in src)
    return ids
