"""A lost pod replaced in place (runtime torchrun or ray with in-place restarts), pure.

Covers: a deleted rank-1 pod is recorded (status.podReplacements, one Warning
Event), the attempt, phase and the other pod stay, and once its name is free
a pod of the same name is created in the same attempt resuming from the
newest step; the replacement's UID is recorded once seen, and when it runs
the job is plainly Running again; a replacement lost in turn is a new loss;
reconciles in between (an operator restart reads status) add nothing; a
stranger pod with the job's labels is neither the replacement nor deleted;
evicted (Failed) and Unknown pods are deleted by the operator, a pod being
deleted is waited for; what ends the attempt as before: no in-place budget,
rank 0's pod, an eviction the pod caused itself, a failed rank, a loss once
a rank succeeded, the budget spent, a replacement not running within the
deadline; a new attempt clears the records. Runtime ray: a worker's lost
pod is replaced the same way, by the very pod first created (name, labels,
env; an explicit resume target included), and an evicted one is deleted
first; not replaced: the head's (rank 0, the driver's) pod, a job with
``spec.ray.maxInPlaceRestarts: 0`` or one node; the budget is
``spec.ray.maxInPlaceRestarts`` (the loss past it ends the attempt) and the
Warning Event and ``Ready`` message name it.
"""

import dataclasses
from typing import Any

import pytest

from cairn.operator.core import conditions, decisions, jobobserve, replaceplan

from . import jobs
from .test_plan_lifecycle import _run

INPLACE = {"torchrun": {"maxInPlaceRestarts": 2}}


def _running(**spec: Any) -> Any:
    _, job = _run(jobs.job(**{**INPLACE, **spec}))
    _, job = _run(job, jobs.pod(1, 0), jobs.pod(1, 1), t=1)
    assert job.status.phase == "Running"
    return job


def _replacement(attempt: int, rank: int, n: int, phase: Any = "Running") -> Any:
    pod = jobs.pod(attempt, rank, phase)
    return dataclasses.replace(pod, uid=f"{pod.uid}-r{n}")


def _pod_creates(result: Any) -> list[str]:
    return [c["metadata"]["name"] for c in result.creates if c["kind"] == "Pod"]


def test_a_deleted_pod_is_replaced_in_place() -> None:
    job = _running()
    # Someone deletes rank 1's pod (a drain, a node going away).
    result, job = _run(job, jobs.pod(1, 0), jobs.pod(1, 1, deleting=True), t=10)
    assert (job.status.phase, job.status.attempt, job.status.restarts) == ("Running", 1, 0)
    assert [(r.rank, r.lost_pod_uid, r.reason) for r in job.status.pod_replacements or ()] == [
        (1, "pod-1-1", "pod deleted")
    ]
    assert result.deletes == () and _pod_creates(result) == []  # it is being deleted already
    assert [(e.type, e.reason) for e in result.events] == [("Warning", "ReplacingPod")]
    assert "rank 1 lost (pod deleted)" in result.events[0].message
    ready = conditions.find(job.status.conditions, conditions.READY)
    assert ready is not None and ready.reason == conditions.REASON_REPLACING_POD
    # Its processes stopped, the pod object is still there: nothing new.
    result, job = _run(job, jobs.pod(1, 0), jobs.pod(1, 1, "Failed", deleting=True), t=12)
    assert job.status.phase == "Running" and result.events == () and _pod_creates(result) == []
    # The name is free: the same pod name in the same attempt, resuming from latest.
    result, job = _run(job, jobs.pod(1, 0), t=13)
    assert _pod_creates(result) == ["demo-a1-n1"]
    created = next(c for c in result.creates if c["kind"] == "Pod")
    env = {e["name"]: e.get("value") for e in created["spec"]["containers"][0]["env"]}
    assert env["CAIRN_RESUME_FROM"] == "latest" and env["CAIRN_ATTEMPT"] == "1"
    assert result.events == () and job.status.attempt == 1
    # Seen Pending: its UID is recorded, still replacing.
    new = _replacement(1, 1, 1, "Pending")
    result, job = _run(job, jobs.pod(1, 0), new, t=15)
    assert [r.replacement_uid for r in job.status.pod_replacements or ()] == [new.uid]
    assert _pod_creates(result) == []
    # Running: plainly Running again, the record kept for the attempt.
    result, job = _run(job, jobs.pod(1, 0), _replacement(1, 1, 1), t=17)
    ready = conditions.find(job.status.conditions, conditions.READY)
    assert ready is not None and ready.reason == conditions.REASON_RUNNING
    assert job.status.phase == "Running" and len(job.status.pod_replacements or ()) == 1


