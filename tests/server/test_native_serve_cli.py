"""`serve` and its database: clear refusals at start, before any model is loaded."""

from __future__ import annotations

import subprocess
import sys

import pytest

from parrot_backend.cli import _database_url, build_parser


def _serve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "parrot_backend.cli", "serve", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_no_upgrade_refuses_an_empty_database_and_writes_nothing(tmp_path) -> None:
    r = _serve("--data-dir", str(tmp_path), "--no-upgrade", "--model", str(tmp_path / "nope"))
    assert r.returncode == 2
    assert "without --no-upgrade" in r.stderr
    db = tmp_path / "parrot.db"
    assert not db.exists() or db.stat().st_size == 0


def test_a_foreign_file_is_refused_untouched(tmp_path) -> None:
    db = tmp_path / "parrot.db"
    db.write_bytes(b"not a database at all" * 10)
    before = db.read_bytes()
    r = _serve("--data-dir", str(tmp_path), "--model", str(tmp_path / "nope"))
    assert r.returncode == 2 and "database" in r.stderr
    assert db.read_bytes() == before


def test_bad_database_url_is_a_clear_error(tmp_path) -> None:
    r = _serve("--database-url", "mysql://x@y/z", "--model", str(tmp_path / "nope"))
    assert r.returncode == 2 and "unsupported database" in r.stderr


def test_data_dir_defaults(tmp_path, monkeypatch) -> None:
    parser = build_parser()
    monkeypatch.delenv("PARROT_DATABASE_URL", raising=False)
    monkeypatch.setenv("PARROT_DATA_DIR", str(tmp_path / "d"))
    args = parser.parse_args(["serve"])
    assert _database_url(args) == f"sqlite:///{tmp_path / 'd' / 'parrot.db'}"
    args = parser.parse_args(["serve", "--data-dir", str(tmp_path / "e")])
    assert _database_url(args) == f"sqlite:///{tmp_path / 'e' / 'parrot.db'}"
    monkeypatch.setenv("PARROT_DATABASE_URL", "postgresql+psycopg://u@h/db")
    assert _database_url(parser.parse_args(["serve"])) == "postgresql+psycopg://u@h/db"
    args = parser.parse_args(["serve", "--database-url", "sqlite:////tmp/x.db"])
    assert _database_url(args) == "sqlite:////tmp/x.db"
    assert (args.host, args.port) == ("127.0.0.1", 8000)


def test_a_negative_gc_threshold_is_refused(tmp_path) -> None:
    r = _serve(
        "--data-dir", str(tmp_path), "--gc-threshold", "-1", "--model", str(tmp_path / "nope")
    )
    assert r.returncode == 2 and "--gc-threshold must be >= 0" in r.stderr
    assert not (tmp_path / "parrot.db").exists()  # refused before the store is opened


def test_token_flush_reaches_the_write_buffer_and_bad_values_are_refused(tmp_path, capsys):
    from parrot_backend.server.runtime import NativeRuntime
    from parrot_backend.store import Store
    from parrot_backend.testing.fake_engine import NoopEngine

    parser = build_parser()
    assert parser.parse_args(["serve"]).token_flush == 0.1
    assert parser.parse_args(["serve", "--token-flush", "0.02"]).token_flush == 0.02
    for bad in ["0", "-1", "nan", "inf", "11", "soon"]:
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--token-flush", bad])
        assert "--token-flush" in capsys.readouterr().err
    store = Store(f"sqlite:///{tmp_path / 'p.db'}")
    engines = {"e0": NoopEngine()}
    rt = NativeRuntime(store, engines, flush_interval_s=0.02)
    assert rt.persister.buffer.flush_interval_s == 0.02
    assert NativeRuntime(store, engines).persister.buffer.flush_interval_s == 0.1
