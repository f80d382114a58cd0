"""The documentation's code blocks as a user pastes them: every Python block parses and uses
no name it does not define or import (a block that leans on an earlier one raised
NameError when pasted alone), and shell blocks call the CLI by the path setup creates
(`make setup` never activates `.venv`, so a bare `parrot-backend` is "command not found").
Running the blocks needs a server; they were run by hand (see each document)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [
    ROOT / "README.md",
    ROOT / "examples" / "README.md",
    ROOT / "integrations" / "langchain" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def _blocks(lang: str) -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for m in FENCE.finditer(text):
            if m.group(1) == lang:
                line = text.count("\n", 0, m.start()) + 1
                out.append((f"{doc.relative_to(ROOT)}:{line}", m.group(2)))
    return out


def _ruff() -> str:
    found = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if found is None:
        pytest.skip("ruff is not installed")
    return found


PYTHON = _blocks("python")


def test_the_docs_have_python_blocks():
    assert len(PYTHON) >= 5, [where for where, _ in PYTHON]


@pytest.mark.parametrize("where,code", PYTHON, ids=[w for w, _ in PYTHON])
def test_a_python_block_stands_alone(where, code, tmp_path):
    compile(code, where, "exec")  # a syntax error names the block
    snippet = tmp_path / "snippet.py"
    snippet.write_text(code)
    result = subprocess.run(
        [_ruff(), "check", "--isolated", "--select", "F821,F822,F823", str(snippet)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, f"{where}: undefined names\n{result.stdout}"


def test_shell_blocks_call_the_cli_by_its_venv_path():
    bare = []
    for where, code in _blocks("bash") + _blocks("sh"):
        for line in code.splitlines():
            if re.match(r"\s*parrot-backend\s", line):
                bare.append(f"{where}: {line.strip()}")
    assert not bare, "use .venv/bin/parrot-backend (setup does not activate .venv):\n" + "\n".join(
        bare
    )
