"""observe: raw pod and job dicts become the values plan() decides on.

Covers: attempt/rank from labels, the trainer's exit code and reason,
DisruptionTarget, Ready, deletionTimestamp, foreign pods ignored, ordering;
a semantically invalid job parses into InvalidJob naming the field.
"""

from typing import Any

from cairn.operator import observe

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
    assert observe.parse_pod(raw) == observe.ObservedPod(
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
    seen = observe.observe(
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
    parsed = observe.parse_job(raw)
    assert isinstance(parsed, observe.InvalidJob)
    assert "spec.nodes" in parsed.error
    assert parsed.metadata.name == "demo"
