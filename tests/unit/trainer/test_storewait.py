"""`cairn.trainer.storewait`: which processes wait for rank 0's store, and the
bounded poll (a fake connect and clock: no socket, no sleep)."""

from __future__ import annotations

import pytest

from cairn.trainer import storewait

BASE = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "job-a1-n0.job", "MASTER_PORT": "29501"}


def test_a_rank_other_than_zero_waits_for_the_masters_store() -> None:
    assert storewait.master_to_wait_for(BASE) == storewait.Master("job-a1-n0.job", 29501)


@pytest.mark.parametrize(
    "change",
    [
        {"RANK": "0"},  # rank 0 starts the store
        {"WORLD_SIZE": "1"},
        {"RANK": ""},
        {"RANK": "one"},
        {"MASTER_ADDR": ""},
        {"MASTER_PORT": "0"},
        {"MASTER_PORT": "65536"},
        {"MASTER_PORT": "port"},
        {"TORCHELASTIC_USE_AGENT_STORE": "True"},  # the agent's store already listens
    ],
)
def test_nothing_to_wait_for(change: dict[str, str]) -> None:
    assert storewait.master_to_wait_for({**BASE, **change}) is None
    assert storewait.wait_for_master_store({**BASE, **change}) is None


def test_missing_variables_wait_for_nothing() -> None:
    assert storewait.master_to_wait_for({}) is None
    env = {k: v for k, v in BASE.items() if k != "MASTER_PORT"}
    assert storewait.master_to_wait_for(env) is None


class _Fake:
    """A clock that advances only when slept on, and a store that starts listening at `opens_at`."""

    def __init__(self, opens_at: float) -> None:
        self.now = 0.0
        self.opens_at = opens_at
        self.tries: list[tuple[float, float]] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def connect(self, master: storewait.Master, timeout: float) -> None:
        self.tries.append((self.now, timeout))
        if self.now < self.opens_at:
            raise ConnectionRefusedError(111, "Connection refused")


def _wait(fake: _Fake, **bounds: float) -> bool | None:
    return storewait.wait_for_master_store(
        BASE, connect=fake.connect, clock=fake.clock, sleep=fake.sleep, **bounds
    )


def test_polls_every_interval_until_the_store_listens() -> None:
    fake = _Fake(opens_at=0.05)
    got = _wait(fake, poll_seconds=0.01)
    assert got is True
    assert len(fake.tries) == 6  # 0.00 .. 0.05
    assert fake.now == pytest.approx(0.05)
    assert all(timeout == storewait.CONNECT_TIMEOUT_SECONDS for _, timeout in fake.tries)


def test_gives_up_at_the_deadline_and_leaves_it_to_torch(caplog: pytest.LogCaptureFixture) -> None:
    fake = _Fake(opens_at=float("inf"))
    got = _wait(fake, deadline_seconds=0.5, poll_seconds=0.1)
    assert got is False
    assert fake.now < 0.5 + 1e-9
    assert 4 <= len(fake.tries) <= 6
    assert "torch's own connect takes over" in caplog.text


def test_one_connect_never_outlasts_the_deadline() -> None:
    fake = _Fake(opens_at=float("inf"))
    _wait(fake, deadline_seconds=0.25, poll_seconds=0.1)
    assert all(timeout <= 0.25 + 1e-9 for _, timeout in fake.tries)
    assert fake.tries[-1][1] == pytest.approx(0.05)


def test_a_name_that_does_not_resolve_yet_is_retried() -> None:
    calls = []

    def connect(master: storewait.Master, timeout: float) -> None:
        calls.append(master)
        if len(calls) < 3:
            raise OSError(-3, "Temporary failure in name resolution")

    fake = _Fake(opens_at=0)
    got = storewait.wait_for_master_store(
        BASE, poll_seconds=0.01, connect=connect, clock=fake.clock, sleep=fake.sleep
    )
    assert got is True and len(calls) == 3
