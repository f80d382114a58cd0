"""Each supported architecture's logits equal transformers' on the same random weights."""

from __future__ import annotations

import shutil

import pytest
import torch

from parrot_backend.engine.engine import Engine

from .test_model_logits import _reference, _step_logits

COMMON = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    initializer_range=0.2,
)


def _configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    return {
        "llama3-rope-scaling": LlamaConfig(
            **COMMON,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        "mistral": MistralConfig(**COMMON, sliding_window=None, tie_word_embeddings=False),
        "qwen2-qkv-bias": Qwen2Config(**COMMON, tie_word_embeddings=True),
        "qwen3-qk-norm": Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True),
        "llama-mha-no-gqa": LlamaConfig(**{**COMMON, "num_key_value_heads": 4}),
    }


@pytest.mark.parametrize("family", list(_configs()))
def test_architecture_logits_match_transformers(family, tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    config = _configs()[family]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    if family == "qwen2-qkv-bias":  # random init leaves biases at zero: make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.bias.normal_(0, 0.5)
                layer.self_attn.k_proj.bias.normal_(0, 0.5)
    model.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, tmp_path / name)
    engine = Engine.from_pretrained(tmp_path, num_blocks=32, progress=False)
    ids = torch.randint(3, 49152, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    prefill = _step_logits(engine, "a", ids[:80])
    decode = torch.stack([_step_logits(engine, "a", [t])[0] for t in ids[80:]])
    with torch.no_grad():
        theirs = _reference(tmp_path)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prefill, theirs[:80], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(decode, theirs[80:], atol=1e-4, rtol=1e-4)