def test_a_pod_gone_before_it_was_seen_deleting_is_replaced() -> None:
    job = _running()
    result, job = _run(job, jobs.pod(1, 0), t=10)
    assert _pod_creates(result) == ["demo-a1-n1"]
    assert [(r.rank, r.lost_pod_uid, r.reason) for r in job.status.pod_replacements or ()] == [
        (1, "", "pod disappeared")
    ]
    # Until its replacement is seen, the missing rank is the same loss.
    result, job = _run(job, jobs.pod(1, 0), t=11)
    assert _pod_creates(result) == ["demo-a1-n1"] and result.events == ()
    assert len(job.status.pod_replacements or ()) == 1


def test_a_pod_with_our_labels_is_not_taken_for_the_replacement() -> None:
    # A stranger labelled as rank 1 of attempt 1 (no controller ownerReference):
    # it neither covers the missing rank nor is recorded as its replacement.
    job = _running()
    decoy = dataclasses.replace(jobs.pod(1, 1), name="decoy", uid="decoy-uid", controller_uid=None)
    result, job = _run(job, jobs.pod(1, 0), decoy, t=10)
    assert _pod_creates(result) == ["demo-a1-n1"]
    result, job = _run(job, jobs.pod(1, 0), decoy, t=11)
    assert [r.replacement_uid for r in job.status.pod_replacements or ()] == [""]
    assert "decoy" not in [d.name for d in result.deletes]


def test_a_replacement_lost_in_turn_is_a_new_loss() -> None:
    job = _running()
    _, job = _run(job, jobs.pod(1, 0), t=10)
    first = _replacement(1, 1, 1)
    _, job = _run(job, jobs.pod(1, 0), first, t=12)
    result, job = _run(job, jobs.pod(1, 0), t=20)  # gone again
    assert _pod_creates(result) == ["demo-a1-n1"]
    assert [r.replacement_uid for r in job.status.pod_replacements or ()] == [first.uid, ""]
    assert len(result.events) == 1 and "2 of maxInPlaceRestarts=2" in result.events[0].message


@pytest.mark.parametrize(
    ("lost", "deleted"),
    [
        (jobs.pod(1, 1, "Failed", pod_reason="Evicted", pod_message="node shutdown"), True),
        (jobs.pod(1, 1, "Unknown"), True),
        (jobs.pod(1, 1, disruption_reason="PreemptionByScheduler"), True),
        (jobs.pod(1, 1, deleting=True, disruption_reason="DeletionByTaintManager"), False),
    ],
)
def test_the_operator_deletes_a_lost_pod_nobody_deletes(
    lost: jobobserve.ObservedPod, deleted: bool
) -> None:
    job = _running()
    result, job = _run(job, jobs.pod(1, 0), lost, t=10)
    assert job.status.phase == "Running" and job.status.attempt == 1
    assert [d.name for d in result.deletes] == (["demo-a1-n1"] if deleted else [])
    assert len(job.status.pod_replacements or ()) == 1


