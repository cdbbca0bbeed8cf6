"""The c10d-store coordinator against a real TCPStore (one process, two "ranks").

Covers: publish/gather across ranks, broadcast/wait_for, poll, first
proposal wins, namespaces isolate attempts, and a missing rank makes a
wait fail within its bound with a clear error.
"""

from __future__ import annotations

import datetime
import time
import typing

import pytest
import torch.distributed as dist

from cairn.checkpoint import coordinator, errors


@pytest.fixture
def store() -> typing.Iterator[coordinator.Store]:
    server: coordinator.Store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, world_size=1, is_master=True, timeout=datetime.timedelta(seconds=10)
    )
    yield server


def pair(store: coordinator.Store, namespace: str = "a0") -> list[coordinator.StoreCoordinator]:
    return [
        coordinator.StoreCoordinator(store, rank=r, world_size=2, namespace=namespace)
        for r in range(2)
    ]


def test_gather_and_broadcast(store: coordinator.Store) -> None:
    zero, one = pair(store)
    zero.publish("w", {"files": [0]})
    one.publish("w", {"files": [1]})
    assert zero.gather("w", timeout=5) == [{"files": [0]}, {"files": [1]}]
    assert one.poll("done") is None
    zero.broadcast("done", {"ok": True})
    assert one.wait_for("done", timeout=5) == {"ok": True}
    assert one.poll("done") == {"ok": True}


def test_first_proposal_wins(store: coordinator.Store) -> None:
    zero, one = pair(store)
    assert one.propose("request/0", {"step": 7}) == {"step": 7}
    assert zero.propose("request/0", {"step": 9}) == {"step": 7}


def test_namespaces_isolate_attempts(store: coordinator.Store) -> None:
    old, _ = pair(store, "attempt-0")
    new, _ = pair(store, "attempt-1")
    old.broadcast("init", {"ok": True})
    assert new.poll("init") is None


def test_missing_rank_times_out_within_bound(store: coordinator.Store) -> None:
    zero, _ = pair(store)
    zero.publish("w", {})
    started = time.monotonic()
    with pytest.raises(errors.CoordinationTimeoutError, match="died or stalled"):
        zero.gather("w", timeout=0.5)
    assert time.monotonic() - started < 3


def test_local_coordinator_is_a_world_of_one() -> None:
    local = coordinator.LocalCoordinator()
    local.publish("w", {"x": 1})
    assert local.gather("w", timeout=1) == [{"x": 1}]
    assert local.propose("r", {"a": 1}) == {"a": 1}
    assert local.propose("r", {"a": 2}) == {"a": 1}
