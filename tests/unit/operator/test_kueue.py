"""Kueue's Workload protocol: the pure decisions (``kueueplan``) and the plan they gate.

Covers: a job without the queue label is untouched; a queued job is held
(Suspended, QueuedByKueue, no pod) without a Workload and while pending, with
Kueue's reason in the message; admission starts it with the flavors' node
labels and tolerations and the admission checks' updates; eviction is the
Cairn suspend (SIGTERM via pod deletion, PreemptedByKueue, restart budget not
charged) and re-admission resumes from the latest commit; the user's
``spec.suspend`` still wins; the desired Workload (owner, pod set, priority);
the quota-release, PodsReady and Finished patches; the priority boost as a function of
uncommitted time and steps (bucketed, capped, reset by a commit) and its
annotation patch; parsing a Workload as Kueue v0.19.2 writes it.
"""

import datetime
from typing import Any

import pytest

from cairn.api import podenv, trainingjob
from cairn.operator.core import builders, conditions, jobobserve, jobplan, kueueboost, kueueplan

from . import jobs

QUEUE = "cairn-lq"
FLAVOR = {
    "metadata": {"name": "gpu-a"},
    "spec": {
        "nodeLabels": {"pool": "a100"},
        "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
    },
}


def _job(
    status: dict[str, Any] | None = None, *, labels: dict[str, str] | None = None, **spec: Any
) -> trainingjob.TrainingJob:
    raw = jobs.body(**spec)
    raw["metadata"]["labels"] = {kueueplan.QUEUE_LABEL: QUEUE} if labels is None else labels
    if status is not None:
        raw["status"] = status
    return trainingjob.TrainingJob.model_validate(raw)


def _cond(kind: str, status: str, reason: str = "R", message: str = "") -> dict[str, Any]:
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": "2026-11-22T11:00:00Z",
    }


ADMISSION = {
    "clusterQueue": "cairn-cq",
    "podSetAssignments": [
        {"name": kueueplan.POD_SET, "flavors": {"cpu": "gpu-a", "memory": "gpu-a"}, "count": 2}
    ],
}


def _raw_workload(
    *conds: dict[str, Any], admission: bool = True, **annotations: str
) -> dict[str, Any]:
    return {
        "apiVersion": kueueplan.API_VERSION,
        "kind": "Workload",
        "metadata": {
            "name": "trainingjob-demo-x",
            "uid": "wl-1",
            "resourceVersion": "42",
            "annotations": annotations,
        },
        "spec": {"active": True, "queueName": QUEUE},
        "status": {"conditions": list(conds), **({"admission": ADMISSION} if admission else {})},
    }


ADMITTED = _raw_workload(
    _cond(kueueplan.QUOTA_RESERVED, "True"), _cond(kueueplan.ADMITTED, "True", "Admitted")
)
PENDING = _raw_workload(
    _cond(
        kueueplan.QUOTA_RESERVED, "False", "Pending", "couldn't assign flavors: insufficient quota"
    ),
    admission=False,
)
EVICTED = _raw_workload(
    _cond(kueueplan.QUOTA_RESERVED, "True"),
    _cond(kueueplan.ADMITTED, "True", "Admitted"),
    _cond(kueueplan.EVICTED, "True", "Preempted", "Preempted to accommodate a workload"),
)


def _queue(raw: dict[str, Any] | None) -> kueueplan.Queue:
    if raw is None:
        return kueueplan.Queue(name=QUEUE)
    workload = kueueplan.parse_workload(raw)
    where = kueueplan.placement(workload, {"gpu-a": FLAVOR})
    return kueueplan.Queue(name=QUEUE, workload=workload, placement=where)


def _run(
    job: trainingjob.TrainingJob,
    workload: dict[str, Any] | None,
    *pods: jobobserve.ObservedPod,
    t: float = 0,
) -> tuple[jobplan.Plan, trainingjob.TrainingJob]:
    queue = _queue(workload) if kueueplan.queue_name(job) else None
    result = jobplan.plan(
        job=job, observed=jobobserve.Observed(pods=pods, queue=queue), now=jobs.at(t)
    )
    return result, jobs.patched(job, result)


