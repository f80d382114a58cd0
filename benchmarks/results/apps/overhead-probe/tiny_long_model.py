"""A tiny random Llama (2 layers, hidden 64, GQA) with SmolLM2's tokenizer and an
8,192-token context: the engine does almost no work, so a run at the `--gpu` sizes shows
the server's and manager's own costs (and any size limit) on a CPU in minutes.

    .venv/bin/python benchmarks/results/apps/overhead-probe/tiny_long_model.py /tmp/tinylong
"""

import shutil
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from parrot_backend.engine.model_files import resolve_model

src = resolve_model(None, progress=False)
out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
config = LlamaConfig(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.2,
)
torch.manual_seed(0)
LlamaForCausalLM(config).to(torch.float32).save_pretrained(out)
for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    if (src / name).exists():
        shutil.copy(src / name, out / name)
print(out)
