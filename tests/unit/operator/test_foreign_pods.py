"""Ownership, not labels: which labelled pods are a job's own (``podowner``).

Covers: the operator's own pods (``builders.pod``, torchrun and Ray) carry a
controller ownerReference to the job and are the job's; a pod with the job's
labels but no ownerReference, another job's UID, a non-controller
ownerReference to the job, or the right UID under a name the operator never
gives is not; with such a decoy (attempt 99, rank 0) beside a running job the
stale-status guard does not hold the job, suspend deletes only the job's
pods and reaches Suspended while the decoy runs, ``activeDeadlineSeconds``
still fails the job, a Kueue eviction still suspends it, the first attempt
creates every rank though a decoy claims rank 0 (or squats on its pod
name: the create then meets the 409 NameConflict path), a finished or invalid job
never deletes it; each decoy is reported once (a ``ForeignPod`` Warning
naming it), forgotten when it is gone, at most ``MAX_REPORTS_PER_PLAN`` per
plan, and a no-op plan keeps what was reported.
"""

from typing import Any

import pytest

from cairn.api import podenv
from cairn.kubectl_plugin import views
from cairn.operator.core import builders, jobobserve, jobplan, kueueplan, names, podowner

from . import jobs
from .test_kueue import ADMITTED, EVICTED, _job

OTHER_UID = "uid-of-another-job"


def _raw_pod(
    name: str,
    *,
    attempt: str = "99",
    rank: str = "0",
    owners: list[dict[str, Any]] | None = None,
    phase: str = "Running",
    uid: str = "decoy-uid",
) -> dict[str, Any]:
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": "ml",
        "uid": uid,
        "labels": {names.LABEL_JOB: "demo", names.LABEL_ATTEMPT: attempt, names.LABEL_RANK: rank},
    }
    if owners is not None:
        metadata["ownerReferences"] = owners
    return {"metadata": metadata, "status": {"phase": phase}}


def _owner(uid: str, *, controller: bool = True) -> dict[str, Any]:
    return {
        "apiVersion": "cairn.dev/v1alpha1",
        "kind": "TrainingJob",
        "name": "demo",
        "uid": uid,
        "controller": controller,
    }


def _parsed(raw: dict[str, Any]) -> jobobserve.ObservedPod:
    pod = jobobserve.parse_pod(raw)
    assert pod is not None
    return pod


DECOY = _parsed(_raw_pod("decoy"))
"""The issue's decoy: the job's labels, attempt 99, rank 0, no ownerReference."""


def _owns(pod: jobobserve.ObservedPod) -> bool:
    return podowner.owns(pod, job_name="demo", job_uid=jobs.JOB_UID)


# --- which pods are the job's -------------------------------------------------


@pytest.mark.parametrize("runtime", ["torchrun", "ray"])
def test_the_operators_own_pods_are_the_jobs(runtime: str) -> None:
    job = jobs.job(runtime=runtime, command=["python", "train.py"])
    built = builders.pod(job, attempt=3, rank=1, resume=podenv.ResumeTarget(kind="latest"))
    [owner] = built["metadata"]["ownerReferences"]
    assert (owner["uid"], owner["controller"]) == (jobs.JOB_UID, True)
    pod = _parsed({**built, "metadata": {**built["metadata"], "uid": "p"}})
    assert pod.controller_uid == jobs.JOB_UID and _owns(pod)


@pytest.mark.parametrize(
    ("name", "owners", "why"),
    [
        ("decoy", None, "it has no controller ownerReference"),
        ("demo-a99-n0", [], "it has no controller ownerReference"),
        ("demo-a99-n0", [_owner(OTHER_UID)], "its controller ownerReference is not this job"),
        (
            "demo-a99-n0",
            [_owner(jobs.JOB_UID, controller=False)],
            "it has no controller ownerReference",
        ),
        (
            "decoy",
            [_owner(jobs.JOB_UID)],
            "the operator names attempt 99 rank 0 demo-a99-n0",
        ),
    ],
    ids=["no-owner", "empty-owners", "other-jobs-uid", "not-controller", "wrong-name"],
)
def test_a_labelled_pod_is_not_the_jobs(
    name: str, owners: list[dict[str, Any]] | None, why: str
) -> None:
    raw = _raw_pod(name, owners=owners)
    pod = _parsed(raw)
    assert not _owns(pod)
    assert podowner.why_foreign(pod, job_name="demo", job_uid=jobs.JOB_UID) == why
    # `kubectl cairn logs/describe` judge the same pod the same way (one rule).
    job = {"metadata": {"name": "demo", "uid": jobs.JOB_UID}}
    assert views.foreign_reason(raw, job=job) == why


