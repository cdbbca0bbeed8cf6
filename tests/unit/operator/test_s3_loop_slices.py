"""s3loop.S3Loop with listings in slices (``core.s3slice``): when the next pass comes.

Covers, with a hand-moved clock and a pass that answers what it is told: a
pass whose listing goes on is due again at once but behind the passes
already due, and counts as a slice, not a pass; the pass that completes the
listing counts once; a listing that reached ``list_max_keys`` puts the next
pass off by the back-off (longer than the interval, growing with the capped
listings in a row); a job deleted mid-listing gets no further slice and a
new job of the same name starts with fresh caches.
"""

import asyncio
import copy
import dataclasses
from typing import Any

from cairn.api import trainingjob
from cairn.operator import reconcile, s3loop, s3observe
from cairn.operator.core import tunables

from .test_s3_loop import KEY, Clock, body

OTHER = ("ml", "other")
SETTINGS = tunables.StorageLoop(
    interval_seconds=30.0,
    initial_delay_seconds=2.0,
    kick_delay_seconds=1.0,
    threads=2,
    list_cap_backoff_seconds=60.0,
    list_cap_backoff_cap_seconds=3600.0,
)


@dataclasses.dataclass
class Answer:
    goes_on: bool = False
    capped: int = 0
    patched_object: dict[str, Any] | None = None


class Scripted:
    """A pass that answers, per job, the next of its scripted answers (then a plain one),
    and takes ``took`` seconds of the clock."""

    def __init__(self, clock: Clock) -> None:
        self.clock, self.took = clock, 0.0
        self.script: dict[s3loop.Key, list[Answer]] = {}
        self.calls: list[s3loop.Key] = []
        self.caches: dict[s3loop.Key, list[s3observe.Caches]] = {}

    async def __call__(
        self,
        key: s3loop.Key,
        raw: dict[str, Any],
        job: trainingjob.TrainingJob,
        caches: s3observe.Caches,
    ) -> Answer:
        self.calls.append(key)
        self.clock.now += self.took
        self.caches.setdefault(key, []).append(caches)
        queue = self.script.get(key) or []
        return queue.pop(0) if queue else Answer()


def make() -> tuple[s3loop.S3Loop, Clock, Scripted]:
    clock = Clock()
    scripted = Scripted(clock)
    loop = s3loop.S3Loop(
        run_pass=scripted, settings=SETTINGS, written=reconcile.Written, monotonic=clock
    )
    return loop, clock, scripted


def run(loop: s3loop.S3Loop) -> list[s3loop.Key]:
    return asyncio.run(loop.run_due())


def named(name: str) -> dict[str, Any]:
    raw = copy.deepcopy(body(phase="Running"))
    raw["metadata"]["name"] = name
    return raw


def test_listing_that_goes_on_is_due_at_once_behind_the_due_passes() -> None:
    loop, clock, scripted = make()
    scripted.script[KEY] = [Answer(goes_on=True), Answer(goes_on=True)]
    scripted.took = 0.5
    loop.update(KEY, named(KEY[1]))
    loop.update(OTHER, named(OTHER[1]))
    clock.now += 2.0
    assert run(loop) == [KEY]  # the store's first pass runs alone (s3fair)
    # The slice ended after the other job fell due: it goes first (one pass per
    # store at a time with two threads), the slice next, without waiting.
    assert run(loop) == [OTHER]
    assert run(loop) == [KEY]


def test_slices_count_apart_from_passes() -> None:
    loop, clock, scripted = make()
    scripted.script[KEY] = [Answer(goes_on=True), Answer(goes_on=True)]
    loop.update(KEY, named(KEY[1]))
    clock.now += 2.0
    for _ in range(3):
        assert run(loop) == [KEY]  # no time passes: each slice is due at once
    assert loop.slices[KEY] == 2 and loop.passes[(KEY, "periodic")] == 1
    assert run(loop) == []  # the completed listing's pass: next one in the interval
    clock.now += 30.0
    assert run(loop) == [KEY]
    assert len({id(c) for c in scripted.caches[KEY]}) == 1  # one job, one slot


def test_capped_listing_backs_off_past_the_interval() -> None:
    loop, clock, scripted = make()
    scripted.script[KEY] = [Answer(capped=1), Answer(capped=2)]
    loop.update(KEY, named(KEY[1]))
    clock.now += 2.0
    assert run(loop) == [KEY]
    clock.now += 44.9  # the first back-off: 60 s less at most a quarter
    assert run(loop) == []
    clock.now += 15.2
    assert run(loop) == [KEY]
    clock.now += 89.9  # the second: 120 s less at most a quarter
    assert run(loop) == []
    clock.now += 30.2
    assert run(loop) == [KEY]
    clock.now += 30.0  # a listing that completed: the interval again
    assert run(loop) == [KEY]


def test_job_deleted_mid_listing_gets_no_further_slice() -> None:
    loop, clock, scripted = make()
    scripted.script[KEY] = [Answer(goes_on=True)] * 5
    loop.update(KEY, named(KEY[1]))
    clock.now += 2.0
    assert run(loop) == [KEY]
    loop.forget(KEY)
    assert run(loop) == [] and not loop.scheduled(KEY)
    loop.update(KEY, named(KEY[1]))  # a new job of the same name
    clock.now += 2.0
    assert run(loop) == [KEY]
    first, second = scripted.caches[KEY]
    assert first is not second
