"""The model's matmul (`engine/models/linear.py`): oneDNN's linear agrees with F.linear, in
logits against transformers, in greedy generation, and on the real SmolLM2; the choice."""

from __future__ import annotations

import pytest
import torch

from parrot_backend.contract.sampling import SamplingParams
from parrot_backend.engine.engine import Engine
from parrot_backend.engine.models.linear import (
    onednn_linear,
    onednn_problem,
    pack_weight,
    pick_linear,
    unpack_weight,
)

from .helpers import complete, run
from .test_model_logits import _reference, _step_logits

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(
    onednn_problem(torch.float32) is not None, reason="no oneDNN linear in this build"
)

# oneDNN's bfloat16 inner product needs AVX-512 on x86: on an AVX2-only CPU (a CI host
# here: AMD EPYC, `get_cpu_capability()` "AVX2") it cannot create the primitive
BF16_CPU = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
needs_onednn_bf16 = pytest.mark.skipif(
    onednn_problem(torch.bfloat16) is not None,
    reason=f"no oneDNN bfloat16 linear on this CPU ({torch.backends.cpu.get_cpu_capability()})",
)


@needs_onednn
def test_auto_picks_onednn_on_a_cpu_in_float32() -> None:
    assert pick_linear("auto", CPU, torch.float32) == "onednn"
    assert pick_linear("auto", CPU, torch.float16) == "torch"
    assert pick_linear("auto", torch.device("cuda"), torch.float32) == "torch"
    assert pick_linear("torch", CPU, torch.float32) == "torch"


@needs_onednn
def test_bfloat16_takes_onednn_where_the_cpu_has_its_kernel_and_torch_elsewhere() -> None:
    if BF16_CPU:
        assert pick_linear("auto", CPU, torch.bfloat16) == "onednn"
        assert pick_linear("onednn", CPU, torch.bfloat16) == "onednn"
    elif torch.backends.cpu.get_cpu_capability() == "AVX2":
        # the check fails cleanly: auto keeps F.linear, asking for oneDNN says why not
        assert pick_linear("auto", CPU, torch.bfloat16) == "torch"
        with pytest.raises(ValueError, match="not available: oneDNN's linear failed"):
            pick_linear("onednn", CPU, torch.bfloat16)
    else:  # pragma: no cover - other CPUs: whichever the check found, consistently
        want = "onednn" if onednn_problem(torch.bfloat16) is None else "torch"
        assert pick_linear("auto", CPU, torch.bfloat16) == want


def test_impossible_or_unknown_choices_are_refused() -> None:
    with pytest.raises(ValueError, match="no torch.float16 kernel"):
        pick_linear("onednn", CPU, torch.float16)
    with pytest.raises(ValueError, match="CPU only"):
        pick_linear("onednn", torch.device("cuda"), torch.float32)
    with pytest.raises(ValueError, match="unknown linear 'mkl'"):
        pick_linear("mkl", CPU, torch.float32)


@needs_onednn
def test_the_engine_runs_every_projection_on_the_chosen_matmul(tiny_model_dir) -> None:
    for kind in ("onednn", "torch"):
        engine = Engine.from_pretrained(tiny_model_dir, num_blocks=16, linear=kind, progress=False)
        assert engine.linear == engine.runner.model.linear == kind
        fns = {
            m.fn.__name__ for m in engine.runner.model.modules() if isinstance(m, torch.nn.Linear)
        }
        assert fns == {f"{kind}_linear"}
    default = Engine.from_pretrained(tiny_model_dir, num_blocks=16, progress=False)
    assert default.linear == "onednn"


