"""plan() through the lifecycle, one reconcile at a time with an injected clock.

Covers: first attempt (children, pods, status, event); Starting -> Running;
a failed rank fails the gang (teardown, backoff, next attempt resumes from
the newest commit); preemptions (DisruptionTarget, lost node, vanished or
externally deleted pod) are not counted; non-retryable exit codes and
maxRestarts fail the job with the code in the message; activeDeadlineSeconds;
suspend -> Suspending -> Suspended -> resume; success and terminal
idempotence; semantic errors become a Failed condition; other controllers'
jobs are left alone; a failure is counted once however often plan() runs.
"""

from typing import Any

import pytest

from cairn.api import trainingjob
from cairn.operator.core import conditions, jobobserve, jobplan, restartpolicy

from . import jobs


def _run(
    job: trainingjob.TrainingJob,
    *pods: jobobserve.ObservedPod,
    t: float = 0,
) -> tuple[jobplan.Plan, trainingjob.TrainingJob]:
    result = jobplan.plan(
        job=job,
        observed=jobobserve.Observed(pods=pods),
        now=jobs.at(t),
    )
    return result, jobs.patched(job, result)


def _cond(job: trainingjob.TrainingJob, kind: str) -> trainingjob.Condition:
    found = conditions.find(job.status.conditions, kind)
    assert found is not None, kind
    return found


def _running(**spec: Any) -> trainingjob.TrainingJob:
    """A job whose attempt 1 has both ranks running (at t=1)."""
    _, job = _run(jobs.job(**spec))
    _, job = _run(job, jobs.pod(1, 0), jobs.pod(1, 1), t=1)
    assert job.status.phase == "Running"
    return job


def test_first_reconcile_starts_attempt_one() -> None:
    result, job = _run(jobs.job())
    kinds = [(c["kind"], c["metadata"]["name"]) for c in result.creates]
    assert kinds == [
        ("ServiceAccount", "demo-trainer"),
        ("Role", "demo-status-writer"),
        ("RoleBinding", "demo-status-writer"),
        ("Service", "demo"),
        ("Secret", "demo-manifest-key"),
        ("NetworkPolicy", "demo-ingress"),
        ("Pod", "demo-a1-n0"),
        ("Pod", "demo-a1-n1"),
    ]
    assert result.deletes == ()
    assert result.status is not None
    assert (job.status.phase, job.status.attempt, job.status.restarts) == ("Starting", 1, 0)
    assert job.status.start_time == jobs.T0
    assert job.status.observed_generation == 1
    assert [(e.type, e.reason) for e in result.events] == [("Normal", "AttemptStarted")]
    assert _cond(job, conditions.RECONCILING).status == "True"
    assert _cond(job, conditions.READY).status == "False"


def test_starting_recreates_missing_ranks_only() -> None:
    _, job = _run(jobs.job())
    result, job = _run(job, jobs.pod(1, 0, "Pending"), t=1)
    assert [c["metadata"]["name"] for c in result.creates if c["kind"] == "Pod"] == ["demo-a1-n1"]
    assert job.status.phase == "Starting"
    assert job.status.attempt == 1


def test_all_ranks_running_is_running_and_ready() -> None:
    job = _running()
    ready = _cond(job, conditions.READY)
    assert (ready.status, ready.reason) == ("True", conditions.REASON_RUNNING)
    assert _cond(job, conditions.RECONCILING).status == "False"
    result, _ = _run(job, jobs.pod(1, 0), jobs.pod(1, 1), t=2)
    assert result.status is None and result.events == () and result.creates == ()