def test_a_long_eviction_message_is_clipped_in_the_record() -> None:
    evicted = jobs.pod(1, 1, "Failed", pod_reason="Evicted", pod_message="x" * 5000)
    _, job = _run(_running(), jobs.pod(1, 0), evicted, t=10)
    records = job.status.pod_replacements or ()
    assert len(records) == 1 and len(records[0].reason) == replaceplan.REASON_MAX


def test_reconciles_in_between_add_nothing() -> None:
    job = _running()
    _, job = _run(job, jobs.pod(1, 0), jobs.pod(1, 1, deleting=True), t=10)
    for t in (11, 12, 13):
        result, job = _run(job, jobs.pod(1, 0), jobs.pod(1, 1, deleting=True), t=t)
        assert result.status is None and result.events == () and result.deletes == ()
    assert len(job.status.pod_replacements or ()) == 1


def _ends_the_attempt(job: Any, *pods: jobobserve.ObservedPod, t: float = 10) -> Any:
    result, job = _run(job, *pods, t=t)
    assert job.status.phase == "Restarting", job.status.phase
    assert not any(e.reason == "ReplacingPod" for e in result.events)
    return job


def test_without_an_in_place_budget_a_lost_pod_ends_the_attempt() -> None:
    _, job = _run(jobs.job())
    _, job = _run(job, jobs.pod(1, 0), jobs.pod(1, 1), t=1)
    job = _ends_the_attempt(job, jobs.pod(1, 0), jobs.pod(1, 1, deleting=True))
    assert job.status.last_failure is not None
    assert job.status.last_failure.reason == conditions.REASON_PREEMPTED


def test_rank_0s_pod_is_not_replaced() -> None:
    # Its agent hosts the c10d rendezvous: the survivors lose it too.
    _ends_the_attempt(_running(), jobs.pod(1, 0, deleting=True), jobs.pod(1, 1))


def test_an_eviction_for_the_pods_own_usage_is_not_replaced() -> None:
    own = jobs.pod(
        1,
        1,
        "Failed",
        pod_reason="Evicted",
        pod_message='Usage of EmptyDir volume "data" exceeds the limit "1Gi".',
    )
    job = _ends_the_attempt(_running(), jobs.pod(1, 0), own)
    assert job.status.last_failure is not None and job.status.last_failure.counted


def test_a_failed_rank_is_not_replaced() -> None:
    failed = jobs.pod(1, 1, "Failed", exit_code=1)
    job = _ends_the_attempt(_running(), jobs.pod(1, 0), failed)
    assert job.status.last_failure is not None
    assert job.status.last_failure.reason == conditions.REASON_RANK_FAILED


def test_a_loss_once_a_rank_succeeded_is_not_replaced() -> None:
    # The group is ending: a new rank 1 would have nobody to rejoin.
    job = _running()
    result, job = _run(job, jobs.pod(1, 0, "Succeeded"), jobs.pod(1, 1, deleting=True), t=10)
    assert not job.status.pod_replacements
    assert not any(e.reason == "ReplacingPod" for e in result.events)


def test_past_the_budget_the_attempt_ends() -> None:
    job = _running(torchrun={"maxInPlaceRestarts": 1})
    _, job = _run(job, jobs.pod(1, 0), t=10)
    _, job = _run(job, jobs.pod(1, 0), _replacement(1, 1, 1), t=12)
    job = _ends_the_attempt(job, jobs.pod(1, 0), t=20)  # the second loss
    assert job.status.last_failure is not None
    assert "pod disappeared" in job.status.last_failure.message


def test_a_replacement_not_running_in_time_ends_the_attempt() -> None:
    job = _running()
    _, job = _run(job, jobs.pod(1, 0), t=10)
    stuck = _replacement(1, 1, 1, "Pending")
    _, job = _run(job, jobs.pod(1, 0), stuck, t=100)
    assert job.status.phase == "Running"
    late = 10 + replaceplan.REPLACEMENT_DEADLINE_SECONDS + 1
    job = _ends_the_attempt(job, jobs.pod(1, 0), stuck, t=late)
    assert job.status.last_failure is not None
    assert "did not run within" in job.status.last_failure.message
    assert not job.status.last_failure.counted


