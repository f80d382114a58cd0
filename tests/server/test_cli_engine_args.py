"""The engine arguments of `generate`, `serve` and `engine` reach the engine they load."""

from __future__ import annotations

import pytest

from parrot_backend.cli import build_parser
from parrot_backend.server.engine_main import load_engine

COMMANDS = [["generate", "hello"], ["serve"], ["engine"]]


def _load(tiny_model_dir, command: list[str], *flags: str):
    argv = [*command, "--model", str(tiny_model_dir), "--device", "cpu", "--num-blocks", "64"]
    return load_engine(build_parser().parse_args([*argv, *flags]))


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_no_prefix_cache_turns_the_engines_token_cache_off(tiny_model_dir, command) -> None:
    engine = _load(tiny_model_dir, command, "--no-prefix-cache")
    assert engine.stats_now().prefix_cache_enabled is False
    assert engine.stats_now().blocks_total == 64


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_the_token_cache_is_on_by_default(tiny_model_dir, command) -> None:
    assert _load(tiny_model_dir, command).stats_now().prefix_cache_enabled is True


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_background_flags_reach_the_scheduler(tiny_model_dir, command) -> None:
    s = _load(tiny_model_dir, command, "--background-tokens", "12", "--background-every", "0")
    assert (s.scheduler.background_tokens, s.scheduler.background_every) == (12, 0)
    s = _load(tiny_model_dir, command).scheduler  # the CPU defaults
    assert (s.background_tokens, s.background_every) == (0, 0)
    assert (s.background_share, s.background_wait, s.hold) == (0.0, 2.0, 0.03)
    s = _load(
        tiny_model_dir,
        command,
        "--background-share",
        "0.5",
        "--background-wait",
        "0",
        "--urgent-hold",
        "0.01",
    ).scheduler
    assert (s.background_share, s.background_wait, s.hold) == (0.5, 0.0, 0.01)


def test_a_negative_background_flag_is_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--background-every", "-1"])
    assert "must be >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--background-share", "1.5"])
    assert "must be from 0 to 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--urgent-hold", "-0.1"])
    assert "must be a finite number >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_linear_flag_reaches_the_model(tiny_model_dir, command) -> None:
    engine = _load(tiny_model_dir, command, "--linear", "torch")
    assert engine.linear == engine.runner.model.linear == "torch"


def test_an_unknown_linear_is_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--linear", "mkl"])
    assert "invalid choice: 'mkl'" in capsys.readouterr().err


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_urgent_linger_reaches_the_scheduler(tiny_model_dir, command) -> None:
    assert _load(tiny_model_dir, command, "--urgent-linger", "0").scheduler.linger == 0.0
    assert _load(tiny_model_dir, command).scheduler.linger == 0.25


@pytest.mark.parametrize("value", ["-1", "inf", "soon"])
def test_a_bad_urgent_linger_is_refused(capsys, value) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--urgent-linger", value])
    assert "--urgent-linger" in capsys.readouterr().err


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_pause_steps_flag_reaches_the_engine(tiny_model_dir, command) -> None:
    assert _load(tiny_model_dir, command).pause_steps is True  # auto: on on a CPU
    assert _load(tiny_model_dir, command, "--pause-steps", "off").pause_steps is False
    assert _load(tiny_model_dir, command, "--pause-steps", "on").pause_steps is True


def test_an_unknown_pause_steps_value_is_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--pause-steps", "sometimes"])
    assert "invalid choice" in capsys.readouterr().err