def test_failed_rank_fails_the_gang_then_backoff_then_next_attempt() -> None:
    job = _running(restartPolicy={"backoffSeconds": 10, "maxBackoffSeconds": 100})
    failed = jobs.pod(1, 1, "Failed", exit_code=137, termination_reason="OOMKilled")
    result, job = _run(job, jobs.pod(1, 0), failed, t=100)
    assert job.status.phase == "Restarting"
    assert (job.status.restarts, job.status.restarts_count_towards_max) == (1, 1)
    assert [d.name for d in result.deletes] == ["demo-a1-n0"]
    assert result.deletes[0].uid == "pod-1-0"
    assert result.events[0].type == "Warning"
    assert "rank 1 exited with code 137 (OOMKilled)" in result.events[0].message
    assert job.status.last_failure is not None and job.status.last_failure.exit_code == 137
    assert result.requeue_after == 10

    # Same observation again: nothing is counted twice, the deleting pod is left alone.
    result, job = _run(job, jobs.pod(1, 0, deleting=True), failed, t=101)
    assert (job.status.restarts, job.status.restarts_count_towards_max) == (1, 1)
    assert result.deletes == () and result.creates == ()

    # Pods gone but backoff not over.
    result, job = _run(job, failed, t=105)
    assert job.status.phase == "Restarting" and result.creates == ()
    assert result.requeue_after == pytest.approx(5)

    # Backoff over: attempt 2 resumes from the newest committed step.
    raw = job.model_dump(mode="json", by_alias=True, exclude_none=True)
    raw["status"]["checkpoints"] = {"lastCommitted": {"step": 40, "time": "2026-11-22T12:01:00Z"}}
    job = trainingjob.TrainingJob.model_validate(raw)
    result, job = _run(job, failed, t=111)
    assert job.status.phase == "Starting" and job.status.attempt == 2
    pods = [c for c in result.creates if c["kind"] == "Pod"]
    assert [p["metadata"]["name"] for p in pods] == ["demo-a2-n0", "demo-a2-n1"]
    env = {e["name"]: e.get("value") for e in pods[0]["spec"]["containers"][0]["env"]}
    assert env["CAIRN_RESUME_FROM"] == "latest"
    assert env["CAIRN_ATTEMPT"] == "2"
    assert job.status.attempt_start_time == jobs.at(111)


@pytest.mark.parametrize(
    ("pods", "why"),
    [
        (
            (
                jobs.pod(1, 0),
                jobs.pod(1, 1, "Failed", exit_code=143, disruption_reason="EvictionByEvictionAPI"),
            ),
            "EvictionByEvictionAPI",
        ),
        # Node loss as Kubernetes reports it: the taint manager evicts from an
        # unreachable node, PodGC removes pods of a deleted Node, both marking
        # the pod DisruptionTarget first.
        (
            (jobs.pod(1, 0), jobs.pod(1, 1, deleting=True, disruption_reason="DeletionByPodGC")),
            "DeletionByPodGC",
        ),
        (
            (
                jobs.pod(1, 0),
                jobs.pod(1, 1, deleting=True, disruption_reason="DeletionByTaintManager"),
            ),
            "DeletionByTaintManager",
        ),
        ((jobs.pod(1, 0),), "pod disappeared"),
        ((jobs.pod(1, 0), jobs.pod(1, 1, deleting=True)), "pod deleted"),
        ((jobs.pod(1, 0), jobs.pod(1, 1, "Unknown")), "pod phase Unknown"),
    ],
    ids=[
        "evicted",
        "node-deleted",
        "node-unreachable",
        "vanished",
        "deleted-by-someone",
        "unknown",
    ],
)
def test_preemptions_are_not_counted(pods: tuple[jobobserve.ObservedPod, ...], why: str) -> None:
    job = _running(restartPolicy={"maxRestarts": 0})
    result, job = _run(job, *pods, t=50)
    assert job.status.phase == "Restarting"
    assert (job.status.restarts, job.status.restarts_count_towards_max) == (1, 0)
    assert result.events[0].reason == conditions.REASON_PREEMPTED
    assert why in result.events[0].message
    assert job.status.last_failure is not None and job.status.last_failure.counted is False


def test_root_cause_is_the_earliest_failure() -> None:
    job = _running()
    first = jobs.pod(1, 1, "Failed", exit_code=2, finished_at=jobs.at(10))
    later = jobs.pod(1, 0, "Failed", exit_code=1, finished_at=jobs.at(12))
    _result, job = _run(job, later, first, t=20)
    assert job.status.last_failure is not None
    assert (job.status.last_failure.rank, job.status.last_failure.exit_code) == (1, 2)