def test_a_new_attempt_clears_the_records() -> None:
    job = _running()
    _, job = _run(job, jobs.pod(1, 0), t=10)
    job = _ends_the_attempt(job, jobs.pod(1, 0, "Failed", exit_code=1), t=12)
    assert job.status.pod_replacements  # kept while the attempt ends
    assert job.status.last_failure is not None
    wait = job.status.last_failure.backoff_seconds or 0
    _, job = _run(job, t=13 + wait)  # every pod gone, the backoff over: attempt 2
    assert job.status.phase == "Starting"
    assert job.status.attempt == 2 and job.status.pod_replacements is None


# --- runtime ray: the head (rank 0) runs the driver; its workers are replaced --

RAY_COMMAND = ["python", "-m", "cairn.trainer.raydriver", "cairn.trainer.reference:main", "--"]


def _ray(**spec: Any) -> dict[str, Any]:
    return {"runtime": "ray", "command": RAY_COMMAND, **spec}


def _started_ray(**spec: Any) -> tuple[Any, Any]:
    """A ray job whose attempt 1 runs (every rank), and rank 1's pod as first created."""
    result, job = _run(jobs.job(**_ray(**spec)))
    worker = next(c for c in result.creates if c["metadata"]["name"] == "demo-a1-n1")
    _, job = _run(job, *(jobs.pod(1, rank) for rank in range(job.spec.nodes)), t=1)
    assert job.status.phase == "Running"
    return job, worker


def _replacing(job: Any, *pods: jobobserve.ObservedPod, t: float) -> Any:
    """replaceplan.replacing alone (None: the rest of the lifecycle decides)."""
    return replaceplan.replacing(
        job,
        jobobserve.Observed(pods=pods),
        decisions.Base(job.status),
        settled=None,
        cleanup=(),
        now=jobs.at(t),
    )


def test_a_ray_workers_lost_pod_is_replaced_in_place() -> None:
    job, original = _started_ray(ray={"maxInPlaceRestarts": 2})
    assert replaceplan.enabled(job) and replaceplan.budget(job) == 2
    result, job = _run(job, jobs.pod(1, 0), jobs.pod(1, 1, deleting=True), t=10)
    assert (job.status.phase, job.status.attempt, job.status.restarts) == ("Running", 1, 0)
    assert [(r.rank, r.lost_pod_uid, r.reason) for r in job.status.pod_replacements or ()] == [
        (1, "pod-1-1", "pod deleted")
    ]
    assert result.deletes == () and _pod_creates(result) == []
    assert [(e.type, e.reason) for e in result.events] == [("Warning", "ReplacingPod")]
    ready = conditions.find(job.status.conditions, conditions.READY)
    assert ready is not None and ready.reason == conditions.REASON_REPLACING_POD
    # The name is free: the same pod (name, labels, env) in the same attempt.
    result, job = _run(job, jobs.pod(1, 0), t=13)
    assert _pod_creates(result) == ["demo-a1-n1"]
    created = next(c for c in result.creates if c["kind"] == "Pod")
    assert created == original
    assert (job.status.phase, job.status.attempt) == ("Running", 1)
    ready = conditions.find(job.status.conditions, conditions.READY)
    assert ready is not None and ready.reason == conditions.REASON_REPLACING_POD
    # It runs: plainly Running again, the record kept for the attempt.
    _, job = _run(job, jobs.pod(1, 0), _replacement(1, 1, 1), t=15)
    ready = conditions.find(job.status.conditions, conditions.READY)
    assert ready is not None and ready.reason == conditions.REASON_RUNNING
    assert [r.replacement_uid for r in job.status.pod_replacements or ()] == ["pod-1-1-r1"]


