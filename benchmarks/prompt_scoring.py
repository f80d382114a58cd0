"""What scoring a prompt costs (`echo` with `logprobs`, the request evaluation harnesses
send): the engine's fill of the same prompts plain and scored (`fill(...,
prompt_logprobs=k)`), and transformers' batched forward + log-softmax over them (what a
harness without a server runs), alternating in one run (SmolLM2-135M, float32, CPU).

    .venv/bin/python benchmarks/prompt_scoring.py [--rows 8] [--tokens 256] [--reps 3] [--k 1]

Each side of each repetition gets prompts of its own (no prefix cache hit). Prints prompt
tokens/s per side and repetition, the medians, the ratios scored/plain and
scored/transformers, and the largest difference between the engine's and transformers'
logprobs of the prompt tokens (the two must agree).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from parrot_backend.engine.engine import Engine
from parrot_backend.engine.model_files import resolve_model
from parrot_backend.engine.threads import available_cores

WORDS = (
    "parrot river clock lantern harbor meadow engine copper violin garden summit canyon "
    "signal pepper marble anchor forest ribbon comet island basket thunder"
).split()


def prompts(engine: Engine, rows: int, tokens: int, seed: int) -> list[list[int]]:
    """`rows` distinct prompts of exactly `tokens` tokens (deterministic per seed)."""
    out = []
    for r in range(rows):
        words = [WORDS[(seed * 7 + r * 13 + i * (r + 3)) % len(WORDS)] for i in range(tokens)]
        ids = engine.tokenize(f"Note {seed}-{r}: " + " ".join(words))
        assert len(ids) >= tokens, "the text is too short for --tokens"
        out.append(ids[:tokens])
    return out


async def engine_fill(engine: Engine, batch: list[list[int]], k: int | None, tag: str):
    """Fill every prompt at once; (prompt tokens/s, entries per prompt or None)."""

    async def one(i: int, ids: list[int]):
        cid = f"{tag}{i}"
        if k is None:
            await engine.fill(cid, None, ids)
            got = None
        else:
            got = (await engine.fill(cid, None, ids, prompt_logprobs=k)).prompt_logprobs
        await engine.free(cid)
        return got

    t0 = time.perf_counter()
    got = await asyncio.gather(*(one(i, ids) for i, ids in enumerate(batch)))
    return sum(map(len, batch)) / (time.perf_counter() - t0), got


def hf_score(model, batch: list[list[int]]) -> tuple[float, torch.Tensor]:
    """transformers: one batched forward (equal lengths, no padding), log-softmax, the
    next tokens' logprobs; (prompt tokens/s, [rows, tokens-1] logprobs)."""
    ids = torch.tensor(batch)
    engines_threads = torch.get_num_threads()
    torch.set_num_threads(available_cores())  # as appbench's transformers mode
    try:
        t0 = time.perf_counter()
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits.float(), -1)
            picked = lp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
        return ids.numel() / (time.perf_counter() - t0), picked
    finally:
        torch.set_num_threads(engines_threads)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--k", type=int, default=1, help="alternatives per prompt token")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers side")
    args = ap.parse_args()
    path = resolve_model(None)
    engine = Engine.from_pretrained(path, dtype="float32", progress=False)
    model = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    await engine.start()
    rates: dict[str, list[float]] = {"plain": [], "scored": [], "transformers": []}
    worst = 0.0
    try:
        warm = prompts(engine, 2, 32, seed=999)
        await engine_fill(engine, warm, None, "w0-")
        await engine_fill(engine, warm, args.k, "w1-")
        if model is not None:
            hf_score(model, warm)
        for rep in range(args.reps):
            sides = ["plain", "scored", "transformers"]
            if rep % 2:
                sides.reverse()  # alternate which side goes first
            line = []
            for j, side in enumerate(sides):
                batch = prompts(engine, args.rows, args.tokens, seed=rep * 10 + j)
                if side == "transformers":
                    if model is None:
                        continue
                    rate, _ = hf_score(model, batch)
                else:
                    k = None if side == "plain" else args.k
                    rate, got = await engine_fill(engine, batch, k, f"r{rep}{side}-")
                    if got[0] is not None and model is not None:
                        _, ref = hf_score(model, batch)
                        for row, entries in enumerate(got):
                            ours = torch.tensor([e[0] for e in entries[1:]])
                            worst = max(worst, float((ours - ref[row]).abs().max()))
                rates[side].append(rate)
                line.append(f"{side} {rate:.0f}")
            print(f"rep {rep}: " + ", ".join(line) + " prompt tok/s")
    finally:
        await engine.stop()
    med = {s: statistics.median(v) for s, v in rates.items() if v}
    print("median prompt tok/s: " + ", ".join(f"{s} {v:.0f}" for s, v in med.items()))
    print(f"scored/plain {med['scored'] / med['plain']:.3f}")
    if "transformers" in med:
        print(f"scored/transformers {med['scored'] / med['transformers']:.3f}")
        print(f"largest |engine - transformers| prompt logprob: {worst:.2e}")


if __name__ == "__main__":
    asyncio.run(main())