def test_non_retryable_exit_code_fails_at_once() -> None:
    job = _running(restartPolicy={"retryableExitCodes": [137, 143]})
    result, job = _run(job, jobs.pod(1, 0), jobs.pod(1, 1, "Failed", exit_code=2), t=30)
    assert job.status.phase == "Failed"
    failed = _cond(job, conditions.FAILED)
    assert (failed.status, failed.reason) == ("True", conditions.REASON_NON_RETRYABLE)
    assert "code 2" in failed.message
    assert _cond(job, conditions.STALLED).status == "True"
    assert [d.name for d in result.deletes] == ["demo-a1-n0"]
    assert job.status.completion_time == jobs.at(30)


def test_max_restarts_exceeded() -> None:
    job = _running(restartPolicy={"maxRestarts": 1, "backoffSeconds": 0})
    _, job = _run(job, jobs.pod(1, 0), jobs.pod(1, 1, "Failed", exit_code=1), t=10)
    _, job = _run(job, jobs.pod(1, 1, "Failed", exit_code=1), t=11)
    assert job.status.attempt == 2
    _, job = _run(job, jobs.pod(2, 0), jobs.pod(2, 1), t=12)
    _result, job = _run(job, jobs.pod(2, 0, "Failed", exit_code=1), jobs.pod(2, 1), t=13)
    assert job.status.phase == "Failed"
    assert _cond(job, conditions.FAILED).reason == conditions.REASON_MAX_RESTARTS
    assert job.status.restarts_count_towards_max == 2


def test_backoff_is_exponential_and_capped() -> None:
    policy = trainingjob.RestartPolicy(backoff_seconds=10, max_backoff_seconds=35)
    assert [restartpolicy.backoff_seconds(policy, restarts=r) for r in (1, 2, 3, 4)] == [
        10,
        20,
        35,
        35,
    ]


def test_active_deadline() -> None:
    job = _running(activeDeadlineSeconds=60)
    result, _ = _run(job, jobs.pod(1, 0), jobs.pod(1, 1), t=30)
    assert result.requeue_after == pytest.approx(30)
    result, job = _run(job, jobs.pod(1, 0), jobs.pod(1, 1), t=61)
    assert job.status.phase == "Failed"
    assert _cond(job, conditions.FAILED).reason == conditions.REASON_DEADLINE
    assert len(result.deletes) == 2


def _edit(job: trainingjob.TrainingJob, **spec: Any) -> trainingjob.TrainingJob:
    raw = job.model_dump(mode="json", by_alias=True, exclude_none=True)
    raw["spec"].update(spec)
    raw["metadata"]["generation"] += 1
    return trainingjob.TrainingJob.model_validate(raw)


def test_suspend_and_resume() -> None:
    job = _edit(_running(), suspend=True)
    result, job = _run(job, jobs.pod(1, 0), jobs.pod(1, 1), t=10)
    assert job.status.phase == "Suspending"
    assert sorted(d.name for d in result.deletes) == ["demo-a1-n0", "demo-a1-n1"]
    assert job.status.observed_generation == 2

    result, job = _run(job, jobs.pod(1, 0, deleting=True), t=11)
    assert job.status.phase == "Suspending" and result.deletes == ()

    result, job = _run(job, t=12)
    assert job.status.phase == "Suspended"
    assert _cond(job, conditions.SUSPENDED).status == "True"
    assert _cond(job, conditions.RECONCILING).status == "False"
    assert job.status.start_time is None

    job = _edit(job, suspend=False, nodes=3)
    result, job = _run(job, t=20)
    assert job.status.phase == "Starting" and job.status.attempt == 2
    assert [e.reason for e in result.events] == [conditions.REASON_RESUMED]
    assert len([c for c in result.creates if c["kind"] == "Pod"]) == 3
    assert job.status.restarts == 0


def test_created_suspended_never_starts() -> None:
    result, job = _run(jobs.job(suspend=True))
    assert job.status.phase == "Suspended" and result.creates == ()
    assert job.status.attempt == 0