def test_the_plugin_shows_the_jobs_own_pod_and_sets_a_decoy_apart() -> None:
    own = builders.pod(jobs.job(), attempt=2, rank=1, resume=podenv.ResumeTarget(kind="latest"))
    decoy = _raw_pod("decoy", attempt="2", rank="x", owners=[_owner(jobs.JOB_UID)])
    job = {"metadata": {"name": "demo", "uid": jobs.JOB_UID}}
    shown, apart = views.own_pods(job, [dict(own), decoy])
    assert shown == [own]
    assert apart == ["decoy (its attempt or rank label is not a number)"]


def test_a_job_without_a_uid_owns_nothing() -> None:
    pod = _parsed(_raw_pod("demo-a1-n0", attempt="1", owners=[_owner("")]))
    assert not podowner.owns(pod, job_name="demo", job_uid="")


def test_attach_moves_strangers_aside() -> None:
    own = jobs.pod(1, 0)
    attached = podowner.attach(
        jobobserve.Observed(pods=(own, DECOY)), job_name="demo", job_uid=jobs.JOB_UID
    )
    assert attached.pods == (own,) and attached.foreign == (DECOY,)


# --- decisions with a decoy beside the job ------------------------------------


def _running(**spec: Any) -> Any:
    return jobs.job(
        {
            "phase": "Running",
            "attempt": 1,
            "startTime": "2026-11-22T12:00:00Z",
            "attemptStartTime": "2026-11-22T12:00:00Z",
        },
        **spec,
    )


def _plan(job: Any, *pods: jobobserve.ObservedPod, t: float = 10, **seen: Any) -> jobplan.Plan:
    return jobplan.plan(job=job, observed=jobobserve.Observed(pods=pods, **seen), now=jobs.at(t))


def test_stale_status_guard_ignores_a_decoy_of_attempt_99() -> None:
    result = _plan(_running(suspend=True), jobs.pod(1, 0), jobs.pod(1, 1), DECOY)
    assert result.decision is not None and not result.decision.noop
    assert result.decision.phase == "Suspending"
    # The guard still holds the job for one of its own pods ahead of the status.
    ahead = _plan(_running(), jobs.pod(1, 0), jobs.pod(2, 0))
    assert ahead.decision is not None and ahead.decision.noop


def test_suspend_deletes_only_the_jobs_pods_and_completes_beside_a_decoy() -> None:
    job = _running(suspend=True)
    result = _plan(job, jobs.pod(1, 0), jobs.pod(1, 1), DECOY)
    assert {d.name for d in result.deletes} == {"demo-a1-n0", "demo-a1-n1"}
    job = jobs.patched(job, result)
    result = _plan(job, DECOY, t=20)
    assert jobs.patched(job, result).status.phase == "Suspended"
    assert result.deletes == ()


def test_active_deadline_fails_the_job_beside_a_decoy() -> None:
    job = _running(activeDeadlineSeconds=5)
    result = _plan(job, jobs.pod(1, 0), jobs.pod(1, 1), DECOY, t=10)
    assert jobs.patched(job, result).status.phase == "Failed"
    assert {d.name for d in result.deletes} == {"demo-a1-n0", "demo-a1-n1"}


def _queued(workload: dict[str, Any], *pods: jobobserve.ObservedPod, job: Any, t: float) -> Any:
    queue = kueueplan.Queue(
        name="cairn-lq",
        workload=kueueplan.parse_workload(workload),
        placement=kueueplan.Placement(),
    )
    result = _plan(job, *pods, t=t, queue=queue)
    return result, jobs.patched(job, result)


def test_kueue_eviction_suspends_the_job_beside_a_decoy() -> None:
    job = _job({"phase": "Running", "attempt": 1, "startTime": "2026-11-22T12:00:00Z"})
    result, job = _queued(EVICTED, jobs.pod(1, 0), jobs.pod(1, 1), DECOY, job=job, t=10)
    assert job.status.phase == "Suspending"
    assert {d.name for d in result.deletes} == {"demo-a1-n0", "demo-a1-n1"}
    result, job = _queued(EVICTED, DECOY, job=job, t=20)
    assert job.status.phase == "Suspended" and result.deletes == ()


