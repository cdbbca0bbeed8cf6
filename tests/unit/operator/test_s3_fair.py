"""core.s3fair and its use in s3loop.S3Loop: one tenant's slow store holds one S3 thread.

Covers, pure: an endpoint's health (unproven before its first pass ends,
healthy after a quick one, slow after a long one or while a pass on it runs
``slow_after`` or longer, even after quick ones); ``slow_slots`` (at least
one, never every thread where there are two or more); ``take``: a healthy
endpoint gets every free thread, an unproven or slow one one pass at a time,
slow and unproven endpoints together at most ``slow_slots``, a held-back
pass does not block a healthy one behind it, no free thread takes nothing.
With the loop (a hand-moved clock, passes that end when the test says):
four jobs of a hung store beside eight healthy ones: a store that never
answered holds one thread, one that hung after answering at most all but
one; every healthy job is passed meanwhile, the hung store's other jobs
wait their turn and run once the hung passes end, and the loop never spins
on held-back passes (its next wake is a future time or a pass ending).
"""

import asyncio
from typing import Any

import pytest

from cairn.api import trainingjob
from cairn.operator import reconcile, s3loop
from cairn.operator.core import s3fair, tunables

from . import jobs

HUNG = "http://10.0.0.9:9000"
GOOD = "http://s3.example:8333"
SLOW_AFTER = 10.0


def running(endpoint: str, started: float) -> s3fair.Running:
    return s3fair.Running(endpoint=endpoint, started=started)


@pytest.mark.parametrize(
    ("ended", "runs", "expected"),
    [
        ({}, [], "unproven"),
        ({GOOD: 0.2}, [], "healthy"),
        ({GOOD: 12.0}, [], "slow"),
        ({GOOD: 0.2}, [running(GOOD, 85.0)], "slow"),  # running 15 s now
        ({GOOD: 0.2}, [running(GOOD, 95.0)], "healthy"),  # running 5 s: not yet
        ({GOOD: 0.2}, [running(HUNG, 0.0)], "healthy"),  # another store's hang
    ],
    ids=["unproven", "quick", "slow-last", "running-long", "running-short", "other-hangs"],
)
def test_health(ended: dict[str, float], runs: list[s3fair.Running], expected: str) -> None:
    got = s3fair.health(GOOD, ended=ended, running=runs, now=100.0, slow_after=SLOW_AFTER)
    assert got == expected


@pytest.mark.parametrize(
    ("threads", "share", "slots"),
    [(1, 0.5, 1), (2, 0.5, 1), (4, 0.5, 2), (4, 1.0, 3), (4, 0.01, 1), (16, 0.25, 4)],
)
def test_slow_slots(threads: int, share: float, slots: int) -> None:
    assert s3fair.slow_slots(threads, share) == slots


def take(
    due: list[tuple[str, str]],
    *,
    ended: dict[str, float],
    runs: list[s3fair.Running] = [],  # noqa: B006 (read only)
    threads: int = 4,
) -> list[str]:
    return s3fair.take(
        due, ended=ended, running=runs, now=100.0, threads=threads, share=0.5, slow_after=SLOW_AFTER
    )


def test_healthy_store_gets_the_free_threads_but_never_every_thread() -> None:
    due = [(f"j{i}", GOOD) for i in range(6)]
    assert take(due, ended={GOOD: 0.1}) == ["j0", "j1", "j2"]
    assert take(due, ended={GOOD: 0.1}, runs=[running(GOOD, 99.0)]) == ["j0", "j1"]
    assert take([*due, ("o", "http://other")], ended={GOOD: 0.1, "http://other": 0.1}) == [
        "j0",
        "j1",
        "j2",
        "o",
    ]
    assert take(due, ended={GOOD: 0.1}, threads=1) == ["j0"]


def test_unproven_store_gets_one_pass_at_a_time() -> None:
    due = [(f"j{i}", GOOD) for i in range(3)]
    assert take(due, ended={}) == ["j0"]
    assert take(due, ended={}, runs=[running(GOOD, 99.0)]) == []


def test_hung_store_holds_one_thread_and_healthy_jobs_behind_it_start() -> None:
    due = [("h1", HUNG), ("h2", HUNG), ("g1", GOOD), ("g2", GOOD), ("g3", GOOD)]
    runs = [running(HUNG, 50.0)]  # in its call for 50 s
    assert take(due, ended={GOOD: 0.1}, runs=runs) == ["g1", "g2", "g3"]