def test_success_and_terminal_idempotence() -> None:
    job = _running()
    done = (jobs.pod(1, 0, "Succeeded", exit_code=0), jobs.pod(1, 1, "Succeeded", exit_code=0))
    result, job = _run(job, *done, t=40)
    assert job.status.phase == "Succeeded"
    assert job.status.completion_time == jobs.at(40)
    assert _cond(job, conditions.COMPLETE).status == "True"
    assert result.deletes == ()  # cleanup.finishedPods: Keep
    result, job = _run(job, *done, t=50)
    assert result.empty


def test_success_with_cleanup_delete() -> None:
    job = _running(cleanup={"finishedPods": "Delete"})
    done = (jobs.pod(1, 0, "Succeeded", exit_code=0), jobs.pod(1, 1, "Succeeded", exit_code=0))
    result, job = _run(job, *done, t=40)
    assert sorted(d.name for d in result.deletes) == ["demo-a1-n0", "demo-a1-n1"]


def test_semantic_error_is_a_failed_condition_not_a_crash() -> None:
    raw = jobs.body()
    raw["spec"]["checkpoint"] = {"retention": {"local": {"keepLast": 1}}}
    parsed = jobobserve.parse_job(raw)
    assert isinstance(parsed, jobobserve.InvalidJob)
    result = jobplan.plan(
        job=parsed, observed=jobobserve.Observed(pods=(jobs.pod(1, 0),)), now=jobs.T0
    )
    assert result.status is not None and result.status["phase"] == "Failed"
    failed = next(c for c in result.status["conditions"] if c["type"] == conditions.FAILED)
    assert failed["reason"] == conditions.REASON_INVALID_SPEC
    assert "keepLast" in failed["message"]
    assert [d.name for d in result.deletes] == ["demo-a1-n0"]
    assert result.creates == ()


def test_other_controllers_jobs_are_left_alone() -> None:
    result, _ = _run(jobs.job(managedBy="kueue.x-k8s.io/multikueue"))
    assert result.empty and result.requeue_after is None


def test_pods_ahead_of_status_wait_for_the_status() -> None:
    _, job = _run(jobs.job())
    result, _ = _run(job, jobs.pod(2, 0), t=1)
    assert result.empty and result.requeue_after is not None


def test_last_transition_time_moves_only_on_change() -> None:
    _, job = _run(jobs.job())
    before = _cond(job, conditions.FAILED).last_transition_time
    _, job = _run(job, jobs.pod(1, 0), jobs.pod(1, 1), t=30)
    assert _cond(job, conditions.FAILED).last_transition_time == before
    assert _cond(job, conditions.READY).last_transition_time == jobs.at(30)


def test_checkpoint_conditions_and_stale() -> None:
    job = _running(checkpoint={"intervalSeconds": 60, "upload": {"uri": "s3://bkt/p"}})
    raw = job.model_dump(mode="json", by_alias=True, exclude_none=True)
    raw["status"]["checkpoints"] = {
        "lastCommitted": {"step": 10, "time": "2026-11-22T12:00:10Z"},
        "lastUploaded": {"step": 5, "uri": "s3://bkt/p/step-000000005"},
    }
    raw["status"]["storage"] = {"verifiedStep": 5}  # what the operator read back from S3
    job = trainingjob.TrainingJob.model_validate(raw)
    result, fresh = _run(job, jobs.pod(1, 0), jobs.pod(1, 1), t=20)
    assert _cond(fresh, conditions.CHECKPOINT_COMMITTED).status == "True"
    uploaded = _cond(fresh, conditions.CHECKPOINT_UPLOADED)
    assert (uploaded.status, uploaded.reason) == ("True", conditions.REASON_VERIFIED)
    assert _cond(fresh, conditions.CHECKPOINT_STALE).status == "False"
    assert result.requeue_after == pytest.approx(10 + 420 - 20)
    _, stale = _run(job, jobs.pod(1, 0), jobs.pod(1, 1), t=1000)
    flag = _cond(stale, conditions.CHECKPOINT_STALE)
    assert (flag.status, flag.reason) == ("True", conditions.REASON_STALE)
    assert stale.status.phase == "Running"


def test_first_attempt_honours_spec_resume_step() -> None:
    result, _ = _run(jobs.job(checkpoint={"resume": {"step": 70}}))
    pod = next(c for c in result.creates if c["kind"] == "Pod")
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["CAIRN_RESUME_FROM"] == "step:70"
