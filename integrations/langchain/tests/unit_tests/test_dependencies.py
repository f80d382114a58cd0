"""The package stays light: neither its dependencies nor its import pull in torch.

The closure is resolved from the metadata of the installed distributions (markers
evaluated for this interpreter, extras not taken), the same set `pip install
./integrations/langchain` would install into a bare venv.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PACKAGE_DIR = Path(__file__).resolve().parents[2]
HEAVY = {"torch", "transformers", "triton", "parrot-backend", "accelerate", "safetensors"}


def runtime_requirements(requirements: list[str]) -> list[Requirement]:
    out = []
    for line in requirements:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            out.append(req)
    return out


def dependency_closure(roots: list[Requirement]) -> set[str]:
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        seen.add(name)
        todo.extend(runtime_requirements(metadata.requires(req.name) or []))
    return seen


def test_declared_dependencies_are_langchain_core_and_httpx_only() -> None:
    project = tomllib.loads((PACKAGE_DIR / "pyproject.toml").read_text())["project"]
    names = {canonicalize_name(Requirement(r).name) for r in project["dependencies"]}
    assert names == {"langchain-core", "httpx"}


def test_the_installed_dependency_closure_has_no_torch() -> None:
    project = tomllib.loads((PACKAGE_DIR / "pyproject.toml").read_text())["project"]
    closure = dependency_closure(runtime_requirements(project["dependencies"]))
    assert {"langchain-core", "httpx", "pydantic"} <= closure
    assert not closure & HEAVY


def test_importing_the_package_loads_no_torch() -> None:
    code = (
        "import sys, langchain_parrot; "
        "heavy = {'torch', 'transformers', 'parrot_backend'} & set(sys.modules); "
        "print(sorted(heavy))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"
