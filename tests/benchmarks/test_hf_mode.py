"""The `transformers` baseline of `benchmarks/apps.py` (`appbench/hf_mode.py`) agrees with
itself: a wave's batched, left-padded `generate()` gives each call the tokens that call
gets alone, and those are the plain greedy tokens (full forward pass per step, no KV
cache). On the tiny random model, whose peaked logits leave no near-ties to rounding."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROMPTS = [
    "Hi",
    "You summarise documents for a busy reader. Keep only the main point.\nDocument:\n"
    "The river rose for three days and the town moved its market uphill.\nSummary:",
    "Summary so far: (nothing yet)\nNext part:\nA short one.\nUpdated summary:",
]
MAX_TOKENS = [5, 9, 3]


@pytest.fixture(scope="module")
def appbench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import appbench.hf_mode
        import appbench.workloads

        yield appbench
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


@pytest.fixture(scope="module")
def hf(appbench, tiny_model_dir):
    return appbench.hf_mode.load(tiny_model_dir, threads=2)


def _plain_greedy(hf, prompt: str, max_tokens: int) -> list[int]:
    """Argmax of a full forward pass over the whole sequence, one token at a time."""
    import torch

    from parrot_backend.engine.tokens import encode_segment

    seq = encode_segment(hf.tokenizer, prompt)
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(max_tokens):
            logits = hf.model(input_ids=torch.tensor([seq + out]), use_cache=False).logits
            out.append(int(logits[0, -1].argmax()))
            if out[-1] in hf.eos_ids:
                break
    return out


@pytest.mark.timeout(120)
def test_batched_wave_matches_each_call_alone(appbench, hf):
    lengths = [len(hf.tokenizer.encode(p, add_special_tokens=False)) for p in PROMPTS]
    assert len(set(lengths)) == len(lengths)  # the batch really is left padded
    batched = appbench.hf_mode.generate_wave(hf, PROMPTS, MAX_TOKENS)
    for prompt, limit, got in zip(PROMPTS, MAX_TOKENS, batched, strict=True):
        alone = appbench.hf_mode.generate_wave(hf, [prompt], [limit])[0]
        assert got["token_ids"] == alone["token_ids"]
        assert (got["text"], got["finish"]) == (alone["text"], alone["finish"])
        assert got["token_ids"] == _plain_greedy(hf, prompt, limit)
        assert 0 < len(got["token_ids"]) <= limit
        assert got["finish"] == ("eos" if got["token_ids"][-1] in hf.eos_ids else "length")
        if got["finish"] == "length":
            assert len(got["token_ids"]) == limit


@pytest.mark.timeout(120)
def test_run_goes_in_waves_and_substitutes_outputs(appbench, hf):
    wl = appbench.workloads.build("map_reduce", 7, quick=True)
    run = asyncio.run(appbench.hf_mode.run_transformers(wl, rtt=0.25, hf=hf))
    waves = run["hf"]["waves"]
    assert [w["calls"] for w in waves] == [[f"map{i}" for i in range(3)], ["reduce"]]
    assert run["rtt"] == 0 and run["engine"] == {}
    by = {c["name"]: c for c in run["calls"]}
    assert [c["name"] for c in run["calls"]] == [c.name for c in wl.calls]
    for i in range(3):  # the reduce prompt holds every map output, as generated
        assert f"- {by[f'map{i}']['output']}\n" in by["reduce"]["prompt"]
        assert by["reduce"]["start_offset"] >= by[f"map{i}"]["end"]
    assert run["jct"] >= by["reduce"]["end"] > 0
    assert run["hf"]["prefill_padded"] == sum(w["batch"] * w["padded_prompt_len"] for w in waves)
