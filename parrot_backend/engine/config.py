"""Engine settings, and how `auto` picks a device, a dtype and an attention backend."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .model_files import DEFAULT_MODEL

GiB = 1 << 30


@dataclass(slots=True)
class EngineConfig:
    """Engine settings; every field has a default that works on a laptop CPU."""

    model: str = DEFAULT_MODEL
    dtype: str = "auto"  # float32 on CPU, bfloat16 on CUDA
    device: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None  # None: size the pool from memory
    kv_memory_fraction: float = 0.1  # of available memory, when num_blocks is None
    kv_memory_max_bytes: int = 1 * GiB  # cap on CPU, where memory is shared with everything
    max_num_seqs: int = 64
    max_batched_tokens: int = 512
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    prefix_cache: bool = True
    attention_backend: str = "auto"  # torch on CPU, triton on CUDA (when installed)
    # matmul of projections and LM head: onednn (packed weights) on CPU in float32 or
    # bfloat16 (much faster than F.linear beyond one row, `models/linear.py`), torch
    # elsewhere; or "torch"/"onednn"
    linear: str = "auto"
    threads: int | None = None  # CPU threads of torch ops; None: chosen by measuring steps
    # tokens per step of less urgent work while more urgent work runs (plus a quarter of
    # the urgent tokens in the step), and every how many such steps it gets an eighth of
    # the step budget (0: never); None: by device (`pick_background`)
    background_tokens: int | None = None
    background_every: int | None = None
    # the longest (seconds) less urgent work goes without that eighth while more urgent
    # work runs (a stream of latency calls does not starve it); 0: no limit
    background_wait: float = 2.0
    # the share of the urgent work's tokens in a step that less urgent work may add to it
    # (its decode rows count one token each); None: by device (`pick_share`)
    background_share: float | None = None
    # seconds after a request ends during which less urgent work keeps to that eighth per
    # step (the next call of a latency chain is likely on its way); 0: off
    urgent_linger: float = 0.25
    # of those, the first seconds in which less urgent work waits (no step is planned for
    # it alone), so that the chain's next call, on its way, starts in an idle engine
    # instead of after a background step; 0: off; None: by device (`pick_hold`)
    urgent_hold: float | None = None
    # a step of only less urgent work runs layer by layer and pauses after a layer when
    # more urgent work arrives (`step_loop.py`); None: by device (`pick_pause`)
    pause_steps: bool | None = None
    # draft tokens a decode row checks per step (prompt lookup, `speculate.py`),
    # in steps of at most `speculate_rows` decode rows; None: by device
    # (`pick_speculate`); 0: off
    speculate: int | None = None
    speculate_rows: int | None = None


def pick_device(name: str) -> torch.device:
    """`auto`: CUDA when available, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: bfloat16 on CUDA, float32 elsewhere; raises ValueError for unknown names."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(table)}")
    return table[name]


def pick_backend(name: str, device: torch.device) -> str:
    """`auto`: triton on CUDA when it is installed, else torch."""
    if name != "auto":
        return name
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "torch"
        return "triton"
    return "torch"


def pick_background(config: EngineConfig, device: torch.device) -> tuple[int, int]:
    """(background_tokens, background_every): how much less urgent work a step carries
    beside more urgent work (`engine/scheduler.py`). On a CPU extra rows are not free
    (SmolLM2-135M, fp32, 2 cores, oneDNN's linear: a decode step of 1 row ~36 ms,
    5 rows ~50 ms, 12 rows ~80 ms; with F.linear 65 / 125 / 160 ms), so nothing rides
    along and the background gets a turn only when it has waited `background_wait`
    (a latency chain under a throughput batch then takes ~1.1x its idle time, and the
    batch's throughput is what it is under request-level serving; a turn every 6th step
    made the chain ~1.6x, `benchmarks/README.md`); on a GPU extra rows are nearly free
    until a step holds hundreds of tokens: an eighth of the step budget every step."""
    for name in ("background_tokens", "background_every"):
        value = getattr(config, name)
        if value is not None and value < 0:
            raise ValueError(f"{name} must be >= 0")
    cpu = device.type == "cpu"
    tokens = config.background_tokens
    if tokens is None:
        tokens = 0 if cpu else max(16, config.max_batched_tokens // 8)
    every = config.background_every
    if every is None:
        every = 0
    return tokens, every


def pick_linger(seconds: float, name: str = "urgent_linger") -> float:
    """`EngineConfig.urgent_linger` (or `urgent_hold`), checked: finite seconds >= 0."""
    if not (isinstance(seconds, int | float) and 0 <= seconds < float("inf")):
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {seconds!r}")
    return float(seconds)


def pick_share(config: EngineConfig, device: torch.device) -> float:
    """`EngineConfig.background_share`, checked (0 to 1); None: by device (CPU 0: a latency
    call's prefill step with 15 throughput decode rows riding along took ~0.05 s more;
    CUDA a quarter: rows are nearly free there)."""
    share = config.background_share
    if share is None:
        return 0.0 if device.type == "cpu" else 0.25
    if not (isinstance(share, int | float) and 0 <= share <= 1):
        raise ValueError(f"background_share must be a number from 0 to 1, got {share!r}")
    return float(share)


def pick_hold(config: EngineConfig, device: torch.device) -> float:
    """`EngineConfig.urgent_hold`, checked; None: by device (CPU 0.03 s: a chain's next
    call reaches the engine ~10 ms after its previous one ends, and a background step
    started meanwhile took ~0.1 s, which it waited for; CUDA 0: its steps take ms)."""
    if config.urgent_hold is None:
        return 0.03 if device.type == "cpu" else 0.0
    return pick_linger(config.urgent_hold, "urgent_hold")


def pick_pause(config: EngineConfig, device: torch.device) -> bool:
    """`EngineConfig.pause_steps`; None: by device (CPU on: a throughput step there is up
    to ~0.4 s, which a latency call arriving during it waited for; CUDA off: its steps take
    milliseconds, and a check between layers would wait for the device each layer)."""
    if config.pause_steps is None:
        return device.type == "cpu"
    if not isinstance(config.pause_steps, bool):
        raise ValueError(f"pause_steps must be True, False or None, got {config.pause_steps!r}")
    return config.pause_steps


def pick_speculate(config: EngineConfig, device: torch.device) -> tuple[int, int]:
    """(speculate, speculate_rows): draft tokens per decode row, and the most
    decode rows a step may have for its rows to draft (`engine/speculate.py`). On a CPU
    a step's time grows slowly with its first few rows (the weights are read once per
    step), so a lone generation that copies from its context gains; past a few
    rows the drafts' rows cost more than they save. CUDA: off until measured there."""
    for name in ("speculate", "speculate_rows"):
        value = getattr(config, name)
        if value is not None and not (isinstance(value, int) and value >= 0):
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    cpu = device.type == "cpu"
    k = config.speculate
    if k is None:
        k = SPECULATE_CPU[0] if cpu else 0
    rows = config.speculate_rows
    if rows is None:
        rows = SPECULATE_CPU[1] if cpu else 8
    return k, rows


# CPU defaults of (speculate, speculate_rows)
SPECULATE_CPU = (4, 2)
