"""configure_gc: freezes, raises the gen-0 threshold, returns what it changed; restore_gc
puts it back. (Process-wide state: every test restores it.)"""

from __future__ import annotations

import gc

import pytest

from parrot_backend.manager.gctune import GEN0_THRESHOLD, configure_gc, restore_gc


def test_configure_gc_freezes_and_raises_the_gen0_threshold() -> None:
    before = gc.get_threshold()
    was_enabled = gc.isenabled()
    previous = configure_gc()
    try:
        assert previous.thresholds == before and previous.enabled == was_enabled
        assert gc.get_threshold() == (GEN0_THRESHOLD, before[1], before[2])
        assert gc.get_freeze_count() > 0 and gc.isenabled()
    finally:
        restore_gc(previous)
    assert gc.get_threshold() == before and gc.isenabled() == was_enabled
    assert gc.get_freeze_count() == 0


def test_configure_gc_takes_a_threshold_and_rejects_nonsense() -> None:
    previous = configure_gc(25_000)
    try:
        assert gc.get_threshold()[0] == 25_000
    finally:
        restore_gc(previous)
    with pytest.raises(ValueError):
        configure_gc(0)