def test_first_attempt_creates_every_rank_though_a_decoy_claims_rank_0() -> None:
    decoy = _parsed(_raw_pod("decoy-n0", attempt="1"))
    result, job = _queued(ADMITTED, decoy, job=_job(), t=1)
    assert job.status.phase == "Starting"
    pods = [c["metadata"]["name"] for c in result.creates if c["kind"] == "Pod"]
    assert pods == ["demo-a1-n0", "demo-a1-n1"]


def test_a_stranger_under_the_jobs_pod_name_is_not_counted_as_that_rank() -> None:
    squatter = _parsed(_raw_pod("demo-a1-n0", attempt="1"))
    result, _ = _queued(ADMITTED, squatter, job=_job(), t=1)
    # Created anyway: the API server answers 409 and effects reports a NameConflict.
    pods = [c["metadata"]["name"] for c in result.creates if c["kind"] == "Pod"]
    assert pods == ["demo-a1-n0", "demo-a1-n1"]


@pytest.mark.parametrize("cleanup", ["Delete", "Keep"])
def test_a_finished_job_never_deletes_a_decoy(cleanup: str) -> None:
    job = jobs.job({"phase": "Failed", "attempt": 1}, cleanup={"finishedPods": cleanup})
    result = _plan(job, jobs.pod(1, 0, "Running"), DECOY)
    assert [d.name for d in result.deletes] == ["demo-a1-n0"]


def test_an_invalid_job_never_deletes_a_decoy() -> None:
    invalid = jobobserve.parse_job(jobs.body(nodes=0))
    assert isinstance(invalid, jobobserve.InvalidJob)
    result = _plan(invalid, jobs.pod(1, 0), DECOY)
    assert [d.name for d in result.deletes] == ["demo-a1-n0"]


# --- the ForeignPod report ------------------------------------------------------


def _foreign_events(result: jobplan.Plan) -> list[str]:
    return [e.message for e in result.events if e.reason == podowner.REASON_FOREIGN_POD]


def _steady() -> Any:
    """A job Running with both its pods, whose status its plan leaves alone."""
    own = (jobs.pod(1, 0), jobs.pod(1, 1))
    job = jobs.patched(jobs.job(), _plan(jobs.job(), t=0))
    job = jobs.patched(job, _plan(job, *own, t=1))
    assert job.status.phase == "Running" and _plan(job, *own, t=2).empty
    return job


def test_a_decoy_is_reported_once_by_name() -> None:
    job = _steady()
    own = (jobs.pod(1, 0), jobs.pod(1, 1))
    first = _plan(job, *own, DECOY)
    [message] = _foreign_events(first)
    assert message.startswith("pod decoy has this job's labels but is not its pod")
    assert "it has no controller ownerReference" in message and "ignored" in message
    assert [e.type for e in first.events] == ["Warning"]
    assert first.status is None, "a report writes no status"
    assert first.foreign_reported == {DECOY.uid}
    again = _plan(job, *own, DECOY, reported_foreign=first.foreign_reported)
    assert _foreign_events(again) == [] and again.empty
    assert again.foreign_reported == {DECOY.uid}


def test_a_decoy_that_left_is_forgotten() -> None:
    result = _plan(_running(), jobs.pod(1, 0), jobs.pod(1, 1), reported_foreign={DECOY.uid})
    assert result.foreign_reported == frozenset()


def test_a_flood_of_decoys_is_reported_over_several_plans() -> None:
    limit = podowner.MAX_REPORTS_PER_PLAN
    decoys = [_parsed(_raw_pod(f"decoy-{i:02}", uid=f"d{i}")) for i in range(limit + 3)]
    own = (jobs.pod(1, 0), jobs.pod(1, 1))
    first = _plan(_running(), *own, *decoys)
    assert len(_foreign_events(first)) == limit
    second = _plan(_running(), *own, *decoys, reported_foreign=first.foreign_reported)
    assert len(_foreign_events(second)) == 3
    assert second.foreign_reported == {p.uid for p in decoys}


def test_a_no_op_plan_keeps_what_was_reported() -> None:
    raw = jobs.body()
    raw["metadata"]["deletionTimestamp"] = "2026-11-22T12:00:00Z"
    job = jobobserve.parse_job(raw)
    result = _plan(job, DECOY, reported_foreign={DECOY.uid})
    assert result.empty and result.foreign_reported == {DECOY.uid}
