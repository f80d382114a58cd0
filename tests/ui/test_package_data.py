"""The page ships inside the wheel: every file under server/static matches the package
data patterns of pyproject.toml (a file they miss would be absent for `pip install`
users), and the page loads no file that is not there."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

from parrot_backend.server.ui import STATIC_DIR

ROOT = Path(__file__).resolve().parents[2]


def test_every_static_file_is_package_data():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["parrot_backend.server"]
    files = sorted(
        p.relative_to(STATIC_DIR.parent).as_posix()
        for p in STATIC_DIR.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )
    assert "static/index.html" in files and "static/app.js" in files
    missed = [f for f in files if not any(fnmatch.fnmatchcase(f, p) for p in patterns)]
    assert missed == []


def test_the_page_refers_only_to_files_it_ships():
    wanted = set()
    for page in STATIC_DIR.glob("*.*"):
        text = page.read_text()
        wanted |= set(re.findall(r"/ui/static/([\w.-]+)", text))
        wanted |= set(re.findall(r'from "\./([\w.-]+)"', text))
    assert {
        "app.js",
        "style.css",
        "api.js",
        "stream.js",
        "view.js",
        "dag.js",
        "program.js",
    } <= wanted
    assert all((STATIC_DIR / name).is_file() for name in wanted), wanted
