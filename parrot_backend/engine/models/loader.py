"""Build one of our model implementations from a local Hugging Face checkpoint folder."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from parrot_backend.contract.errors import UnsupportedModel

from .llama import LlamaForCausalLM, Rotary

# Architectures our Llama-family implementation covers, by `architectures[0]` in config.json.
SUPPORTED = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def load_config(path: Path):
    """Read config.json through transformers (it normalises RoPE fields across versions)."""
    from transformers import AutoConfig

    raw = json.loads((path / "config.json").read_text())
    archs = raw.get("architectures") or []
    if not archs or archs[0] not in SUPPORTED:
        raise UnsupportedModel(
            f"architecture {archs[0] if archs else '(none given)'!r} in {path} is not supported; "
            f"supported: {', '.join(sorted(SUPPORTED))}"
        )
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    if archs[0] == "Qwen2ForCausalLM":
        config.attention_bias = True  # Qwen2 has q/k/v biases but no flag for them
    window = getattr(config, "sliding_window", None)
    if window and archs[0] == "MistralForCausalLM" and window < config.max_position_embeddings:
        # sliding-window attention is not implemented: serve only what full attention equals
        config.max_position_embeddings = window
    return config


def load_model(path: Path, dtype: torch.dtype, device: torch.device, max_positions: int):
    """Instantiate the model without random init, then assign checkpoint tensors."""
    config = load_config(path)
    cls = SUPPORTED[config.architectures[0]]
    with torch.device("meta"):
        model = cls(config, max_positions)
    state = {}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    for f in files:
        state.update(load_file(str(f), device=str(device)))
    if model.tie:
        state.pop("lm_head.weight", None)
    state = {k: v.to(dtype) for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if "rotary" not in m]
    unexpected = [u for u in unexpected if "rotary_emb" not in u]
    if missing or unexpected:
        raise UnsupportedModel(
            f"checkpoint in {path} does not match the model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    model.model.rotary = Rotary(config, max_positions).to(device)
    model.fuse()
    return model.eval(), config
