"""s3plan.pass_wanted and s3loop.S3Loop: when each job's S3 pass runs.

Covers, with a hand-moved clock and a pass that only records its calls:
a live job with ``upload`` is passed ``initial_delay_seconds`` after it is
first seen and then every ``interval_seconds``; a newly reported
``lastUploaded`` step brings the pass forward to ``kick_delay_seconds``; a
job that finished gets exactly one final pass, then leaves the schedule
(events of the same generation, kicks, time passing bring none), and a spec
change (new generation) brings one more; a job created finished gets its one
pass; a deleted job is forgotten mid-schedule; a job without upload, managed
by another controller, being deleted or with an invalid spec is never
scheduled; at most ``threads`` passes run at once; a failing pass keeps the
job scheduled; the pass plans from the body its own status patch returned.
"""

import asyncio
import copy
from typing import Any

import pytest

from cairn.api import trainingjob
from cairn.operator import reconcile, s3loop, s3observe
from cairn.operator.core import jobobserve, s3plan, tunables

from . import jobs

KEY = ("ml", "demo")
UPLOAD = {"upload": {"uri": "s3://bucket/runs/demo", "endpoint": "http://127.0.0.1:1"}}
SETTINGS = tunables.StorageLoop(
    interval_seconds=30.0, initial_delay_seconds=2.0, kick_delay_seconds=1.0, threads=2
)


def body(
    *, phase: str | None = None, generation: int = 1, uploaded: int | None = None, **spec: Any
) -> dict[str, Any]:
    raw = jobs.body(checkpoint={"intervalSteps": 10, **UPLOAD}, **spec)
    raw["metadata"]["generation"] = generation
    status: dict[str, Any] = {}
    if phase is not None:
        status["phase"] = phase
    if uploaded is not None:
        status["checkpoints"] = {"lastUploaded": {"step": uploaded}}
    if status:
        raw["status"] = status
    return raw


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Recorder:
    """A pass that records which bodies it was given; fails when told to."""

    def __init__(self) -> None:
        self.calls: list[tuple[s3loop.Key, dict[str, Any]]] = []
        self.fail = False
        self.returns: dict[str, Any] | None = None

    async def __call__(
        self,
        key: s3loop.Key,
        raw: dict[str, Any],
        job: trainingjob.TrainingJob,
        caches: s3observe.Caches,
    ) -> Any:
        self.calls.append((key, raw))
        if self.fail:
            raise RuntimeError("store down")
        return _Result(self.returns)


class _Result:
    def __init__(self, patched: dict[str, Any] | None) -> None:
        self.patched_object = patched


def make() -> tuple[s3loop.S3Loop, Clock, Recorder]:
    clock, recorder = Clock(), Recorder()
    loop = s3loop.S3Loop(
        run_pass=recorder, settings=SETTINGS, written=reconcile.Written, monotonic=clock
    )
    return loop, clock, recorder


def run(loop: s3loop.S3Loop) -> list[s3loop.Key]:
    return asyncio.run(loop.run_due())


def test_live_job_initial_delay_then_interval() -> None:
    loop, clock, recorder = make()
    loop.update(KEY, body(phase="Running"))
    assert run(loop) == []
    clock.now += 2.0
    assert run(loop) == [KEY]
    clock.now += 29.0
    assert run(loop) == []
    clock.now += 1.0
    assert run(loop) == [KEY]
    assert loop.passes[(KEY, "periodic")] == 2 and loop.scheduled(KEY)
    assert len(recorder.calls) == 2


def test_new_upload_brings_the_pass_forward() -> None:
    loop, clock, _ = make()
    loop.update(KEY, body(phase="Running", uploaded=10))
    clock.now += 2.0
    run(loop)
    loop.update(KEY, body(phase="Running", uploaded=10))  # same step: no kick
    clock.now += 1.0
    assert run(loop) == []
    loop.update(KEY, body(phase="Running", uploaded=20))
    clock.now += 1.0
    assert run(loop) == [KEY]