def _suspended(job: trainingjob.TrainingJob) -> trainingjob.Condition:
    found = conditions.find(job.status.conditions, conditions.SUSPENDED)
    assert found is not None
    return found


# --- the plan, gated -----------------------------------------------------------


def test_unlabelled_job_is_not_gated() -> None:
    result, job = _run(_job(labels={}), None)
    assert job.status.phase == "Starting"
    assert [c["kind"] for c in result.creates].count("Pod") == 2


def test_queued_job_without_workload_is_held_with_no_pod() -> None:
    result, job = _run(_job(), None)
    assert job.status.phase == "Suspended"
    assert result.creates == () and result.deletes == ()
    held = _suspended(job)
    assert (held.status, held.reason) == ("True", kueueplan.REASON_QUEUED)
    assert held.message.startswith(f"waiting for admission in queue {QUEUE}")
    assert [(e.reason, e.type) for e in result.events] == [(kueueplan.REASON_QUEUED, "Normal")]


def test_pending_workload_holds_and_says_why() -> None:
    result, job = _run(_job(), PENDING)
    assert job.status.phase == "Suspended" and result.creates == ()
    assert _suspended(job).message == (
        f"waiting for admission in queue {QUEUE}: couldn't assign flavors: insufficient quota"
    )
    again, _ = _run(job, PENDING, t=5)
    assert again.status is None and again.events == ()  # no churn while it waits


def test_admission_starts_pods_where_the_flavor_says() -> None:
    _, job = _run(_job(), PENDING)
    result, job = _run(job, ADMITTED, t=1)
    assert job.status.phase == "Starting" and job.status.attempt == 1
    pods = [c for c in result.creates if c["kind"] == "Pod"]
    assert len(pods) == 2
    for pod in pods:
        assert pod["spec"]["nodeSelector"] == {"pool": "a100"}
        assert pod["spec"]["tolerations"] == [
            {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}
        ]


def test_admission_check_updates_reach_the_pods() -> None:
    raw = _raw_workload(_cond(kueueplan.QUOTA_RESERVED, "True"), _cond(kueueplan.ADMITTED, "True"))
    raw["status"]["admissionChecks"] = [
        {
            "name": "prov",
            "state": "Ready",
            "message": "",
            "podSetUpdates": [
                {
                    "name": kueueplan.POD_SET,
                    "labels": {"cairn.dev/job-name": "hijack", "team": "a"},
                    "annotations": {"note": "x"},
                    "nodeSelector": {"zone": "z1"},
                }
            ],
        }
    ]
    result, _ = _run(_job(), raw)
    pod = next(c for c in result.creates if c["kind"] == "Pod")
    assert pod["spec"]["nodeSelector"] == {"pool": "a100", "zone": "z1"}
    assert pod["metadata"]["labels"]["team"] == "a"
    assert pod["metadata"]["labels"]["cairn.dev/job-name"] == "demo"  # Cairn's labels win
    assert pod["metadata"]["annotations"] == {"note": "x"}


def _running_queued() -> trainingjob.TrainingJob:
    _, job = _run(_job(), ADMITTED)
    _, job = _run(job, ADMITTED, jobs.pod(1, 0), jobs.pod(1, 1), t=1)
    assert job.status.phase == "Running"
    return job


