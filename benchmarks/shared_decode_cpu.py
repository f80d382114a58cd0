"""Decode over a shared prefix on the torch backend: grouped (the prefix's K/V read once per
step for every fork) vs plain (each fork gathers its whole context), SmolLM2, same run.

    .venv/bin/python benchmarks/shared_decode_cpu.py [--prefix 256 1024 2048] [--forks 2 8 16]

For each (prefix P, forks N): fill P tokens once, fork N children with an 8-token suffix
each, then time N concurrent greedy generations of `--gen` tokens; the backends of
`--modes` (default `grouped plain`; also `unfused`: grouped without the fused kernel, and
`default`: the engine's own gate) alternate, `--reps` times, and the table gives the
median decode step time of each and the last mode's over each other's. Outputs are
compared token for token on every run.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from parrot_backend.contract.sampling import SamplingParams
from parrot_backend.engine.attention import TorchAttention
from parrot_backend.engine.engine import Engine
from parrot_backend.engine.model_files import resolve_model

TEXT = (
    "Parrots are intelligent birds found in tropical regions. They live in flocks, eat seeds "
    "and fruit, and some species can imitate human speech. "
)


class PlainTorch(TorchAttention):
    def share_prefix(self, prefix_len: int, group_size: int) -> bool:
        return False


class AlwaysGrouped(TorchAttention):
    """Groups every shared prefix of a block or more, whatever the default gate says."""

    def share_prefix(self, prefix_len: int, group_size: int) -> bool:
        return True


class UnfusedGrouped(AlwaysGrouped):
    fused_shared_decode = False


async def one_run(engine: Engine, prefix: list[int], forks: int, gen: int, tag: str):
    sampling = SamplingParams(max_tokens=gen, ignore_eos=True)
    await engine.fill(f"{tag}p", None, prefix)
    for i in range(forks):
        await engine.fill(f"{tag}c{i}", f"{tag}p", engine.tokenize(f" Question {i}: why?"))
    steps0 = engine.stats_now().steps
    t0 = time.perf_counter()

    async def go(i: int) -> list[int]:
        return [d.token_id async for d in engine.generate(f"{tag}c{i}", None, sampling)]

    outs = await asyncio.gather(*(go(i) for i in range(forks)))
    dt = time.perf_counter() - t0
    steps = engine.stats_now().steps - steps0
    for i in range(forks):
        await engine.free(f"{tag}c{i}")
    await engine.free(f"{tag}p")
    return dt / max(steps, 1), outs


MODES = {
    "grouped": AlwaysGrouped,  # every shared prefix read once, fused kernel
    "unfused": UnfusedGrouped,  # the same groups, unfused matmuls
    "default": TorchAttention,  # the engine's own gate
    "plain": PlainTorch,  # never grouped
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix", type=int, nargs="+", default=[256, 1024, 2048])
    ap.add_argument("--forks", type=int, nargs="+", default=[2, 8, 16])
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--modes",
        nargs="+",
        choices=sorted(MODES),
        default=["grouped", "plain"],
        help="backends to alternate (the last is every ratio's denominator)",
    )
    args = ap.parse_args()
    engine = Engine.from_pretrained(resolve_model(None), num_blocks=4096, progress=False)
    base = engine.tokenize(TEXT * 200)
    modes = list(dict.fromkeys(args.modes))
    backends = {m: MODES[m]() for m in modes}
    base_mode = modes[-1]
    rows = []

    async def bench() -> None:
        async with engine:
            await one_run(engine, base[:64], 2, 2, "warm")
            for p in args.prefix:
                for n in args.forks:
                    times: dict[str, list[float]] = {m: [] for m in modes}
                    for rep in range(args.reps):
                        k = rep % len(modes)  # each mode leads in turn
                        order = modes[k:] + modes[:k]
                        got = {}
                        for name in order:
                            engine.runner.backend = backends[name]
                            step, outs = await one_run(
                                engine, base[rep : rep + p], n, args.gen, f"{name}{p}{n}{rep}"
                            )
                            times[name].append(step)
                            got[name] = outs
                        for name in modes:
                            assert got[name] == got[base_mode], (name, p, n, rep)
                    med = {m: statistics.median(times[m]) for m in modes}
                    rows.append((p, n, med))
                    print(
                        f"P={p} N={n}: "
                        + ", ".join(
                            f"{m} {med[m] * 1e3:.1f} ms/step ({med[base_mode] / med[m]:.2f}x)"
                            for m in modes
                        ),
                        flush=True,
                    )

    asyncio.run(bench())
    print(
        f"\ntorch threads {torch.get_num_threads()}, {args.gen} tokens per fork, "
        f"median of {args.reps}, ratio = {base_mode} / mode\n"
    )
    print(
        "| prefix P | forks N | "
        + " | ".join(f"{m} ms/step" for m in modes)
        + " | "
        + " | ".join(f"{base_mode} / {m}" for m in modes[:-1])
        + " |"
    )
    print("| --- | --- | " + " | ".join("---" for _ in range(2 * len(modes) - 1)) + " |")
    for p, n, med in rows:
        cells = [f"{med[m] * 1e3:.1f}" for m in modes]
        cells += [f"{med[base_mode] / med[m]:.2f}x" for m in modes[:-1]]
        print(f"| {p} | {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
