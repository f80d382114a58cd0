"""Kernel tests run under the Triton CPU interpreter on machines without CUDA.

The interpreter is chosen when a kernel is decorated, i.e. when our kernel modules are
imported, so the variable is set here, before any test module imports them. On a CUDA
machine the kernels run natively (the variable would also reach the engine's tests in the
same session); TRITON_INTERPRET=1 forces the interpreter there too.
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A kernel module imported earlier (by another test package) was decorated without the
# interpreter; drop it so the imports below decorate the kernels again.
if os.environ.get("TRITON_INTERPRET", "0") != "0":
    for _name in [m for m in sys.modules if m.startswith("parrot_backend.kernels")]:
        del sys.modules[_name]

import pytest  # noqa: E402


@pytest.fixture
def device() -> torch.device:
    """CPU under the interpreter, else the GPU."""
    if os.environ.get("TRITON_INTERPRET", "0") != "0":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET=0 needs a CUDA device")
    return torch.device("cuda")
