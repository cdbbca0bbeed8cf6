"""core.s3fair and s3loop: one tenant's slow *prefix* on a shared store is the job's, not the store's.

Found by ``bench/tenant_scale.py`` (a prefix of 100,000 objects listed up to
``list_max_keys`` beside 200 healthy jobs on the same store): a pass running
``slow_after`` marked its whole store slow, and while it ran no other job's
pass on that store started. Covers, pure: ``health`` and ``store_is_slow``
with ``answered`` (a quick pass on the store ended after the long one
started: the store answers); ``take`` keeps starting healthy jobs beside
such a pass. With the loop (a hand-moved clock, a pass per job that ends
when the test says): healthy jobs on the store keep being passed while the
tenant's pass runs past ``slow_after``; once it ends, the job (not the
store) is slow, and its next pass runs as a slow unit of its own.
"""

import asyncio
from typing import Any

import pytest

from cairn.api import trainingjob
from cairn.operator import reconcile, s3loop
from cairn.operator.core import s3fair

from .test_s3_fair import GOOD, HUNG, SETTINGS, SLOW_AFTER, Clock, job, running


@pytest.mark.parametrize(
    ("answered", "expected"),
    [({}, "slow"), ({GOOD: 80.0}, "slow"), ({GOOD: 90.0}, "healthy"), ({HUNG: 90.0}, "slow")],
    ids=["never-answered", "answered-before-it", "answered-since", "another-store-answered"],
)
def test_long_pass_is_the_stores_only_if_the_store_answered_nothing_since(
    answered: dict[str, float], expected: str
) -> None:
    runs = [running(GOOD, 85.0)]  # running 15 s at now=100
    got = s3fair.health(
        GOOD, ended={GOOD: 0.2}, running=runs, now=100.0, slow_after=SLOW_AFTER, answered=answered
    )
    assert got == expected


@pytest.mark.parametrize(
    ("took", "answered", "slow"),
    [(12.0, {}, True), (12.0, {GOOD: 70.0}, True), (12.0, {GOOD: 90.0}, False), (5.0, {}, False)],
    ids=["never-answered", "answered-before", "answered-meanwhile", "quick"],
)
def test_store_is_slow(took: float, answered: dict[str, float], slow: bool) -> None:
    got = s3fair.store_is_slow(
        started=80.0, took=took, answered=answered, endpoint=GOOD, slow_after=SLOW_AFTER
    )
    assert got is slow


def test_healthy_jobs_start_beside_a_long_pass_on_a_store_that_answers() -> None:
    due = [(f"g{i}", GOOD) for i in range(4)]
    runs = [running(GOOD, 85.0)]
    got = s3fair.take(
        due,
        ended={GOOD: 0.1},
        running=runs,
        now=100.0,
        threads=4,
        share=0.5,
        slow_after=SLOW_AFTER,
        answered={GOOD: 99.0},
    )
    assert got == ["g0", "g1"]  # all but one thread for the store, the long pass holds one
    unanswered = s3fair.take(
        due, ended={GOOD: 0.1}, running=runs, now=100.0, threads=4, share=0.5, slow_after=10.0
    )
    assert unanswered == []  # a store that answered nothing since: slow, one pass at a time


class ByName:
    """A pass that returns when the test releases the job's gate (others at once)."""

    def __init__(self) -> None:
        self.gates: dict[str, asyncio.Event] = {}
        self.started: list[str] = []

    async def __call__(
        self, key: s3loop.Key, raw: dict[str, Any], job: trainingjob.TrainingJob, _: Any
    ) -> None:
        del raw, job, _
        self.started.append(key[1])
        gate = self.gates.get(key[1])
        if gate is not None:
            await gate.wait()


async def _big_prefix_beside_healthy_jobs() -> tuple[list[str], s3loop.S3Loop, ByName]:
    clock, passes = Clock(), ByName()
    loop = s3loop.S3Loop(
        run_pass=passes, settings=SETTINGS, written=reconcile.Written, monotonic=clock
    )
    passes.gates["flood"] = asyncio.Event()
    loop.update(("ml", "proof"), job("proof", GOOD))
    clock.now += 2.0
    await loop.run_due()  # the shared store answered once: proven healthy
    loop.update(("ml", "flood"), job("flood", GOOD))
    clock.now += 2.0
    task = asyncio.create_task(loop.run())
    await asyncio.sleep(0.05)  # the tenant's pass started; it lists for a long time
    late: list[str] = []
    for batch in range(2):  # healthy jobs before and after it runs slow_after
        names = [f"g{batch}-{i}" for i in range(4)]
        for name in names:
            loop.update(("ml", name), job(name, GOOD))
        clock.now += SETTINGS.initial_delay_seconds + (SLOW_AFTER if batch else 1.0)
        loop._wake.set()  # as a pass ending would
        await asyncio.sleep(0.05)
        late = [n for n in names if n not in passes.started]
    passes.gates["flood"].set()  # the listing ends (at the cap), long after slow_after
    await asyncio.sleep(0.05)
    task.cancel()
    return late, loop, passes


def test_tenants_long_pass_neither_blocks_nor_slows_the_shared_store() -> None:
    late, loop, passes = asyncio.run(_big_prefix_beside_healthy_jobs())
    assert late == [], passes.started  # the second batch started while it ran past slow_after
    # The job is slow, not the store (internals: what the next take is fed).
    assert loop._ended[GOOD] < SLOW_AFTER
    flood = loop._jobs[("ml", "flood")]
    assert loop._unit(("ml", "flood"), flood) == s3fair.job_unit(GOOD, "ml/flood")
    assert loop._ended[s3fair.job_unit(GOOD, "ml/flood")] >= SLOW_AFTER
    loop.forget(("ml", "flood"))  # forgotten: no memory of its slowness is kept
    assert s3fair.job_unit(GOOD, "ml/flood") not in loop._ended
