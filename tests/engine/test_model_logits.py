"""Our Llama implementation against transformers on the same weights."""

from __future__ import annotations

import pytest
import torch

from parrot_backend.engine.engine import Engine
from parrot_backend.engine.scheduler import Work


def _reference(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def _step_logits(engine: Engine, cid, new_tokens: list[int]) -> torch.Tensor:
    """Append tokens to a context by hand and return the logits of every new position."""
    from parrot_backend.engine.context import Context, Request

    ctx = engine.contexts.get(cid)
    if ctx is None:
        ctx = Context(cid, None, None, engine.pool.block_size)
        engine.contexts[cid] = ctx
    start = ctx.num_computed
    ctx.tokens.extend(new_tokens)
    req = Request("fill", ctx)
    assert engine.scheduler._reserve(req, start, len(new_tokens), set())
    logits = engine.runner.logits_for([Work(req, start, len(new_tokens))])
    ctx.num_computed += len(new_tokens)
    return logits


@pytest.mark.parametrize("length", [1, 15, 16, 17, 40])
def test_prefill_logits_match_transformers(tiny_model_dir, length):
    engine = Engine.from_pretrained(tiny_model_dir, num_blocks=64, progress=False)
    ref = _reference(tiny_model_dir)
    ids = torch.randint(
        3, engine.vocab_size, (length,), generator=torch.Generator().manual_seed(length)
    )
    ours = _step_logits(engine, "a", ids.tolist())
    with torch.no_grad():
        theirs = ref(ids.unsqueeze(0)).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_decode_logits_through_paged_cache_match_transformers(tiny_model_dir):
    engine = Engine.from_pretrained(tiny_model_dir, num_blocks=64, progress=False)
    ref = _reference(tiny_model_dir)
    ids = torch.randint(3, engine.vocab_size, (37,), generator=torch.Generator().manual_seed(7))
    _step_logits(engine, "a", ids[:5].tolist())
    steps = [_step_logits(engine, "a", [t])[0] for t in ids[5:].tolist()]
    with torch.no_grad():
        theirs = ref(ids.unsqueeze(0)).logits[0, 5:]
    torch.testing.assert_close(torch.stack(steps), theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2_dir):
    engine = Engine.from_pretrained(smollm2_dir, num_blocks=32, dtype="float32", progress=False)
    ref = _reference(smollm2_dir)
    ids = engine.tokenize("The Parrot paper serves LLM applications with semantic variables.")
    prefill = _step_logits(engine, "a", ids[:-3])
    decode = torch.stack([_step_logits(engine, "a", [t])[0] for t in ids[-3:]])
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prefill, theirs[: len(ids) - 3], atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(decode, theirs[len(ids) - 3 :], atol=2e-3, rtol=2e-3)


def test_unsupported_architecture_is_refused(tmp_path):
    import json

    from parrot_backend.contract.errors import UnsupportedModel

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModel, match="GPT2LMHeadModel.*not supported"):
        Engine.from_pretrained(tmp_path, progress=False)