def test_eviction_is_the_cairn_suspend_and_resumes_uncounted() -> None:
    job = _running_queued()
    result, job = _run(job, EVICTED, jobs.pod(1, 0), jobs.pod(1, 1), t=10)
    assert job.status.phase == "Suspending"
    assert {d.name for d in result.deletes} == {"demo-a1-n0", "demo-a1-n1"}
    assert result.creates == ()
    [event] = result.events
    assert event.reason == kueueplan.REASON_PREEMPTED
    assert event.message.startswith("preempted by Kueue (Preempted: Preempted to accommodate")
    # The pods took their final checkpoint (the writer reported step 40) and are gone.
    status = job.model_dump(mode="json", by_alias=True, exclude_none=True)["status"]
    status["checkpoints"] = {"lastCommitted": {"step": 40}}
    job = _job(status)
    result, job = _run(job, EVICTED, t=20)
    assert job.status.phase == "Suspended" and result.deletes == ()
    assert "stopped with step 40 committed" in _suspended(job).message
    assert _suspended(job).reason == kueueplan.REASON_PREEMPTED
    # Re-admitted: attempt 2 resumes from the latest commit; no restart was charged.
    result, job = _run(job, ADMITTED, t=30)
    assert job.status.phase == "Starting" and job.status.attempt == 2
    assert (job.status.restarts or 0) == 0 and (job.status.restarts_count_towards_max or 0) == 0
    pod = next(c for c in result.creates if c["kind"] == "Pod")
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["CAIRN_RESUME_FROM"] == "latest"


def test_user_suspend_still_wins_for_a_queued_job() -> None:
    result, job = _run(_job(suspend=True), ADMITTED)
    assert job.status.phase == "Suspended"
    assert _suspended(job).reason == conditions.REASON_SUSPENDED
    assert result.creates == ()


def test_queued_job_of_another_controller_is_left_alone() -> None:
    result, _ = _run(_job(managedBy="example.com/other"), None)
    assert result.empty


# --- the desired Workload --------------------------------------------------------


