"""Kernel tests run under the Triton CPU interpreter unless TRITON_INTERPRET=0 is set.

The interpreter is chosen when a kernel is decorated, i.e. when our kernel modules are
imported, so the variable is set here, before any test module imports them.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

# A kernel module imported earlier (by another test package) was decorated without the
# interpreter; drop it so the imports below decorate the kernels again.
if os.environ["TRITON_INTERPRET"] != "0":
    for _name in [m for m in sys.modules if m.startswith("parrot_backend.kernels")]:
        del sys.modules[_name]

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def device() -> torch.device:
    """CPU under the interpreter; the GPU when run with TRITON_INTERPRET=0 on CUDA."""
    if os.environ["TRITON_INTERPRET"] == "0":
        if not torch.cuda.is_available():
            pytest.skip("TRITON_INTERPRET=0 needs a CUDA device")
        return torch.device("cuda")
    return torch.device("cpu")
