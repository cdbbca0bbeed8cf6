"""The operator's status writes: one per reconcile at most, none when nothing changed.

Covers: a Running job reconciled again, later, writes no status; a job that
turned CheckpointStale writes once when it turns, then never again while it
stays stale (its message names the time of the last commit, not a live
age); a new commit (the writer's fact) clears it with one write.
"""

from cairn.api import trainingjob
from cairn.operator.core import conditions, jobobserve, jobplan

from . import jobs

COMMITTED_AT = "2026-11-22T12:00:10Z"


def _run(
    job: trainingjob.TrainingJob, t: float, *, pods: bool = True
) -> tuple[jobplan.Plan, trainingjob.TrainingJob]:
    """One reconcile at `t` with attempt 1's two ranks running (or no pods yet)."""
    observed = (jobs.pod(1, 0), jobs.pod(1, 1)) if pods else ()
    result = jobplan.plan(job=job, observed=jobobserve.Observed(pods=observed), now=jobs.at(t))
    return result, jobs.patched(job, result)


def _with_commit(job: trainingjob.TrainingJob, *, step: int, time: str) -> trainingjob.TrainingJob:
    """The writer's report of a commit (its own fields only)."""
    raw = job.model_dump(mode="json", by_alias=True, exclude_none=True)
    raw["status"]["checkpoints"] = {"lastCommitted": {"step": step, "time": time}}
    return trainingjob.TrainingJob.model_validate(raw)


def _running() -> trainingjob.TrainingJob:
    job = jobs.job(checkpoint={"intervalSeconds": 60})
    _, job = _run(job, t=0, pods=False)
    _, job = _run(job, t=1)
    assert job.status.phase == "Running"
    return _with_commit(job, step=10, time=COMMITTED_AT)


def _stale(job: trainingjob.TrainingJob) -> trainingjob.Condition:
    found = conditions.find(job.status.conditions, conditions.CHECKPOINT_STALE)
    assert found is not None
    return found


def test_running_job_reconciled_again_writes_nothing() -> None:
    _, job = _run(_running(), t=20)
    for t in (21, 60, 300):
        result, job = _run(job, t=t)
        assert result.status is None, (t, result.status)


def test_stale_job_writes_once_when_it_turns_then_never_while_stale() -> None:
    _, job = _run(_running(), t=20)
    assert _stale(job).status == "False"
    turned, job = _run(job, t=1000)
    assert turned.status is not None
    flag = _stale(job)
    assert flag.status == "True"
    assert COMMITTED_AT in flag.message and "expected within 420s" in flag.message
    for t in (1001, 1100, 5000, 86400):
        result, job = _run(job, t=t)
        assert result.status is None, (t, result.status)
    assert _stale(job).message == flag.message


def test_new_commit_clears_stale_with_one_write() -> None:
    _, job = _run(_running(), t=1000)
    assert _stale(job).status == "True"
    job = _with_commit(job, step=20, time="2026-11-22T12:16:40Z")
    cleared, job = _run(job, t=1001)
    assert cleared.status is not None
    assert _stale(job).status == "False"
    again, _ = _run(job, t=1002)
    assert again.status is None
