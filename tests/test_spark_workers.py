"""plait freezes the long-lived objects of Spark's Python workers, and only theirs."""

from __future__ import annotations

import gc
import sys
import types
import weakref

import pytest

from plait.spark import workers


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    monkeypatch.setattr(workers, "_settled", False)
    return workers


def test_a_users_own_process_is_left_alone(fresh: types.ModuleType) -> None:
    assert not workers.in_spark_worker()  # pytest's __main__
    before = gc.get_freeze_count()
    workers.settle()
    assert gc.get_freeze_count() == before


def test_a_spark_worker_is_frozen_once(
    fresh: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    daemon = types.ModuleType("__main__")
    daemon.__spec__ = types.SimpleNamespace(name="pyspark.daemon")  # type: ignore[assignment]
    monkeypatch.setitem(sys.modules, "__main__", daemon)
    assert workers.in_spark_worker()
    try:
        workers.settle()
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # the modules loaded so far
        garbage = _Node()
        garbage.me = garbage  # a cycle made after the freeze: still collected
        gone = weakref.ref(garbage)
        del garbage
        gc.collect()
        assert gone() is None, "a cycle made after the freeze was not collected"
        # Tracked objects a second freeze would take.
        made_since: list[list[object]] = [[] for _ in range(1000)]
        workers.settle()  # once per process
        # Frozen objects that die leave the count, so it may shrink, but never take these.
        assert gc.get_freeze_count() < frozen + len(made_since)
    finally:
        gc.unfreeze()


class _Node:
    """An object that can be in a cycle and be watched by a weak reference."""

    me: object = None
