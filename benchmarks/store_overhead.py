"""Generation throughput with the store on vs off (the cost of write-before-acknowledge).

    .venv/bin/python benchmarks/store_overhead.py                      # tiny random Llama
    .venv/bin/python benchmarks/store_overhead.py --model DIR --url postgresql+psycopg://...

The same workload runs through `NativeRuntime` twice per round: once persisting every
manager event to a fresh SQLite file (or PostgreSQL schema), once with no listener but
the runtime's own. Each run is a chain of calls; many runs go at once, so the engine
batches and the store sees a steady stream of token batches and state changes. Prints
tokens/s for each mode and the ratio (on / off); the goal is a cost under 5 %.

On the tiny model a decode step takes a few milliseconds, far less than a real model's,
so the store's share of the time is larger here than in production: a worst case.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from parrot_backend.engine.engine import Engine
from parrot_backend.program import RunSpec
from parrot_backend.server.native_api import wait_value
from parrot_backend.server.runtime import NativeRuntime
from parrot_backend.store import Store

# event type -> seconds the manager waited on the store's listener (store-on runs)
WAITS: dict[str, list[float]] = defaultdict(list)


def tiny_model(out: Path) -> Path:
    """A 2-layer random Llama with SmolLM2's tokenizer (as in the tests)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from parrot_backend.engine.model_files import resolve_model

    smol = resolve_model(None, progress=False)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smol / name).exists():
            shutil.copy(smol / name, out / name)
    return out


def chain(i: int, calls: int, tokens: int) -> RunSpec:
    specs = [
        {
            "name": f"c{k}",
            "template": f"Run {i} step {k}: {{{{input:x{k}}}}} {{{{output:x{k + 1}}}}}",
            "outputs": {f"x{k + 1}": {"max_tokens": tokens}},
        }
        for k in range(calls)
    ]
    return RunSpec.model_validate(
        {
            "program": {"calls": specs},
            "inputs": {"x0": f"seed {i}"},
            "outputs": {f"x{calls}": "throughput"},
        }
    )


async def workload(
    engine: Engine, url: str, persist: bool, runs: int, calls: int, tokens: int
) -> tuple[float, int, float]:
    """(tokens/s, tokens, process CPU s) for `runs` chains at once; `persist` switches
    the store's listener on (off: the same runtime and path, no event is written)."""
    store = Store(url)
    rt = NativeRuntime(store, {"e0": engine}, persist=persist)
    if persist:  # time the listener: how long each event waits for its commit
        on_event = rt.persister.on_event

        async def timed(run_id: str, type: str, payload: dict) -> None:
            t = time.perf_counter()
            await on_event(run_id, type, payload)
            WAITS[type].append(time.perf_counter() - t)

        rt.persister.on_event = timed  # type: ignore[method-assign]
    await rt.manager.start()
    rt.persister.start()
    await rt.tenant_id("bench")
    before = (await engine.stats()).tokens_generated
    cpu = time.process_time()
    start = time.perf_counter()
    ids = [await rt.create_run("bench", chain(i, calls, tokens)) for i in range(runs)]
    await asyncio.gather(*(wait_value(rt, r, f"x{calls}", "throughput", 600) for r in ids))
    await rt.persister.flush_all()
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu
    made = (await engine.stats()).tokens_generated - before
    await rt.stop()
    store.close()
    return made / elapsed, made, cpu


async def main(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="parrot-overhead-"))
    model = Path(args.model) if args.model else tiny_model(tmp / "tiny")
    engine = Engine.from_pretrained(model, num_blocks=args.num_blocks, progress=False)
    async with engine:
        await workload(engine, args.url or f"sqlite:///{tmp / 'warm.db'}", True, 4, 1, 8)
        await workload(engine, args.url or f"sqlite:///{tmp / 'warm2.db'}", False, 4, 1, 8)
        WAITS.clear()
        ratios = []
        for r in range(args.rounds):
            url = args.url or f"sqlite:///{tmp / f'round{r}.db'}"
            work = (args.runs, args.calls, args.tokens)
            # alternate which mode goes first: drift on a shared machine then favours
            # neither
            if r % 2:
                on, n_on, cpu_on = await workload(engine, url, True, *work)
                off, n_off, cpu_off = await workload(engine, url, False, *work)
            else:
                off, n_off, cpu_off = await workload(engine, url, False, *work)
                on, n_on, cpu_on = await workload(engine, url, True, *work)
            ratios.append(on / off)
            print(
                f"round {r}: store off {off:8.1f} tok/s ({n_off} tok, cpu {cpu_off:.2f} s)"
                f"   store on {on:8.1f} tok/s ({n_on} tok, cpu {cpu_on:.2f} s)"
                f"   on/off {on / off:.3f}"
            )
    print(
        "store-on: time the manager waits for each event's commit (on a chain, "
        "variable_ready + call_started are the critical path of every step)"
    )
    for type, waits in sorted(WAITS.items()):
        ms = sorted(1000 * w for w in waits)
        print(
            f"  {type:15s} n={len(ms):5d}  mean {statistics.fmean(ms):6.2f} ms  "
            f"p50 {ms[len(ms) // 2]:6.2f} ms  p90 {ms[int(0.9 * len(ms))]:6.2f} ms"
        )
    median = statistics.median(ratios)
    print(f"median on/off throughput ratio: {median:.3f} (cost {100 * (1 - median):.1f} %)")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint dir (default: a tiny random Llama)")
    p.add_argument("--url", default=None, help="database URL (default: SQLite in a temp dir)")
    p.add_argument("--runs", type=int, default=16)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-blocks", type=int, default=1024)
    asyncio.run(main(p.parse_args()))
