"""plan() makes every failure visible, and bounds what restarts for free (issue 10).

Covers: a 422 create fails the job (InvalidPodSpec) with the API server's
message and a FailedCreate Warning; other refused creates set PodsNotStarting
(reason FailedCreate) and retry; a foreign object with a child's name is a
NameConflict (and no pod is planned as adopted); pods stuck in
CreateContainerConfigError, ImagePullBackOff or Unschedulable show the reason
in the message and the PodsNotStarting condition, with one Warning per new
problem; startupDeadlineSeconds and progressDeadlineSeconds end the attempt
as a counted failure (ProgressStalled condition); exit code 78 fails at once
with ConfigurationError and the termination message, not counted;
preemptions stop at maxPreemptions; an eviction for the pod's own usage is
counted; the backoff doubles and starts over after a healthy attempt.
"""

from typing import Any

from cairn.api import exitcodes, trainingjob
from cairn.operator.core import conditions, decisions, jobobserve, jobplan, lifecycle, restartpolicy

from . import jobs


def _run(
    job: trainingjob.TrainingJob,
    *pods: jobobserve.ObservedPod,
    t: float = 0,
    errors: tuple[jobobserve.CreateError, ...] = (),
) -> tuple[jobplan.Plan, trainingjob.TrainingJob]:
    result = jobplan.plan(
        job=job, observed=jobobserve.Observed(pods=pods, create_errors=errors), now=jobs.at(t)
    )
    return result, jobs.patched(job, result)


def _cond(job: trainingjob.TrainingJob, kind: str) -> trainingjob.Condition:
    found = conditions.find(job.status.conditions, kind)
    assert found is not None, kind
    return found


def _started(**spec: Any) -> trainingjob.TrainingJob:
    _, job = _run(jobs.job(**spec))
    assert job.status.phase == "Starting"
    return job


def _warnings(result: jobplan.Plan) -> list[str]:
    return [e.reason for e in result.events if e.type == "Warning"]


INVALID = jobobserve.CreateError(
    kind="Pod",
    name="demo-a1-n0",
    code=422,
    reason="Invalid",
    message='Pod "demo-a1-n0" is invalid: spec.containers[0].resources.requests: '
    "Invalid value: must be less than or equal to cpu limit",
)


def test_invalid_pod_fails_the_job_with_the_api_message() -> None:
    job = _started()
    result, job = _run(job, t=1, errors=(INVALID,))
    assert job.status.phase == "Failed"
    failed = _cond(job, conditions.FAILED)
    assert failed.reason == conditions.REASON_INVALID_POD_SPEC
    assert "must be less than or equal to cpu limit" in failed.message
    assert _cond(job, conditions.PODS_NOT_STARTING).reason == conditions.REASON_FAILED_CREATE
    assert set(_warnings(result)) == {"InvalidPodSpec", "FailedCreate"}
    assert result.creates == ()
    again, _ = _run(job, t=2)
    assert again.events == () and again.creates == ()


def test_forbidden_create_is_shown_and_retried() -> None:
    job = _started()
    forbidden = jobobserve.CreateError(
        kind="Pod",
        name="demo-a1-n0",
        code=403,
        reason="Forbidden",
        message='pods "demo-a1-n0" is forbidden: violates PodSecurity "restricted:latest"',
    )
    result, job = _run(job, t=1, errors=(forbidden,))
    assert job.status.phase == "Starting"
    stuck = _cond(job, conditions.PODS_NOT_STARTING)
    assert (stuck.status, stuck.reason) == ("True", "FailedCreate")
    assert "violates PodSecurity" in stuck.message
    assert "violates PodSecurity" in _cond(job, conditions.READY).message
    assert _warnings(result) == ["FailedCreate"]
    assert [c["metadata"]["name"] for c in result.creates if c["kind"] == "Pod"] == [
        "demo-a1-n0",
        "demo-a1-n1",
    ]
    assert result.requeue_after == lifecycle.CREATE_ERROR_REQUEUE_SECONDS
    repeat, _ = _run(job, t=11, errors=(forbidden,))
    assert _warnings(repeat) == [], "the same refusal posts one Warning, not one per retry"


def test_foreign_object_with_a_child_name_is_a_name_conflict() -> None:
    job = _started()
    conflict = jobobserve.CreateError(
        kind="Service",
        name="demo",
        code=409,
        reason="AlreadyExists",
        message="Service demo exists without this job's ownerReference",
        conflict=True,
    )
    result, job = _run(job, t=1, errors=(conflict,))
    named = _cond(job, conditions.NAME_CONFLICT)
    assert (named.status, named.reason) == ("True", "NameConflict")
    assert "Service demo" in named.message and "never adopted" in named.message
    assert job.status.phase == "Starting"
    assert _warnings(result) == ["NameConflict"]
    _, job = _run(job, jobs.pod(1, 0), jobs.pod(1, 1), t=5)
    assert _cond(job, conditions.NAME_CONFLICT).status == "False"


def _stuck_pod(rank: int, **fields: Any) -> jobobserve.ObservedPod:
    return jobs.pod(1, rank, "Pending", **fields)