def test_finished_job_gets_exactly_one_final_pass_until_its_spec_changes() -> None:
    loop, clock, _ = make()
    loop.update(KEY, body(phase="Running"))
    clock.now += 2.0
    run(loop)
    loop.update(KEY, body(phase="Succeeded"))
    clock.now += 1.0
    assert run(loop) == [KEY]
    assert loop.passes[(KEY, "final")] == 1
    assert not loop.scheduled(KEY)
    # Later events of the same generation (a kick included) and time bring nothing.
    loop.update(KEY, body(phase="Succeeded", uploaded=30))
    loop.update(KEY, body(phase="Succeeded"))
    clock.now += 3600.0
    assert run(loop) == [] and not loop.scheduled(KEY)
    # A spec change: one more final pass, then none.
    loop.update(KEY, body(phase="Succeeded", generation=2))
    clock.now += 2.0
    assert run(loop) == [KEY]
    clock.now += 3600.0
    assert run(loop) == []
    assert loop.passes[(KEY, "final")] == 2 and loop.passes[(KEY, "periodic")] == 1


def test_job_first_seen_finished_gets_its_pass() -> None:
    loop, clock, _ = make()
    loop.update(KEY, body(phase="Failed"))
    clock.now += 2.0
    assert run(loop) == [KEY]
    assert loop.passes[(KEY, "final")] == 1 and not loop.scheduled(KEY)


def test_deleted_job_is_forgotten() -> None:
    loop, clock, recorder = make()
    loop.update(KEY, body(phase="Running"))
    loop.forget(KEY)
    clock.now += 60.0
    assert run(loop) == [] and recorder.calls == []
    # A new job of the same name (another uid) starts afresh.
    loop.update(KEY, body(phase="Succeeded"))
    clock.now += 2.0
    assert run(loop) == [KEY]


@pytest.mark.parametrize(
    "raw",
    [
        jobs.body(checkpoint={"intervalSteps": 10}),
        body(managedBy="kueue.x-k8s.io/multikueue"),
        {**body(), "metadata": {**body()["metadata"], "deletionTimestamp": "2026-11-22T12:00:00Z"}},
        {**body(), "spec": {**body()["spec"], "nodes": "many"}},
    ],
    ids=["no-upload", "other-controller", "being-deleted", "invalid-spec"],
)
def test_jobs_never_scheduled(raw: dict[str, Any]) -> None:
    loop, clock, recorder = make()
    loop.update(KEY, raw)
    clock.now += 3600.0
    assert run(loop) == [] and recorder.calls == [] and not loop.scheduled(KEY)


def test_no_more_passes_at_once_than_threads() -> None:
    loop, clock, _ = make()
    for i in range(6):  # two stores: one store never takes every thread (s3fair)
        raw = copy.deepcopy(body(phase="Running"))
        raw["metadata"]["name"] = f"job-{i}"
        raw["spec"]["checkpoint"]["upload"]["endpoint"] = f"http://127.0.0.1:{1 + i % 2}"
        loop.update(("ml", f"job-{i}"), raw)
    clock.now += 2.0
    assert len(run(loop)) == 1  # each store's first pass runs alone and proves it
    clock.now += 2.0
    assert len(run(loop)) == 2  # the other store's first pass, one of the proven store
    clock.now += 30.0
    assert len(loop.due_now()) == SETTINGS.threads


def test_failing_pass_keeps_the_job_scheduled() -> None:
    loop, clock, recorder = make()
    recorder.fail = True
    loop.update(KEY, body(phase="Running"))
    clock.now += 2.0
    assert run(loop) == [KEY]
    assert loop.passes[(KEY, "periodic")] == 0 and loop.scheduled(KEY)
    recorder.fail = False
    clock.now += 30.0
    assert run(loop) == [KEY]


def test_next_pass_plans_from_its_own_patch_while_the_watch_lags() -> None:
    loop, clock, recorder = make()
    raw = body(phase="Running")
    raw["metadata"]["resourceVersion"] = "10"
    patched = copy.deepcopy(raw)
    patched["metadata"]["resourceVersion"] = "12"
    patched["status"]["storage"] = {"verifiedStep": 30}
    recorder.returns = patched
    loop.update(KEY, raw)
    clock.now += 2.0
    run(loop)
    clock.now += 30.0
    run(loop)
    assert recorder.calls[-1][1]["status"]["storage"] == {"verifiedStep": 30}


@pytest.mark.parametrize(
    ("phase", "final_done", "expected"),
    [
        ("Running", None, "periodic"),
        ("Suspended", None, "periodic"),
        (None, None, "periodic"),
        ("Succeeded", None, "final"),
        ("Failed", 1, None),
        ("Failed", 0, "final"),
    ],
)
def test_pass_wanted(phase: str | None, final_done: int | None, expected: str | None) -> None:
    job = jobobserve.parse_job(body(phase=phase))
    assert isinstance(job, trainingjob.TrainingJob)
    assert s3plan.pass_wanted(job, final_done=final_done) == expected
