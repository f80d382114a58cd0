"""Shared fixtures: a tiny random Llama (GQA) built offline, and the real SmolLM2."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from hypothesis import settings

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# No per-example deadline: on a shared 2-core machine a first example that imports a module
# takes longer than hypothesis's 200 ms, which is a flaky failure, not a finding. (With
# CI set, hypothesis's own "ci" profile, the parent here, already has none.)
settings.register_profile("parrot", parent=settings.default, deadline=None)
settings.load_profile("parrot")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The default model, converted once to safetensors in the cache directory."""
    from parrot_backend.engine.model_files import resolve_model

    return resolve_model(None, progress=False)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_dir) -> Path:
    """A 2-layer random Llama with GQA (4 query heads, 2 KV heads) and SmolLM2's tokenizer.

    Weights are scaled up so that logits are peaked: greedy comparisons then do not hinge
    on near-ties that float rounding could flip.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, out / name)
    return out