def test_stuck_pods_show_their_reason() -> None:
    cases = [
        (
            {
                "waiting_reason": "CreateContainerConfigError",
                "waiting_message": "container trainer: secret 's3' not found",
            },
            "CreateContainerConfigError",
            "secret 's3' not found",
        ),
        (
            {"waiting_reason": "ImagePullBackOff", "waiting_message": "Back-off pulling"},
            "ImagePullBackOff",
            "Back-off pulling",
        ),
        (
            {"unschedulable": '0/1 nodes are available: persistentvolumeclaim "ckpt" not found.'},
            "Unschedulable",
            'persistentvolumeclaim "ckpt" not found',
        ),
    ]
    for fields, reason, text in cases:
        job = _started()
        result, job = _run(job, _stuck_pod(0, **fields), jobs.pod(1, 1), t=2)
        stuck = _cond(job, conditions.PODS_NOT_STARTING)
        assert (stuck.status, stuck.reason) == ("True", reason)
        assert text in stuck.message and "rank 0" in stuck.message
        assert job.status.phase == "Starting"
        assert text in _cond(job, conditions.READY).message
        assert _cond(job, conditions.READY).reason == conditions.REASON_PODS_NOT_STARTING
        assert _warnings(result) == [reason]
        _, job = _run(job, jobs.pod(1, 0), jobs.pod(1, 1), t=3)
        assert _cond(job, conditions.PODS_NOT_STARTING).status == "False"


def test_startup_deadline_ends_the_attempt_counted() -> None:
    job = _started(startupDeadlineSeconds=30, restartPolicy={"maxRestarts": 0})
    stuck = _stuck_pod(0, waiting_reason="ErrImagePull", waiting_message="not found")
    result, job = _run(job, stuck, jobs.pod(1, 1), t=10)
    assert job.status.phase == "Starting"
    assert result.requeue_after == 20
    result, job = _run(job, stuck, jobs.pod(1, 1), t=31)
    assert job.status.phase == "Failed"
    assert job.status.last_failure is not None
    assert job.status.last_failure.reason == conditions.REASON_STARTUP_DEADLINE
    assert "ErrImagePull" in job.status.last_failure.message
    assert {d.name for d in result.deletes} == {"demo-a1-n0", "demo-a1-n1"}


def test_progress_deadline_restarts_the_attempt_counted() -> None:
    job = _started(progressDeadlineSeconds=60)
    _, job = _run(job, jobs.pod(1, 0), jobs.pod(1, 1), t=1)
    assert job.status.phase == "Running"
    assert job.status.progress is not None and job.status.progress.time == jobs.at(0)
    raw = job.model_dump(mode="json", by_alias=True, exclude_none=True)
    raw["status"]["step"] = 7  # the writer reports a step at t=40
    job = trainingjob.TrainingJob.model_validate(raw)
    result, job = _run(job, jobs.pod(1, 0), jobs.pod(1, 1), t=40)
    assert job.status.progress is not None
    assert (job.status.progress.step, job.status.progress.time) == (7, jobs.at(40))
    assert result.requeue_after == 60
    _, job = _run(job, jobs.pod(1, 0), jobs.pod(1, 1), t=99)
    assert job.status.phase == "Running"
    result, job = _run(job, jobs.pod(1, 0), jobs.pod(1, 1), t=100)
    assert job.status.phase == "Restarting"
    assert job.status.restarts_count_towards_max == 1
    stalled = _cond(job, conditions.PROGRESS_STALLED)
    assert (stalled.status, stalled.reason) == ("True", "ProgressDeadlineExceeded")
    assert "last step 7" in stalled.message
    assert "ProgressDeadlineExceeded" in _warnings(result)


def test_progress_is_not_tracked_without_a_deadline() -> None:
    job = _started()
    _, job = _run(job, jobs.pod(1, 0), jobs.pod(1, 1), t=1)
    assert job.status.progress is None


def test_config_error_fails_at_once_with_the_termination_message() -> None:
    job = _started(restartPolicy={"maxRestarts": 5})
    _, job = _run(job, jobs.pod(1, 0), jobs.pod(1, 1), t=1)
    failed = jobs.pod(
        1,
        1,
        "Failed",
        exit_code=exitcodes.CONFIG_ERROR,
        termination_message="resume.step 40: no committed checkpoint at that step",
    )
    result, job = _run(job, jobs.pod(1, 0), failed, t=5)
    assert job.status.phase == "Failed"
    last = job.status.last_failure
    assert last is not None
    assert (last.reason, last.counted, last.exit_code, last.rank) == (
        "ConfigurationError",
        False,
        78,
        1,
    )
    assert "no committed checkpoint at that step" in last.message
    assert _cond(job, conditions.FAILED).reason == "ConfigurationError"
    assert job.status.restarts == 0
    assert [(e.type, e.reason) for e in result.events] == [("Warning", "ConfigurationError")]


