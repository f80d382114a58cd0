"""Running one workload the way a naive app does with Hugging Face `transformers`.

No server: the harness process loads `AutoModelForCausalLM` (float32, CPU) from the same
local model folder the servers load, once, and reuses it for every run. A workload runs in
waves: every call whose inputs exist goes into ONE batched `model.generate()` (prompts
tokenized as the engine does, without special tokens; left padding with an attention
mask; greedy; `max_new_tokens` = the wave's largest `max_tokens`), each call's output is
cut to its own `max_tokens` and at its first EOS, and the next wave renders its prompts
with those outputs. There is no prefix caching of any kind (each wave computes every
prompt token, padding included): that is the baseline's point.

What is recorded, beside the other modes' fields (see `modes.py`):

- `jct`: from the start to the last awaited output, model already loaded and warmed.
- per call `ttft` and `latency`: wave start to wave end. `generate()` is not streamed, so
  the first token is seen only when the whole wave returns; a call's inputs exist at its
  wave's start (each call runs in the first wave after its last input is produced).
- `tokens`: tokens sampled up to the call's cut, its EOS included (the engine counts an
  EOS step as a generated token too); `finish` is `"eos"` or `"length"`.
- `prompt`: the prompt as rendered (for the report's prefill accounting).
- `rtt`: 0. The simulated client round trip is not paid: `generate()` runs in process,
  there is no request to make. The run record says so instead of pretending.
- `engine`: empty (no engine counters apply); `hf` holds the waves (sizes, padded prompt
  length, seconds) and `prefill_padded`, the prompt tokens the batches computed.

`generate()` runs in a worker thread (`asyncio.to_thread`), so the harness's event loop
stays free; the thread sets torch's thread count to the machine's cores first.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .workloads import Workload


def machine_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass
class HFModel:
    """A loaded model, its tokenizer and what `generate()` needs to stop and pad."""

    model_dir: Path
    model: Any
    tokenizer: Any
    eos_ids: list[int]
    pad_id: int
    threads: int
    load_s: float = 0.0
    lock: Any = field(default=None, repr=False)


_LOADED: dict[tuple[str, int], HFModel] = {}


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    """The model config's EOS ids and the tokenizer's (the engine stops on either)."""
    ids: set[int] = set()
    for src in (getattr(model.config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(i) for i in src)
    return sorted(ids)


def load(model_dir: str | os.PathLike | None = None, threads: int | None = None) -> HFModel:
    """Load the model once per (folder, threads); later calls return the same object.
    `model_dir` None: the default model, as the servers resolve it. Loading ends with a
    tiny generate() so that first-use costs do not land in the first run's JCT."""
    import threading

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from parrot_backend.engine.model_files import resolve_model

    path = resolve_model(model_dir, progress=False)
    threads = threads or machine_cores()
    key = (str(path), threads)
    if key in _LOADED:
        return _LOADED[key]
    began = time.perf_counter()
    torch.set_num_threads(threads)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # the harness has its own progress bar on stderr
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch.float32, local_files_only=True
        )
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    model.eval()
    eos = _eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = eos[0] if eos else 0
    hf = HFModel(path, model, tokenizer, eos, pad, threads, lock=threading.Lock())
    warm = "Warm up: " + " ".join(str(i) for i in range(40))
    for _ in range(2):  # padded rows and several decode steps, as the runs will have
        generate_wave(hf, [warm, "Warm up"], [4, 2])
    hf.load_s = time.perf_counter() - began
    _LOADED[key] = hf
    return hf


def generate_wave(hf: HFModel, prompts: list[str], max_tokens: list[int]) -> list[dict]:
    """One batched greedy `generate()` over `prompts` (left padded). Per prompt: the
    sampled token ids cut to its own max_tokens and at its first EOS (EOS kept in the
    count, not in the text), the text, and why it stopped. Blocking: call it in a thread."""
    import torch

    from parrot_backend.engine.tokens import decode_tokens, encode_segment

    if len(prompts) != len(max_tokens) or not prompts:
        raise ValueError("one max_tokens per prompt, at least one prompt")
    with hf.lock:  # one generate() at a time on the shared model
        torch.set_num_threads(hf.threads)  # per thread under OpenMP: set it where it runs
        ids = [encode_segment(hf.tokenizer, p) for p in prompts]
        width = max(len(s) for s in ids)
        input_ids = torch.full((len(ids), width), hf.pad_id, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for row, seq in enumerate(ids):
            if seq:
                input_ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
                mask[row, width - len(seq) :] = 1
        with torch.inference_mode():
            out = hf.model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=max(max_tokens),
                eos_token_id=hf.eos_ids or None,
                pad_token_id=hf.pad_id,
                num_beams=1,
            )
    results = []
    eos = set(hf.eos_ids)
    for row, limit in enumerate(max_tokens):
        new = out[row, width:].tolist()[:limit]
        finish = "length"
        for k, t in enumerate(new):
            if t in eos:
                new, finish = new[: k + 1], "eos"
                break
        text_ids = new[:-1] if finish == "eos" else new
        results.append(
            {
                "token_ids": new,
                "text": decode_tokens(hf.tokenizer, text_ids),
                "finish": finish,
                "prompt_len": len(ids[row]),
            }
        )
    return results


async def run_transformers(
    wl: Workload,
    model_dir: str | os.PathLike | None = None,
    rtt: float = 0.0,
    hf: HFModel | None = None,
) -> dict:
    """Run `wl` in waves of batched `generate()`. `rtt` is accepted for symmetry with
    the other modes and not paid (in process: no request); the record says `rtt: 0`."""
    if hf is None:
        hf = await asyncio.to_thread(load, model_dir)
    values: dict[str, str] = dict(wl.inputs)
    pending = list(wl.calls)
    records: dict[str, dict] = {}
    waves: list[dict] = []
    start = time.time()
    while pending:
        wave = [c for c in pending if all(i in values for i in c.inputs)]
        if not wave:
            missing = sorted({i for c in pending for i in c.inputs if i not in values})
            raise RuntimeError(f"{wl.name}: no call can start; inputs never produced: {missing}")
        prompts = [c.render(values) for c in wave]
        began = time.time()
        got = await asyncio.to_thread(generate_wave, hf, prompts, [c.max_tokens for c in wave])
        ended = time.time()
        width = max(g["prompt_len"] for g in got)
        waves.append(
            {
                "calls": [c.name for c in wave],
                "batch": len(wave),
                "padded_prompt_len": width,
                "max_new_tokens": max(c.max_tokens for c in wave),
                "seconds": ended - began,
            }
        )
        for c, prompt, g in zip(wave, prompts, got, strict=True):
            values[c.output] = g["text"]
            records[c.name] = {
                "name": c.name,
                "ready": began - start,
                "ttft": ended - began,  # not streamed: the whole wave is the first token
                "latency": ended - began,
                "tokens": len(g["token_ids"]),
                "prompt_tokens": g["prompt_len"],
                "prompt": prompt,
                "output": g["text"],
                "finish": g["finish"],
                "start_offset": began - start,
                "end": ended - start,
            }
        done = {c.name for c in wave}
        pending = [c for c in pending if c.name not in done]
    jct = time.time() - start
    return {
        "jct": jct,
        "calls": [records[c.name] for c in wl.calls],
        "engine": {},
        "rtt": 0.0,
        "rtt_not_paid": rtt,
        "hf": {
            "model_dir": str(hf.model_dir),
            "threads": hf.threads,
            "load_s": hf.load_s,
            "waves": waves,
            "prefill_padded": sum(w["batch"] * w["padded_prompt_len"] for w in waves),
        },
    }