def test_a_ray_workers_evicted_pod_is_deleted_then_replaced() -> None:
    job, _ = _started_ray()
    evicted = jobs.pod(1, 1, "Failed", pod_reason="Evicted", pod_message="node shutdown")
    result, job = _run(job, jobs.pod(1, 0), evicted, t=10)
    assert [d.name for d in result.deletes] == ["demo-a1-n1"]
    assert job.status.phase == "Running" and len(job.status.pod_replacements or ()) == 1


def test_a_ray_worker_recreated_in_place_resumes_like_its_peers() -> None:
    # An explicit resume target (allowed with ray's in-place restarts): the
    # replacement carries it too, the same spec as the pod it replaces.
    job, original = _started_ray(checkpoint={"resume": {"step": 10}})
    result, job = _run(job, jobs.pod(1, 0), t=10)
    created = next(c for c in result.creates if c["kind"] == "Pod")
    assert created == original
    env = {e["name"]: e.get("value") for e in created["spec"]["containers"][0]["env"]}
    assert env["CAIRN_RESUME_FROM"] == "step:10"


def test_the_ray_heads_lost_pod_is_not_replaced() -> None:
    # Rank 0 is the Ray head and runs the driver: the attempt ends.
    job, _ = _started_ray()
    head = jobs.pod(1, 0, deleting=True)
    assert _replacing(job, head, jobs.pod(1, 1), t=10) is None
    assert _replacing(job, jobs.pod(1, 1), t=10) is None  # gone altogether
    job = _ends_the_attempt(job, head, jobs.pod(1, 1))
    assert job.status.last_failure is not None and job.status.last_failure.rank == 0


def test_a_ray_job_without_an_in_place_budget_is_not_replaced() -> None:
    job, _ = _started_ray(ray={"maxInPlaceRestarts": 0})
    assert not replaceplan.enabled(job)
    assert _replacing(job, jobs.pod(1, 0), jobs.pod(1, 1, deleting=True), t=10) is None
    job = _ends_the_attempt(job, jobs.pod(1, 0), jobs.pod(1, 1, deleting=True))
    assert job.status.last_failure is not None
    assert job.status.last_failure.reason == conditions.REASON_PREEMPTED


def test_a_single_node_ray_job_is_not_replaced() -> None:
    _, job = _run(jobs.job(**_ray(nodes=1)))
    _, job = _run(job, jobs.pod(1, 0), t=1)
    assert job.status.phase == "Running" and replaceplan.budget(job) == 3  # the default
    assert not replaceplan.enabled(job)
    assert _replacing(job, jobs.pod(1, 0, deleting=True), t=10) is None


def test_a_ray_jobs_budget_is_spec_ray_max_in_place_restarts() -> None:
    job, _ = _started_ray(ray={"maxInPlaceRestarts": 1})
    _, job = _run(job, jobs.pod(1, 0), t=10)
    _, job = _run(job, jobs.pod(1, 0), _replacement(1, 1, 1), t=12)
    assert len(job.status.pod_replacements or ()) == 1
    assert _replacing(job, jobs.pod(1, 0), t=20) is None  # the second loss
    job = _ends_the_attempt(job, jobs.pod(1, 0), t=20)
    assert job.status.last_failure is not None
    assert "pod disappeared" in job.status.last_failure.message


def test_a_ray_loss_event_names_the_budget_from_spec_ray() -> None:
    job, _ = _started_ray(nodes=3, ray={"maxInPlaceRestarts": 5})
    result, job = _run(job, jobs.pod(1, 0), jobs.pod(1, 1), jobs.pod(1, 2, deleting=True), t=10)
    assert [(e.type, e.reason) for e in result.events] == [("Warning", "ReplacingPod")]
    assert "rank 2 lost (pod deleted)" in result.events[0].message
    assert "1 of maxInPlaceRestarts=5 this attempt" in result.events[0].message
    ready = conditions.find(job.status.conditions, conditions.READY)
    assert ready is not None and "1 of maxInPlaceRestarts=5 replacement(s)" in ready.message