def test_desired_workload_whole_object() -> None:
    job = _job(labels={kueueplan.QUEUE_LABEL: QUEUE, kueueplan.PRIORITY_LABEL: "high"})
    template = {"metadata": {"labels": {"a": "b"}}, "spec": {"containers": []}}
    body = kueueplan.desired_workload(
        job=job, owner=builders.owner_reference(job), template=template, priority=("high", 1000)
    )
    assert body == {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "Workload",
        "metadata": {
            "name": kueueplan.workload_name(job),
            "namespace": "ml",
            "labels": {"cairn.dev/job-name": "demo"},
            "ownerReferences": [
                {
                    "apiVersion": "cairn.dev/v1alpha1",
                    "kind": "TrainingJob",
                    "name": "demo",
                    "uid": "uid-1",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "queueName": QUEUE,
            "podSets": [{"name": "trainer", "count": 2, "template": template}],
            "active": True,
            "priorityClassRef": {
                "group": "kueue.x-k8s.io",
                "kind": "WorkloadPriorityClass",
                "name": "high",
            },
            "priority": 1000,
        },
    }


def test_workload_template_is_the_pod_the_job_would_run() -> None:
    job = _job(resources={"requests": {"cpu": "1"}})
    pod = builders.pod(job, attempt=1, rank=0, resume=podenv.ResumeTarget(kind="latest"))
    template = kueueplan.pod_template(pod)
    assert template["spec"]["containers"][0]["resources"] == {"requests": {"cpu": "1"}}
    assert "name" not in template["metadata"] and "ownerReferences" not in template["metadata"]


def test_desired_workload_refuses_an_unqueued_job() -> None:
    with pytest.raises(ValueError, match="queue-name"):
        kueueplan.desired_workload(job=_job(labels={}), owner={}, template={}, priority=None)


def test_workload_name_is_per_object_and_bounded() -> None:
    first = _job()
    assert kueueplan.workload_name(first) == kueueplan.workload_name(_job())
    other = trainingjob.TrainingJob.model_validate(
        {**jobs.body(), "metadata": {"name": "demo", "namespace": "ml", "uid": "uid-2"}}
    )
    assert kueueplan.workload_name(other) != kueueplan.workload_name(first)
    longest = trainingjob.TrainingJob.model_validate(
        {**jobs.body(), "metadata": {"name": "n" * 45, "namespace": "ml", "uid": "u"}}
    )
    assert len(kueueplan.workload_name(longest)) <= 63  # also a valid label value


# --- parsing and patches ---------------------------------------------------------


def test_parse_admitted_and_evicted() -> None:
    admitted = kueueplan.parse_workload(ADMITTED)
    assert (admitted.admitted, admitted.quota_reserved, admitted.evicted) == (True, True, None)
    assert admitted.flavors == ("gpu-a",) and admitted.resource_version == "42"
    evicted = kueueplan.parse_workload(EVICTED)
    assert evicted.evicted == ("Preempted", "Preempted to accommodate a workload")
    pending = kueueplan.parse_workload(PENDING)
    assert not pending.quota_reserved and pending.waiting.startswith("couldn't assign")


def test_release_patch_gives_the_quota_back() -> None:
    now = datetime.datetime(2026, 11, 22, 12, 0, 5, tzinfo=datetime.UTC)
    patch = kueueplan.release_patch(kueueplan.parse_workload(EVICTED), now=now)
    assert patch is not None
    assert patch["metadata"] == {"resourceVersion": "42"}
    assert patch["status"]["admission"] is None
    by_type = {c["type"]: c for c in patch["status"]["conditions"]}
    assert by_type[kueueplan.QUOTA_RESERVED]["status"] == "False"
    assert by_type[kueueplan.QUOTA_RESERVED]["lastTransitionTime"] == "2026-11-22T12:00:05Z"
    assert (by_type[kueueplan.ADMITTED]["status"], by_type[kueueplan.ADMITTED]["reason"]) == (
        "False",
        kueueplan.NO_RESERVATION,
    )
    assert (by_type[kueueplan.REQUEUED]["status"], by_type[kueueplan.REQUEUED]["reason"]) == (
        "True",
        "Preempted",
    )
    # Evicted stays as Kueue wrote it (Kueue resets it at the next admission).
    assert by_type[kueueplan.EVICTED]["lastTransitionTime"] == "2026-11-22T11:00:00Z"


def test_release_patch_only_for_an_evicted_reservation() -> None:
    now = jobs.T0
    assert kueueplan.release_patch(kueueplan.parse_workload(ADMITTED), now=now) is None
    released = _raw_workload(
        _cond(kueueplan.QUOTA_RESERVED, "False"),
        _cond(kueueplan.EVICTED, "True", "Preempted"),
        admission=False,
    )
    assert kueueplan.release_patch(kueueplan.parse_workload(released), now=now) is None


def test_finished_patch_once() -> None:
    workload = kueueplan.parse_workload(ADMITTED)
    patch = kueueplan.finished_patch(workload, succeeded=True, message="done", now=jobs.T0)
    assert patch is not None
    [finished] = [c for c in patch["status"]["conditions"] if c["type"] == kueueplan.FINISHED]
    assert (finished["status"], finished["reason"]) == ("True", "Succeeded")
    done = _raw_workload(_cond(kueueplan.FINISHED, "True", "Succeeded"))
    assert (
        kueueplan.finished_patch(
            kueueplan.parse_workload(done), succeeded=True, message="", now=jobs.T0
        )
        is None
    )


# --- priority boost ----------------------------------------------------------------


def _boosted(
    *, started: float | None, step: int | None, committed: tuple[int, float] | None
) -> trainingjob.TrainingJob:
    status: dict[str, Any] = {}
    if started is not None:
        status["attemptStartTime"] = jobs.at(started).isoformat()
    if step is not None:
        status["step"] = step
    if committed is not None:
        status["checkpoints"] = {
            "lastCommitted": {"step": committed[0], "time": jobs.at(committed[1]).isoformat()}
        }
    return _job(status)


@pytest.mark.parametrize(
    ("started", "step", "committed", "t", "expected"),
    [
        pytest.param(None, None, None, 600, 0, id="not-started"),
        pytest.param(0, 50, (50, 100), 1000, 0, id="no-step-since-commit"),
        pytest.param(0, None, None, 1000, 0, id="step-unknown"),
        pytest.param(0, 60, (50, 100), 159, 0, id="first-bucket"),
        pytest.param(0, 60, (50, 100), 160, 1, id="one-minute"),
        pytest.param(0, 60, (50, 100), 100 + 600 + 30, 10, id="ten-minutes"),
        pytest.param(0, 60, (50, 100), 100 + 10**6, 100, id="capped"),
        pytest.param(500, 60, (50, 100), 700, 3, id="attempt-start-after-commit"),
        pytest.param(0, 10, None, 180, 3, id="never-committed"),
    ],
)
def test_boost_follows_uncommitted_work(
    started: float | None,
    step: int | None,
    committed: tuple[int, float] | None,
    t: float,
    expected: int,
) -> None:
    job = _boosted(started=started, step=step, committed=committed)
    assert kueueboost.boost(job, now=jobs.at(t)) == expected


def test_boost_resets_at_a_commit_and_does_not_churn() -> None:
    before = _boosted(started=0, step=90, committed=(50, 0))
    values = [kueueboost.boost(before, now=jobs.at(t)) for t in range(0, 300, 7)]
    assert values == sorted(values) and len(set(values)) == 5  # 0..4, one change per minute
    after = _boosted(started=0, step=91, committed=(90, 299))
    assert kueueboost.boost(after, now=jobs.at(300)) == 0


def test_next_boost_change_is_the_bucket_edge() -> None:
    job = _boosted(started=0, step=60, committed=(50, 100))
    assert kueueboost.next_boost_change(job, now=jobs.at(130)) == pytest.approx(30)
    assert kueueboost.next_boost_change(job, now=jobs.at(100 + 10**6)) is None
    assert (
        kueueboost.next_boost_change(_boosted(started=None, step=None, committed=None), now=jobs.T0)
        is None
    )


def test_custom_policy_and_its_limits() -> None:
    policy = kueueboost.BoostPolicy(bucket_seconds=10, per_bucket=5, max_boost=20)
    job = _boosted(started=0, step=60, committed=(50, 100))
    assert kueueboost.boost(job, now=jobs.at(125), policy=policy) == 10
    assert kueueboost.boost(job, now=jobs.at(1000), policy=policy) == 20
    with pytest.raises(ValueError, match="bucket_seconds"):
        kueueboost.BoostPolicy(bucket_seconds=0)


def test_boost_patch() -> None:
    assert kueueboost.boost_patch(None, 0) is None
    assert kueueboost.boost_patch("3", 3) is None
    assert kueueboost.boost_patch(None, 4) == {
        "metadata": {"annotations": {kueueplan.BOOST_ANNOTATION: "4"}}
    }
    assert kueueboost.boost_patch("4", 0) == {
        "metadata": {"annotations": {kueueplan.BOOST_ANNOTATION: None}}
    }


def _ready(raw: dict[str, Any], phase: str) -> tuple[str, str] | None:
    patch = kueueplan.pods_ready_patch(kueueplan.parse_workload(raw), phase=phase, now=jobs.T0)
    if patch is None:
        return None
    [ready] = [c for c in patch["status"]["conditions"] if c["type"] == kueueplan.PODS_READY]
    return ready["status"], ready["reason"]


def test_pods_ready_follows_the_phase() -> None:
    assert _ready(ADMITTED, "Starting") == ("False", "WaitForStart")
    assert _ready(ADMITTED, "Running") == ("True", "Started")
    started = _raw_workload(
        _cond(kueueplan.QUOTA_RESERVED, "True"),
        _cond(kueueplan.ADMITTED, "True"),
        _cond(kueueplan.PODS_READY, "True", "Started"),
    )
    assert _ready(started, "Running") is None  # no churn
    assert _ready(started, "Restarting") == ("False", "WaitForRecovery")
    recovering = _raw_workload(
        _cond(kueueplan.QUOTA_RESERVED, "True"),
        _cond(kueueplan.ADMITTED, "True"),
        _cond(kueueplan.PODS_READY, "False", "WaitForRecovery"),
    )
    assert _ready(recovering, "Starting") is None
    assert _ready(recovering, "Running") == ("True", "Recovered")


def test_pods_ready_untouched_unless_admitted() -> None:
    assert _ready(PENDING, "Running") is None
    assert _ready(EVICTED, "Starting") is None
    assert _ready(ADMITTED, "Suspended") is None
