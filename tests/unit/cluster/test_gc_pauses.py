"""cluster/gc_pauses: a worker's collections of PAUSE_S or longer are logged; no full ones run while it starts;
its start-up heap is frozen."""

from __future__ import annotations

import gc
import logging
import weakref

import pytest

from rlbridge.cluster import gc_pauses


def test_a_long_collection_is_logged_with_its_generation(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(gc_pauses, "PAUSE_S", 0.0)  # every collection counts as long
    gc_pauses.watch()
    gc_pauses.watch()  # once per process
    try:
        assert gc.callbacks.count(gc_pauses._timed) == 1
        with caplog.at_level(logging.INFO, logger=gc_pauses.__name__):
            gc.collect()
        assert any("python gc: a generation 2 collection took" in r.getMessage() for r in caplog.records)
    finally:
        gc.callbacks.remove(gc_pauses._timed)


def test_the_startup_heap_is_frozen_and_garbage_collected_first() -> None:
    class Cycle:
        def __init__(self) -> None:
            self.me = self

    gone = weakref.ref(Cycle())  # garbage only a collection frees
    assert gone() is not None
    try:
        frozen = gc_pauses.freeze_startup_heap()
        # frozen objects still die by reference count (another thread's temporaries, this frame's): never more
        assert 0 < gc.get_freeze_count() <= frozen
        assert gone() is None  # collected before the freeze, not frozen
    finally:
        gc.unfreeze()


def test_full_collections_are_paused_while_a_worker_starts_and_resume_even_if_it_fails() -> None:
    before = gc.get_threshold()
    with gc_pauses.paused():
        assert gc.get_threshold() == (before[0], before[1], gc_pauses.NO_FULL_COLLECTIONS)
        assert gc.isenabled()  # young collections go on
    assert gc.get_threshold() == before
    with pytest.raises(RuntimeError), gc_pauses.paused():
        raise RuntimeError("the constructor failed")
    assert gc.get_threshold() == before


def test_short_lived_cycles_are_freed_while_paused() -> None:
    class Cycle:
        def __init__(self) -> None:
            self.me = self
            self.payload = bytearray(1 << 10)

    with gc_pauses.paused():
        gone = weakref.ref(Cycle())
        for _ in range(20):  # allocations enough for several young collections
            [[] for _ in range(gc.get_threshold()[0])]
        assert gone() is None


def test_only_a_starting_worker_freezes_its_imports() -> None:
    gc_pauses.freeze_if_starting()
    assert gc.get_freeze_count() == 0
    try:
        with gc_pauses.paused():
            gc_pauses.freeze_if_starting()
            assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
