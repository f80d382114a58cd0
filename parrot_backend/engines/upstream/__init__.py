"""Upstream engines: the engine contract over a server users already run (vLLM, SGLang,
llama.cpp, or any OpenAI-compatible completions server), so Parrot's manager drives it.

- `engine.py`: `UpstreamEngine` (connect, fill, generate, free, stats, warm-up).
- `contexts.py`: the tree of contexts the adapter keeps itself (token lists).
- `dialects.py`: request bodies and streamed chunks, llama.cpp's native route vs OpenAI's.
- `discover.py`: what the server is and serves, asked at connect time.
- `tokenizer.py`: a local Hugging Face tokenizer, or the server's `/tokenize`.
- `metrics.py`: the server's Prometheus metrics as a load.
"""

from .engine import UpstreamEngine, connect_all, error_for

__all__ = ["UpstreamEngine", "connect_all", "error_for"]
