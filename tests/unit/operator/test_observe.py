"""observe: raw pod and job dicts become the values plan() decides on.

Covers: attempt/rank from labels, the trainer's exit code and reason,
DisruptionTarget, Ready, deletionTimestamp, foreign pods ignored, ordering;
a semantically invalid job parses into InvalidJob naming the field.
"""

from typing import Any

from cairn.operator.core import jobobserve

from . import jobs


def _raw(attempt: str, rank: str, **status: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": f"demo-a{attempt}-n{rank}",
            "uid": "u",
            "labels": {"cairn.dev/attempt": attempt, "cairn.dev/rank": rank},
        },
        "spec": {"nodeName": "node-1"},
        "status": status,
    }


def test_failed_pod_with_exit_code_and_disruption() -> None:
    raw = _raw(
        "2",
        "1",
        phase="Failed",
        containerStatuses=[
            {"name": "sidecar", "state": {"terminated": {"exitCode": 9}}},
            {
                "name": "trainer",
                "state": {
                    "terminated": {
                        "exitCode": 137,
                        "reason": "OOMKilled",
                        "finishedAt": "2026-11-22T12:00:05Z",
                    }
                },
            },
        ],
        conditions=[
            {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"},
            {"type": "Ready", "status": "False"},
        ],
    )
    raw["metadata"]["deletionTimestamp"] = "2026-11-22T12:00:06Z"
    assert jobobserve.parse_pod(raw) == jobobserve.ObservedPod(
        name="demo-a2-n1",
        uid="u",
        attempt=2,
        rank=1,
        phase="Failed",
        deleting=True,
        exit_code=137,
        termination_reason="OOMKilled",
        finished_at=jobs.at(5),
        disruption_reason="PreemptionByScheduler",
        node_name="node-1",
        ready=False,
    )


def test_foreign_pods_are_ignored_and_order_is_stable() -> None:
    seen = jobobserve.observe(
        pods=[
            _raw("1", "1", phase="Running", conditions=[{"type": "Ready", "status": "True"}]),
            {"metadata": {"name": "other", "labels": {}}},
            _raw("1", "0", phase="Weird"),
        ],
    )
    assert [(p.attempt, p.rank, p.phase, p.ready) for p in seen.pods] == [
        (1, 0, "Unknown", False),
        (1, 1, "Running", True),
    ]


def test_invalid_job() -> None:
    raw = jobs.body(nodes=0)
    parsed = jobobserve.parse_job(raw)
    assert isinstance(parsed, jobobserve.InvalidJob)
    assert "spec.nodes" in parsed.error
    assert parsed.metadata.name == "demo"


def test_waiting_reason_unschedulable_and_messages() -> None:
    waiting = _raw(
        "1",
        "0",
        phase="Pending",
        initContainerStatuses=[
            {"name": "init", "state": {"waiting": {"reason": "PodInitializing"}}}
        ],
        containerStatuses=[
            {
                "name": "trainer",
                "state": {
                    "waiting": {
                        "reason": "CreateContainerConfigError",
                        "message": 'secret "s3" not found',
                    }
                },
            }
        ],
    )
    pod = jobobserve.parse_pod(waiting)
    assert pod is not None
    assert pod.not_starting == (
        "CreateContainerConfigError",
        'container trainer: secret "s3" not found',
    )
    creating = _raw(
        "1",
        "0",
        phase="Pending",
        containerStatuses=[
            {"name": "trainer", "state": {"waiting": {"reason": "ContainerCreating"}}}
        ],
    )
    parsed = jobobserve.parse_pod(creating)
    assert parsed is not None and parsed.not_starting is None
    unscheduled = _raw(
        "1",
        "1",
        phase="Pending",
        conditions=[
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": '0/2 nodes are available: persistentvolumeclaim "c" not found.',
            }
        ],
    )
    stuck = jobobserve.parse_pod(unscheduled)
    assert stuck is not None
    assert stuck.not_starting == (
        "Unschedulable",
        '0/2 nodes are available: persistentvolumeclaim "c" not found.',
    )


def test_termination_message_and_eviction() -> None:
    raw = _raw(
        "1",
        "0",
        phase="Failed",
        reason="Evicted",
        message="Pod ephemeral local storage usage exceeds the total limit of containers 1Gi. ",
        containerStatuses=[
            {
                "name": "trainer",
                "state": {"terminated": {"exitCode": 78, "message": "bad resume target"}},
            }
        ],
    )
    pod = jobobserve.parse_pod(raw)
    assert pod is not None
    assert (pod.exit_code, pod.termination_message) == (78, "bad resume target")
    assert pod.pod_reason == "Evicted" and "exceeds the total limit" in pod.pod_message
    assert pod.not_starting is None, "a terminated pod is not stuck starting"
