"""Guarded triton import shared by the kernel modules.

Kernel modules decorate their kernels with `jit` at import time; without triton the
decorator leaves the Python function in place, so the torch references stay importable.
Every public `*_triton` function calls `require_triton()` first.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

try:
    import triton
    import triton.language as tl

    _IMPORT_ERROR: ImportError | None = None
except ImportError as exc:  # pragma: no cover - exercised only on machines without triton
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    _IMPORT_ERROR = exc

HAS_TRITON = _IMPORT_ERROR is None

# The interpreter's launches are not thread-safe; real GPU launches need no lock.
_INTERPRET_LOCK = threading.Lock()


def require_triton() -> None:
    """Raise a clear ImportError if triton is not importable."""
    if _IMPORT_ERROR is not None:
        raise ImportError(
            "the triton attention backend needs the `triton` package (a CUDA machine, "
            "`pip install 'parrot-backend[triton]'`); use the 'torch' backend otherwise"
        ) from _IMPORT_ERROR


def jit(fn: Callable[..., Any]) -> Any:
    """`triton.jit` when triton is present, else the undecorated function."""
    return triton.jit(fn) if HAS_TRITON else fn


def interpreting() -> bool:
    """True when kernels run under the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@contextlib.contextmanager
def launch_guard() -> Iterator[None]:
    """Serialize launches under the interpreter, which shares global state across threads."""
    if interpreting():
        with _INTERPRET_LOCK:
            yield
    else:
        yield


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (and >= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())