@needs_onednn
@pytest.mark.parametrize("kind", ["onednn", "torch"])
def test_prefill_and_decode_logits_match_transformers(tiny_model_dir, kind) -> None:
    engine = Engine.from_pretrained(tiny_model_dir, num_blocks=64, linear=kind, progress=False)
    ref = _reference(tiny_model_dir)
    ids = torch.randint(3, engine.vocab_size, (30,), generator=torch.Generator().manual_seed(3))
    prefill = _step_logits(engine, "a", ids[:20].tolist())
    decode = torch.stack([_step_logits(engine, "a", [t])[0] for t in ids[20:].tolist()])
    with torch.no_grad():
        theirs = ref(ids.unsqueeze(0)).logits[0]
    torch.testing.assert_close(prefill, theirs[:20], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(decode, theirs[20:], atol=1e-4, rtol=1e-4)


@needs_onednn
def test_greedy_batches_generate_the_same_tokens_on_both(tiny_model_dir) -> None:
    prompts = [
        torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        for n in (5, 17, 33, 9)
    ]
    sampling = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    async def generate(kind: str) -> list[list[int]]:
        import asyncio

        engine = Engine.from_pretrained(tiny_model_dir, num_blocks=64, linear=kind, progress=False)
        async with engine:
            return await asyncio.gather(
                *(complete(engine, f"p{i}", p, sampling) for i, p in enumerate(prompts))
            )

    assert run(generate("onednn")) == run(generate("torch"))


@needs_onednn
@pytest.mark.slow
def test_smollm2_logits_on_onednn_match_transformers(smollm2_dir) -> None:
    engine = Engine.from_pretrained(smollm2_dir, num_blocks=32, linear="onednn", progress=False)
    ref = _reference(smollm2_dir)
    ids = engine.tokenize("Parrot shares a prompt's prefix once, and serves every call after.")
    prefill = _step_logits(engine, "a", ids[:-4])
    decode = torch.stack([_step_logits(engine, "a", [t])[0] for t in ids[-4:]])
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prefill, theirs[: len(ids) - 4], atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(decode, theirs[len(ids) - 4 :], atol=2e-3, rtol=2e-3)


@needs_onednn
@pytest.mark.parametrize(
    "dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_onednn_bf16)]
)
@pytest.mark.parametrize("rows", [1, 3, 8, 12, 70])
def test_packed_weights_compute_what_plain_ones_do(dtype, rows) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=gen).to(dtype)
    b = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(rows, 40, generator=gen).to(dtype)
    packed = pack_weight(w)
    assert packed.is_mkldnn and not w.is_mkldnn
    assert pack_weight(packed) is packed  # packing twice does nothing
    assert torch.equal(unpack_weight(packed), w)  # and unpacking gives the weight back
    with torch.inference_mode():
        want = torch.nn.functional.linear(x.float(), w.float(), b.float())
        got = onednn_linear(x, packed, b).float()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@needs_onednn
def test_onednn_holds_packed_weights_and_torch_gets_them_back(tiny_model_dir) -> None:
    engine = Engine.from_pretrained(tiny_model_dir, num_blocks=16, linear="onednn", progress=False)
    model = engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.weight.is_mkldnn for m in linears)
    plain = Engine.from_pretrained(tiny_model_dir, num_blocks=16, linear="torch", progress=False)
    want = {n: p for n, p in plain.runner.model.named_parameters()}
    model.use_linear("torch")  # back to plain weights, exactly
    for name, p in model.named_parameters():
        assert not p.is_mkldnn
        assert torch.equal(p, want[name]), name
    model.use_linear("onednn")  # and packed again
    assert all(m.weight.is_mkldnn for m in linears)


@needs_onednn_bf16
def test_bfloat16_logits_on_onednn_match_f_linear(tiny_model_dir) -> None:
    ids = torch.randint(3, 200, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    logits = {}
    for kind in ("onednn", "torch"):
        engine = Engine.from_pretrained(
            tiny_model_dir, num_blocks=64, linear=kind, dtype="bfloat16", progress=False
        )
        assert engine.linear == kind
        prefill = _step_logits(engine, "a", ids[:18])
        decode = torch.stack([_step_logits(engine, "a", [t])[0] for t in ids[18:]])
        logits[kind] = torch.cat([prefill, decode])
    # both round to bfloat16 after every matmul; they differ by that rounding at most
    torch.testing.assert_close(logits["onednn"], logits["torch"], atol=0.05, rtol=0.05)
    assert (logits["onednn"].argmax(-1) == logits["torch"].argmax(-1)).float().mean() >= 0.9
