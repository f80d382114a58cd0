"""Engine benchmarks on SmolLM2-135M, each against a baseline measured in the same run.

    .venv/bin/python benchmarks/engine_bench.py [--quick]

1. throughput: our engine vs transformers `generate()` on the same prompts, batch 1 and 8
   (decode tokens/s and time to first token);
   and prefill alone: one long prompt (1,000 and 2,000 tokens) filled by the engine vs one
   transformers forward over it (prefill tokens/s);
2. shared prefix: 8 requests with a common 512-token prefix, forked from one filled
   context vs no sharing (prefill time and total time);
3. memory: KV blocks held by N forks of a P-token prefix vs N unshared copies; pool
   utilisation (tokens stored / slots allocated) under a mixed workload; peak RSS.
Results are ratios; the machine is shared and noisy, so absolute figures are indicative.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import time

import torch

from parrot_backend.contract.sampling import SamplingParams
from parrot_backend.engine.engine import Engine, compute_executor
from parrot_backend.engine.model_files import resolve_model

TEXT = (
    "Parrots are intelligent birds found in tropical regions. They live in flocks, eat seeds "
    "and fruit, and some species can imitate human speech. "
)


def prompts(engine, n: int, length: int) -> list[list[int]]:
    base = engine.tokenize(TEXT * 80)
    return [base[i * 7 : i * 7 + length] for i in range(n)]


async def engine_run(engine, batch: list[list[int]], max_tokens: int, tag: str):
    """Generate for every prompt concurrently; return (ttft list, total seconds, tokens)."""
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ttft: list[float] = []
    t0 = time.perf_counter()

    async def one(i, p):
        await engine.fill(f"{tag}{i}", None, p)
        first = None
        n = 0
        async for _ in engine.generate(f"{tag}{i}", None, sampling):
            n += 1
            if first is None:
                first = time.perf_counter() - t0
        ttft.append(first)
        await engine.free(f"{tag}{i}")
        return n

    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(batch)))
    return ttft, time.perf_counter() - t0, sum(counts)


def hf_run(model, batch: list[list[int]], max_tokens: int):
    """transformers generate() on an unpadded batch of equal-length prompts, on the engine's
    compute thread: torch on a second thread would slow both sides (see compute_executor)."""
    return compute_executor().submit(_hf_run, model, batch, max_tokens).result()


def _hf_run(model, batch: list[list[int]], max_tokens: int):
    ids = torch.tensor(batch)

    class FirstToken:
        """Streamer that records when the first generated token arrives."""

        def __init__(self):
            self.calls = 0
            self.first = None

        def put(self, value):
            self.calls += 1
            if self.calls == 2 and self.first is None:  # first put() is the prompt
                self.first = time.perf_counter()

        def end(self):
            pass

    streamer = FirstToken() if len(batch) == 1 else None
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
            streamer=streamer,
        )
    total = time.perf_counter() - t0
    ttft = (streamer.first - t0) if streamer and streamer.first else None
    return ttft, total, (out.shape[1] - ids.shape[1]) * len(batch)


def bench_throughput(engine, model, max_tokens: int, prompt_len: int, reps: int) -> list[dict]:
    """Engine and transformers alternate `reps` times; medians resist a noisy machine."""
    rows = []
    for bsz in (1, 8):
        batch = prompts(engine, bsz, prompt_len)
        asyncio.run(_with(engine, engine_run, batch[:1], 2, "warm"))
        hf_run(model, batch[:1], 2)
        ours, theirs = [], []
        for rep in range(reps):
            ttft, total, n = asyncio.run(
                _with(engine, engine_run, batch, max_tokens, f"b{bsz}-{rep}-")
            )
            ours.append((n / total, sum(ttft) / len(ttft)))
            hf_ttft, hf_total, hf_n = hf_run(model, batch, max_tokens)
            theirs.append((hf_n / hf_total, hf_ttft))
        tok_s = statistics.median(o[0] for o in ours)
        hf_tok_s = statistics.median(t[0] for t in theirs)
        hf_ttfts = [t[1] for t in theirs if t[1] is not None]
        rows.append(
            {
                "batch": bsz,
                "prompt_tokens": prompt_len,
                "new_tokens": max_tokens,
                "reps": reps,
                "engine_tok_s": tok_s,
                "hf_tok_s": hf_tok_s,
                "speedup": tok_s / hf_tok_s,
                "engine_ttft_s": statistics.median(o[1] for o in ours),
                "hf_ttft_s": statistics.median(hf_ttfts) if hf_ttfts else None,
            }
        )
    return rows


def bench_prefill(engine, model, lengths: list[int], reps: int) -> list[dict]:
    """One prompt of each length: the engine's fill (chunked by its token budget) vs one
    transformers forward (last position's logits only), alternating, medians."""
    rows = []
    for length in lengths:
        batch = prompts(engine, 2 * reps, length)
        asyncio.run(_with(engine, _fill_timed, batch[0][:32], "pw"))
        ours, theirs = [], []
        for rep in range(reps):
            ours.append(asyncio.run(_with(engine, _fill_timed, batch[2 * rep], f"p{length}-{rep}")))
            theirs.append(
                compute_executor().submit(_hf_prefill, model, batch[2 * rep + 1]).result()
            )
        ours_s, theirs_s = statistics.median(ours), statistics.median(theirs)
        rows.append(
            {
                "prompt_tokens": length,
                "reps": reps,
                "engine_tok_s": length / ours_s,
                "hf_tok_s": length / theirs_s,
                "ratio": theirs_s / ours_s,
            }
        )
    return rows


async def _fill_timed(engine, prompt: list[int], tag: str) -> float:
    t0 = time.perf_counter()
    await engine.fill(tag, None, prompt)
    took = time.perf_counter() - t0
    await engine.free(tag)
    return took


def _hf_prefill(model, prompt: list[int]) -> float:
    with torch.inference_mode():
        t0 = time.perf_counter()
        model(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
        return time.perf_counter() - t0


async def _with(engine, fn, *args):
    async with engine:
        return await fn(engine, *args)


def bench_shared_prefix(path, prefix_len: int, n: int, suffix_len: int, max_tokens: int):
    results = {}
    for mode in ("fork", "unshared"):
        engine = Engine.from_pretrained(path, num_blocks=1024, prefix_cache=False, progress=False)
        base = prompts(engine, n + 1, prefix_len + suffix_len)
        prefix = base[0][:prefix_len]
        suffixes = [p[prefix_len:] for p in base[1:]]
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

        async def go(engine=engine, prefix=prefix, suffixes=suffixes, sampling=sampling, mode=mode):
            async with engine:
                await engine.fill("warm", None, prefix[:32])
                t0 = time.perf_counter()
                if mode == "fork":
                    await engine.fill("prefix", None, prefix)
                    await asyncio.gather(
                        *(engine.fill(i, "prefix", s) for i, s in enumerate(suffixes))
                    )
                else:
                    await asyncio.gather(
                        *(engine.fill(i, None, prefix + s) for i, s in enumerate(suffixes))
                    )
                prefill = time.perf_counter() - t0
                used = engine.stats_now().blocks_used

                async def gen(i):
                    return [d async for d in engine.generate(i, None, sampling)]

                outs = await asyncio.gather(*(gen(i) for i in range(len(suffixes))))
                total = time.perf_counter() - t0
                return prefill, total, used, [[d.token_id for d in o] for o in outs]

        results[mode] = asyncio.run(go())
    fork, plain = results["fork"], results["unshared"]
    return {
        "prefix_tokens": prefix_len,
        "requests": n,
        "suffix_tokens": suffix_len,
        "fork_prefill_s": fork[0],
        "unshared_prefill_s": plain[0],
        "prefill_speedup": plain[0] / fork[0],
        "fork_total_s": fork[1],
        "unshared_total_s": plain[1],
        "total_speedup": plain[1] / fork[1],
        "fork_blocks": fork[2],
        "unshared_blocks": plain[2],
        "same_outputs": fork[3] == plain[3],
    }


def bench_memory(path, prefix_len: int, n: int, suffix_len: int) -> dict:
    engine = Engine.from_pretrained(path, num_blocks=2048, prefix_cache=False, progress=False)
    bs = engine.pool.block_size
    base = prompts(engine, n + 1, prefix_len + suffix_len)

    async def go():
        async with engine:
            await engine.fill("p", None, base[0][:prefix_len])
            await asyncio.gather(
                *(engine.fill(i, "p", b[prefix_len:]) for i, b in enumerate(base[1:]))
            )
            forked = engine.stats_now().blocks_used
            for i in range(n):
                await engine.free(i)
            await engine.free("p")
            # mixed workload: ragged prompts and generations alive at once
            # chat-like mix: prompts of 40-500 tokens, 32 generated tokens each
            lens = [180, 45, 320, 96, 410, 260, 75, 500]
            sampling = SamplingParams(max_tokens=32, ignore_eos=True)
            mixed = prompts(engine, len(lens), max(lens))
            await asyncio.gather(
                *(
                    engine.fill(f"m{i}", None, m[:k])
                    for i, (m, k) in enumerate(zip(mixed, lens, strict=True))
                )
            )

            async def gen(i):
                return [d async for d in engine.generate(f"m{i}", None, sampling)]

            await asyncio.gather(*(gen(i) for i in range(len(lens))))
            stored = sum(engine.contexts[f"m{i}"].num_computed for i in range(len(lens)))
            slots = engine.stats_now().blocks_used * bs
            return forked, stored, slots

    forked, stored, slots = asyncio.run(go())
    ideal_shared = -(-prefix_len // bs) + n * -(-(prefix_len % bs + suffix_len) // bs)
    return {
        "forks": n,
        "prefix_tokens": prefix_len,
        "suffix_tokens": suffix_len,
        "fork_kv_tokens": forked * bs,
        "shared_bound_tokens": ideal_shared * bs,
        "unshared_kv_tokens": n * (prefix_len + suffix_len),
        "mixed_tokens_stored": stored,
        "mixed_slots_allocated": slots,
        "pool_utilisation": stored / slots,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer tokens (a smoke run)")
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="weights and KV dtype, the same for both sides",
    )
    args = ap.parse_args()
    torch.manual_seed(0)
    path = resolve_model(None, progress=True)
    new = 8 if args.quick else 32
    engine = Engine.from_pretrained(
        path, num_blocks=2048, prefix_cache=False, progress=False, dtype=args.dtype
    )
    from transformers import AutoModelForCausalLM

    model = (
        compute_executor()
        .submit(AutoModelForCausalLM.from_pretrained, str(path), dtype=getattr(torch, args.dtype))
        .result()
        .eval()
    )
    out = {
        "dtype": args.dtype,
        "throughput": bench_throughput(engine, model, new, 64, 1 if args.quick else 3),
        "prefill": bench_prefill(
            engine, model, [256] if args.quick else [1000, 2000], 1 if args.quick else 3
        ),
        "shared_prefix": bench_shared_prefix(path, 512, 8, 16, 4 if args.quick else 16),
        "memory": bench_memory(path, 512, 8, 16),
    }
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
