"""The c10d-store coordinator against a real TCPStore (one process, two "ranks").

Covers: publish/gather across ranks, broadcast/wait_for, poll, first
proposal wins, namespaces isolate attempts, and a missing rank makes a
wait fail within its bound with a clear error; heartbeats: a gather ends
early naming a rank whose counter stopped (and so does a wait for rank 0's
broadcast), never on a slow rank that still beats, a rank never seen beating
or a dead group's last beat.
"""

from __future__ import annotations

import datetime
import threading
import time
import typing

import pytest
import torch.distributed as dist

from cairn.checkpoint import coordinator, errors, liveness


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


# -- heartbeats: a gather ends early on a rank that stopped beating -----------------


def beating(
    store: coordinator.Store, incarnation: str = "group-0", namespace: str = "a0"
) -> list[coordinator.StoreCoordinator]:
    made = pair(store, namespace)
    for coord in made:
        coord.start_heartbeat(incarnation, every=0.05, dead_after=0.5)
    return made


def test_gather_ends_early_naming_a_rank_whose_heartbeat_stopped(store: coordinator.Store) -> None:
    zero, one = beating(store)
    zero.publish("request/0/at", {"step": 3})
    one.close()  # rank 1's process is gone: its counter stops
    with pytest.raises(errors.PeerLostError, match=r"rank 1's heartbeat has not moved"):
        zero.gather("request/0/at", timeout=600)
    zero.close()


def test_wait_for_ends_early_when_the_broadcasters_heartbeat_stopped(
    store: coordinator.Store,
) -> None:
    zero, one = beating(store)
    zero.close()  # rank 0 died before broadcasting its decision
    started = time.monotonic()
    with pytest.raises(errors.PeerLostError, match=r"no report for init: rank 0's heartbeat"):
        one.wait_for("init", timeout=600)
    assert time.monotonic() - started < 60  # 0.5 s presumed dead here, not the 600 s bound
    one.close()


def test_wait_for_waits_for_a_slow_broadcaster_that_still_beats(store: coordinator.Store) -> None:
    zero, one = beating(store)
    late = threading.Timer(2.0, lambda: zero.broadcast("init", {"ok": True}))
    late.start()
    try:
        assert one.wait_for("init", timeout=600) == {"ok": True}
    finally:
        late.join()
        zero.close()
        one.close()


def test_a_slow_rank_that_still_beats_is_waited_for(store: coordinator.Store) -> None:
    zero, one = beating(store)
    zero.publish("w", {"rank": 0})
    # Rank 1 reports well after dead_after (0.5 s), beating all along.
    late = threading.Timer(2.0, lambda: one.publish("w", {"rank": 1}))
    late.start()
    try:
        assert zero.gather("w", timeout=600) == [{"rank": 0}, {"rank": 1}]
    finally:
        late.join()
        zero.close()
        one.close()


def rank_zero_waits_out_its_bound(store: coordinator.Store, incarnation: str) -> None:
    """Rank 0 of `incarnation` (beating) gathers without rank 1: the plain timeout."""
    zero, _ = pair(store)
    zero.start_heartbeat(incarnation, every=0.05, dead_after=0.2)
    zero.publish("w", {})
    with pytest.raises(errors.CoordinationTimeoutError, match="within 2s") as raised:
        zero.gather("w", timeout=2)
    assert not isinstance(raised.value, errors.PeerLostError)
    zero.close()


def test_a_rank_never_seen_beating_gets_the_whole_bound(store: coordinator.Store) -> None:
    rank_zero_waits_out_its_bound(store, "group-0")


def test_a_dead_groups_last_beat_is_not_read(store: coordinator.Store) -> None:
    """Group 0's rank 1 died (its counter frozen); group 1's rank 1 is not up yet."""
    old_zero, old_one = beating(store, "group-0")
    old_one.close()
    old_zero.close()
    rank_zero_waits_out_its_bound(store, "group-1")


def test_a_world_of_one_starts_no_heartbeat(store: coordinator.Store) -> None:
    alone = coordinator.StoreCoordinator(store, rank=0, world_size=1, namespace="solo")
    alone.start_heartbeat("group-0")
    assert not store.check(["solo/alive/group-0/0"])
    alone.close()


def test_peer_watch_counts_silence_from_the_first_unchanged_reading() -> None:
    watch = liveness.PeerWatch(dead_after=10.0)
    watch.observe(1, None, now=0.0)
    assert watch.silent_for(1, now=5.0) is None  # never seen: not presumed dead
    watch.observe(1, "7", now=1.0)
    watch.observe(1, "7", now=9.0)
    assert watch.presumed_dead([1], now=10.9) == []
    assert watch.presumed_dead([1], now=11.0) == [1]
    watch.observe(1, "8", now=12.0)  # it moved: alive again
    assert watch.presumed_dead([1], now=21.0) == []
    assert watch.silent_for(1, now=21.0) == 9.0


@pytest.mark.parametrize(
    ("world", "seconds"),
    [(1, 0.001), (2, 0.001), (50, 0.001), (200, 0.004), (1000, 0.02), (8192, 0.02)],
)
def test_the_first_pause_grows_with_the_ranks_reading_the_store(world: int, seconds: float) -> None:
    assert coordinator.first_poll_seconds(world) == pytest.approx(seconds)


def test_a_wait_rereads_quickly_then_backs_off_to_the_old_pace() -> None:
    pauses = [coordinator.first_poll_seconds(2)]
    while len(pauses) < 8:
        pauses.append(coordinator.next_poll(pauses[-1]))
    assert pauses[:5] == [0.001, 0.002, 0.004, 0.008, 0.016]
    assert pauses[5:] == [coordinator.MAX_POLL_SECONDS] * 3  # 20 ms, as every wait paused before


def test_a_wait_sees_a_late_key_and_reads_the_store_a_bounded_number_of_times(
    store: coordinator.Store,
) -> None:
    """A key that arrives 0.3 s into a wait is seen; the store is read at most
    once per pause (1, 2, 4, 8, 16, then 20 ms), never in a tight loop."""
    zero, one = pair(store)
    reads = []
    real_check = store.check

    def counted(keys: list[str]) -> bool:
        reads.append(keys)
        return real_check(keys)

    one._store = typing.cast(typing.Any, _Checked(store, counted))
    threading.Timer(0.3, lambda: zero.broadcast("late", {"ok": True})).start()
    assert one.wait_for("late", timeout=5) == {"ok": True}
    waits = [keys for keys in reads if keys == [one._key("late")]]
    assert 2 <= len(waits) <= 6 + 0.3 / coordinator.MAX_POLL_SECONDS + 2


class _Checked:
    """A store whose `check` is counted; everything else passes through."""

    def __init__(self, store: coordinator.Store, check: typing.Callable[[list[str]], bool]) -> None:
        self._store, self.check = store, check

    def __getattr__(self, name: str) -> typing.Any:
        return getattr(self._store, name)
