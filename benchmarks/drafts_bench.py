"""Drafts off / on (`engine/speculate.py`), engine alone, alternating in one run: wall time
of the same generations with `speculate=0` and with the default, for text that copies its
prompt (one chain-summary step), text that rarely does (two chat answers decoding
together) and a JSON object filled from a text (a schema's keys are forced, its values
copied), greedy and sampled. Every round checks that both settings yield the same tokens
(sampled rounds use the same seed in both); the report gives the median time of each,
their ratio (off / on: > 1 means drafts are faster), each round's ratio, and the drafts
checked and kept.

    .venv/bin/python benchmarks/drafts_bench.py [--rounds 4] [--temperatures 0 0.7]
        [--cases summary chat json] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from appbench import texts, workloads  # noqa: E402

from parrot_backend.contract.sampling import Constraint, SamplingParams  # noqa: E402
from parrot_backend.engine.engine import Engine  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "topic": {"type": "string", "maxLength": 40},
        "places_named": {
            "type": "array",
            "items": {"type": "string", "maxLength": 30},
            "maxItems": 4,
        },
        "main_point": {"type": "string", "maxLength": 120},
    },
    "required": ["topic", "places_named", "main_point"],
}


def case_prompts(case: str, seed: int) -> list[str]:
    """The prompts one round of `case` generates from, concurrently."""
    if case == "summary":
        chain = workloads.build("chain_summary", 900 + seed)
        return [chain.calls[0].render({**chain.inputs, "s0": "(nothing yet)"})]
    if case == "chat":
        chat = workloads.build("shared_prompt", 900 + seed, users=2, prompt=256)
        return [c.render(chat.inputs) for c in chat.calls]
    if case == "json":
        doc = texts.document(900 + seed, 160)
        return [f"Text:\n{doc}\n\nThe text's facts as a JSON object:\n"]
    raise ValueError(case)


def sampling_for(case: str, temperature: float, seed: int, gen: int) -> SamplingParams:
    if case == "json":  # ends where the object ends
        schema = Constraint("json_schema", json.dumps(SCHEMA))
        return SamplingParams(
            max_tokens=4 * gen, temperature=temperature, seed=seed, constraint=schema
        )
    return SamplingParams(max_tokens=gen, temperature=temperature, seed=seed, ignore_eos=True)


async def generate(engine: Engine, prompts: list[str], sampling: SamplingParams, tag: str):
    async def one(i: int, prompt: str) -> list[int]:
        cid = f"{tag}-{i}"
        await engine.fill(cid, None, engine.tokenize(prompt))
        out = [d.token_id async for d in engine.generate(cid, None, sampling)]
        await engine.free(cid)
        return out

    began = time.perf_counter()
    out = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return time.perf_counter() - began, out


async def main(args) -> list[dict]:
    engines = {"off": Engine.from_pretrained(args.model, speculate=0)}
    engines["on"] = Engine.from_pretrained(args.model)
    for e in engines.values():
        await e.start()
        await generate(e, ["warm up"], SamplingParams(max_tokens=4), "w")
    rows = []
    for temperature in args.temperatures:
        for case in args.cases:
            times: dict[str, list[float]] = {"off": [], "on": []}
            before = engines["on"].stats_now()
            tokens = 0
            for r in range(args.rounds):
                prompts = case_prompts(case, r)
                sampling = sampling_for(case, temperature, r, args.gen)
                order = ("off", "on") if r % 2 == 0 else ("on", "off")
                got = {}
                for name in order:
                    tag = f"{case}{temperature}{r}{name}"
                    dt, got[name] = await generate(engines[name], prompts, sampling, tag)
                    times[name].append(dt)
                if got["off"] != got["on"]:
                    raise AssertionError(f"{case} at T={temperature}: drafts changed the tokens")
                tokens += sum(len(t) for t in got["on"])
            after = engines["on"].stats_now()
            off, on = statistics.median(times["off"]), statistics.median(times["on"])
            row = {
                "case": case,
                "temperature": temperature,
                "tokens": tokens,
                "off_s": round(off, 3),
                "on_s": round(on, 3),
                "ratio": round(off / on, 3),
                "round_ratios": [round(a / b, 2) for a, b in zip(*times.values(), strict=True)],
                "drafts": after.draft_tokens - before.draft_tokens,
                "kept": after.draft_tokens_accepted - before.draft_tokens_accepted,
            }
            rows.append(row)
            print(
                f"{case:8s} T={temperature:<4} off {off:.2f} s, on {on:.2f} s, "
                f"off/on {row['ratio']:.2f}x (rounds {row['round_ratios']}); "
                f"{tokens} tokens, drafts {row['kept']}/{row['drafts']} kept",
                flush=True,
            )
    for e in engines.values():
        await e.stop()
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: SmolLM2)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--gen", type=int, default=48, help="tokens per free-text generation")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--cases", nargs="+", default=["summary", "chat", "json"])
    ap.add_argument("--json", type=Path, default=None, help="write the rows here")
    parsed = ap.parse_args()
    result = asyncio.run(main(parsed))
    if parsed.json:
        parsed.json.write_text(json.dumps(result, indent=1) + "\n")