def test_config_error_through_torchrun_exit_1_is_recognised_by_its_message() -> None:
    job = _started(restartPolicy={"maxRestarts": 5})
    _, job = _run(job, jobs.pod(1, 0), jobs.pod(1, 1), t=1)
    failed = jobs.pod(
        1,
        0,
        "Failed",
        exit_code=1,
        termination_message="ConfigurationError: resume.uri: no .metadata",
    )
    _, job = _run(job, failed, jobs.pod(1, 1), t=5)
    assert job.status.phase == "Failed"
    assert job.status.last_failure is not None
    assert (job.status.last_failure.reason, job.status.last_failure.counted) == (
        "ConfigurationError",
        False,
    )
    assert job.status.restarts == 0


def test_rank_failure_carries_its_termination_message() -> None:
    job = _started()
    _, job = _run(job, jobs.pod(1, 0), jobs.pod(1, 1), t=1)
    failed = jobs.pod(1, 0, "Failed", exit_code=1, termination_message="CUDA error: OOM")
    _, job = _run(job, failed, jobs.pod(1, 1), t=5)
    assert job.status.last_failure is not None
    assert "CUDA error: OOM" in job.status.last_failure.message


def _preempt(job: trainingjob.TrainingJob, *, attempt: int, t: float) -> trainingjob.TrainingJob:
    """Attempt `attempt` runs, rank 0 is evicted, the gang is torn down and the
    next attempt starts."""
    _, job = _run(job, jobs.pod(attempt, 0), jobs.pod(attempt, 1), t=t)
    evicted = jobs.pod(attempt, 0, disruption_reason="EvictionByEvictionAPI")
    _, job = _run(job, evicted, jobs.pod(attempt, 1), t=t + 1)
    if job.status.phase == "Failed":
        return job
    assert job.status.phase == "Restarting"
    _, job = _run(job, t=t + 100)
    return job


def test_preemptions_stop_at_max_preemptions() -> None:
    job = _started(restartPolicy={"maxPreemptions": 2, "backoffSeconds": 1})
    t = 1.0
    for attempt in (1, 2, 3):
        job = _preempt(job, attempt=attempt, t=t)
        t += 200
    assert job.status.phase == "Failed"
    assert _cond(job, conditions.FAILED).reason == conditions.REASON_MAX_PREEMPTIONS
    assert (job.status.restarts, job.status.restarts_count_towards_max) == (2, 0)


def test_eviction_for_own_usage_is_counted() -> None:
    job = _started(restartPolicy={"maxRestarts": 0})
    _, job = _run(job, jobs.pod(1, 0), jobs.pod(1, 1), t=1)
    evicted = jobs.pod(
        1,
        0,
        "Failed",
        pod_reason="Evicted",
        pod_message='Usage of EmptyDir volume "cairn-checkpoints" exceeds the limit "1Gi". ',
    )
    _, job = _run(job, evicted, jobs.pod(1, 1), t=5)
    assert job.status.phase == "Failed"
    assert job.status.last_failure is not None
    assert (job.status.last_failure.reason, job.status.last_failure.counted) == ("Evicted", True)
    assert _cond(job, conditions.FAILED).reason == conditions.REASON_MAX_RESTARTS


def test_node_pressure_eviction_of_a_modest_pod_is_a_preemption() -> None:
    job = _started()
    _, job = _run(job, jobs.pod(1, 0), jobs.pod(1, 1), t=1)
    evicted = jobs.pod(
        1, 0, "Failed", pod_reason="Evicted", pod_message="The node was low on resource: memory."
    )
    _, job = _run(job, evicted, jobs.pod(1, 1), t=5)
    assert job.status.last_failure is not None
    assert (job.status.last_failure.reason, job.status.last_failure.counted) == (
        "Preempted",
        False,
    )


def test_backoff_doubles_then_resets_after_a_healthy_attempt() -> None:
    policy = trainingjob.RestartPolicy(
        backoff_seconds=10, max_backoff_seconds=100, backoff_reset_seconds=600
    )
    first = restartpolicy.next_backoff(policy, previous=None, restarts=1, ran_seconds=5)
    assert first == 10
    prev = decisions.Failure(attempt=1, time=jobs.T0, reason="x", message="", backoff_seconds=40)
    assert restartpolicy.next_backoff(policy, previous=prev, restarts=4, ran_seconds=5) == 80
    capped = decisions.Failure(attempt=1, time=jobs.T0, reason="x", message="", backoff_seconds=80)
    assert restartpolicy.next_backoff(policy, previous=capped, restarts=5, ran_seconds=5) == 100
    assert restartpolicy.next_backoff(policy, previous=capped, restarts=5, ran_seconds=600) == 10


def test_restart_records_its_backoff_and_waits_it() -> None:
    job = _started(restartPolicy={"backoffSeconds": 10, "maxBackoffSeconds": 100})
    _, job = _run(job, jobs.pod(1, 0), jobs.pod(1, 1), t=1)
    _, job = _run(job, jobs.pod(1, 0, "Failed", exit_code=1), jobs.pod(1, 1), t=5)
    assert job.status.last_failure is not None
    assert job.status.last_failure.backoff_seconds == 10
    result, job = _run(job, t=6)
    assert job.status.phase == "Restarting" and result.requeue_after == 9