def test_slow_stores_together_hold_at_most_their_share() -> None:
    due = [("a", "http://a"), ("b", "http://b"), ("c", "http://c"), ("g", GOOD)]
    ended = {"http://a": 30.0, "http://b": 30.0, "http://c": 30.0, GOOD: 0.1}
    assert take(due, ended=ended) == ["a", "b", "g"]  # slow_slots(4, 0.5) == 2
    runs = [running("http://a", 60.0), running("http://b", 60.0)]
    assert take(due, ended=ended, runs=runs) == ["g"]


def test_no_free_thread_takes_nothing() -> None:
    runs = [running(GOOD, 99.0)] * 4
    assert take([("g", GOOD)], ended={GOOD: 0.1}, runs=runs) == []


# --- with the loop ---------------------------------------------------------

SETTINGS = tunables.StorageLoop(
    interval_seconds=30.0,
    initial_delay_seconds=2.0,
    kick_delay_seconds=1.0,
    threads=4,
    slow_after_seconds=SLOW_AFTER,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Gated:
    """A pass that returns when the test releases its endpoint's gate."""

    def __init__(self) -> None:
        self.gates: dict[str, asyncio.Event] = {}
        self.started: list[str] = []

    async def __call__(
        self, key: s3loop.Key, raw: dict[str, Any], job: trainingjob.TrainingJob, _: Any
    ) -> None:
        del raw, _
        self.started.append(key[1])
        upload = job.spec.checkpoint.upload
        endpoint = upload.endpoint if upload is not None else ""
        gate = self.gates.get(endpoint or "")
        if gate is not None:
            await gate.wait()


def job(name: str, endpoint: str) -> dict[str, Any]:
    upload = {"uri": f"s3://bucket/{name}", "endpoint": endpoint}
    raw = jobs.body(checkpoint={"intervalSteps": 10, "upload": upload})
    raw["metadata"]["name"] = name
    raw["metadata"]["uid"] = f"uid-{name}"
    raw["status"] = {"phase": "Running"}
    return raw


async def _hung_store_beside_healthy_ones(*, proven: bool) -> list[str]:
    """Four jobs of a store that never answers beside eight of a healthy store;
    ``proven``: the hung store answered one pass before it hung. The hung jobs
    whose passes started before the store showed slow."""
    clock, passes = Clock(), Gated()
    loop = s3loop.S3Loop(
        run_pass=passes, settings=SETTINGS, written=reconcile.Written, monotonic=clock
    )
    passes.gates[HUNG] = asyncio.Event()
    # Both stores proven: the hung one answered quickly once, before it hung.
    loop.update(("ml", "proof-g"), job("proof-g", GOOD))
    if proven:
        loop.update(("ml", "proof-h"), job("proof-h", HUNG))
    passes.gates[HUNG].set()
    clock.now += 2.0
    await loop.run_due()
    passes.gates[HUNG] = asyncio.Event()  # from now on the hung store never answers
    for name in ("h1", "h2", "h3", "h4"):
        loop.update(("ml", name), job(name, HUNG))
    for i in range(8):
        loop.update(("ml", f"g{i}"), job(f"g{i}", GOOD))
    clock.now += 2.0
    task = asyncio.create_task(loop.run())
    await asyncio.sleep(0.05)
    # The healthy store is proven: its first due passes ran with the hung ones' first.
    clock.now += SLOW_AFTER  # the hung pass is now visibly slow
    loop._wake.set()  # as a pass ending would
    await asyncio.sleep(0.05)
    hung_started = [n for n in passes.started if n.startswith("h")]
    good_started = sorted(n for n in passes.started if n.startswith("g"))
    assert good_started == [f"g{i}" for i in range(8)], passes.started
    wake = loop._next_wake()
    assert wake is None or wake > 0  # held-back passes never make the loop spin
    passes.gates[HUNG].set()  # the store answers (or its calls time out)
    await asyncio.sleep(0.05)
    task.cancel()
    assert {"h1", "h2", "h3", "h4"} <= set(passes.started), passes.started
    return hung_started


def test_store_that_never_answered_holds_one_thread() -> None:
    assert asyncio.run(_hung_store_beside_healthy_ones(proven=False)) == ["h1"]


def test_store_that_hangs_after_answering_never_holds_every_thread() -> None:
    hung = asyncio.run(_hung_store_beside_healthy_ones(proven=True))
    assert 1 <= len(hung) <= SETTINGS.threads - 1
