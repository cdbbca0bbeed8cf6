"""Every failure is visible: what the API server or the node refuses shows up on the job.

Covers, against the devcluster (real API server, scheduler, node agent):
- a pod spec the API server refuses (422: cpu request above its limit) fails
  the job with reason InvalidPodSpec, the server's message, and a
  FailedCreate Warning; no retry loop;
- a missing credentials Secret: pods in CreateContainerConfigError, the job
  says so in PodsNotStarting and its Ready message, and a Warning;
- a missing PVC: the scheduler's Unschedulable message on the job;
- an unmatched nodeSelector: the scheduler's message on the job;
- startupDeadlineSeconds ends a stuck attempt (StartupDeadlineExceeded);
- progressDeadlineSeconds: a job that never reports a step gets
  ProgressStalled and a counted restart;
- a rank that exits 78 with a termination message: Failed at once,
  ConfigurationError, the message in lastFailure (read by the node agent from
  the container's terminationMessagePath), nothing counted;
- the schema refuses what it can (quantities, mountPath) before any pod.
Each test prints `MEASURE <case> <seconds>`: create -> the condition (or
Failed), for the closing report (no timed assertions).
"""

import time
from typing import Any

import pytest
from kubernetes.client.rest import ApiException

from tests.integration.operator.conftest import SLEEP_FOREVER, Kube, job_body

pytestmark = pytest.mark.cluster


def _condition(status: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions") or () if c["type"] == kind), None)


def _true(kind: str, reason: str | None = None) -> Any:
    def check(status: dict[str, Any]) -> bool:
        found = _condition(status, kind)
        return (
            found is not None
            and found["status"] == "True"
            and (reason is None or found["reason"] == reason)
        )

    return check


def _measure(case: str, started: float) -> None:
    print(f"MEASURE {case} {time.monotonic() - started:.1f}")


def test_invalid_pod_spec_fails_the_job(kube: Kube) -> None:
    started = time.monotonic()
    kube.create(
        job_body(
            "badres",
            script=SLEEP_FOREVER,
            nodes=1,
            resources={"requests": {"cpu": "2"}, "limits": {"cpu": "1"}},
        )
    )
    status = kube.wait_phase("badres", "Failed")
    _measure("invalid-pod-spec-422", started)
    failed = _condition(status, "Failed")
    assert failed is not None and failed["reason"] == "InvalidPodSpec"
    assert "must be less than or equal to cpu limit" in failed["message"]
    assert _true("PodsNotStarting", "FailedCreate")(status)
    event = kube.wait_event("badres", "FailedCreate", contains="cpu limit")
    assert event.type == "Warning"
    kube.wait_event("badres", "InvalidPodSpec")
    assert kube.pods("badres") == []
    assert status["restarts"] == 0


def test_missing_credentials_secret_is_shown(kube: Kube) -> None:
    started = time.monotonic()
    kube.create(
        job_body(
            "nosecret",
            script=SLEEP_FOREVER,
            nodes=1,
            checkpoint={
                "upload": {
                    "uri": "s3://cairn-test/nosecret",
                    "credentialsSecretRef": {"name": "no-such-secret"},
                }
            },
        )
    )
    status = kube.wait_status(
        "nosecret", "PodsNotStarting", _true("PodsNotStarting", "CreateContainerConfigError")
    )
    _measure("missing-secret", started)
    stuck = _condition(status, "PodsNotStarting")
    assert stuck is not None and "no-such-secret" in stuck["message"]
    ready = _condition(status, "Ready")
    assert ready is not None and "CreateContainerConfigError" in ready["message"]
    assert status["phase"] == "Starting"
    kube.wait_event("nosecret", "CreateContainerConfigError", contains="no-such-secret")


def test_missing_pvc_shows_the_scheduler_message(kube: Kube) -> None:
    started = time.monotonic()
    kube.create(
        job_body(
            "nopvc",
            script=SLEEP_FOREVER,
            nodes=1,
            checkpoint={"volume": {"persistentVolumeClaim": {"claimName": "no-such-claim"}}},
        )
    )
    status = kube.wait_status("nopvc", "Unschedulable", _true("PodsNotStarting", "Unschedulable"))
    _measure("missing-pvc", started)
    stuck = _condition(status, "PodsNotStarting")
    assert stuck is not None and "no-such-claim" in stuck["message"]
    kube.wait_event("nopvc", "Unschedulable", contains="no-such-claim")


def test_unmatched_node_selector_shows_the_scheduler_message(kube: Kube) -> None:
    started = time.monotonic()
    kube.create(
        job_body(
            "nowhere",
            script=SLEEP_FOREVER,
            nodes=1,
            template={"nodeSelector": {"cairn.dev/test-pool": "does-not-exist"}},
        )
    )
    status = kube.wait_status("nowhere", "Unschedulable", _true("PodsNotStarting", "Unschedulable"))
    _measure("unschedulable-selector", started)
    stuck = _condition(status, "PodsNotStarting")
    assert stuck is not None and "nodes are available" in stuck["message"]


def test_startup_deadline_ends_a_stuck_attempt(kube: Kube) -> None:
    started = time.monotonic()
    kube.create(
        job_body(
            "stuck",
            script=SLEEP_FOREVER,
            nodes=1,
            startupDeadlineSeconds=10,
            restartPolicy={"maxRestarts": 0},
            env=[
                {
                    "name": "TOKEN",
                    "valueFrom": {"secretKeyRef": {"name": "absent", "key": "token"}},
                }
            ],
        )
    )
    status = kube.wait_phase("stuck", "Failed")
    _measure("startup-deadline-10s", started)
    failure = status["lastFailure"]
    assert failure["reason"] == "StartupDeadlineExceeded"
    assert failure["counted"] is True
    assert "CreateContainerConfigError" in failure["message"]
    failed = _condition(status, "Failed")
    assert failed is not None and failed["reason"] == "MaxRestartsExceeded"


def test_progress_deadline_restarts_a_silent_job(kube: Kube) -> None:
    started = time.monotonic()
    kube.create(
        job_body(
            "silent",
            script=SLEEP_FOREVER,
            nodes=1,
            progressDeadlineSeconds=8,
            restartPolicy={"maxRestarts": 1, "backoffSeconds": 1, "maxBackoffSeconds": 2},
        )
    )
    status = kube.wait_status(
        "silent", "ProgressStalled", _true("ProgressStalled", "ProgressDeadlineExceeded")
    )
    _measure("progress-deadline-8s", started)
    assert status["lastFailure"]["reason"] == "ProgressDeadlineExceeded"
    assert status["restartsCountTowardsMax"] == 1
    kube.wait_event("silent", "ProgressDeadlineExceeded")
    status = kube.wait_phase("silent", "Failed")
    assert status["restartsCountTowardsMax"] == 2
    assert status["lastFailure"]["reason"] == "ProgressDeadlineExceeded"


CONFIG_ERROR_SCRIPT = (
    "import sys, time\n"
    "time.sleep(1)\n"
    "open('/dev/termination-log', 'w').write("
    "'resume.step 40: no committed checkpoint at that step')\n"
    "sys.exit(78)\n"
)


def test_config_error_fails_at_once_with_the_message(kube: Kube) -> None:
    started = time.monotonic()
    kube.create(
        job_body(
            "cfgerr",
            script=CONFIG_ERROR_SCRIPT,
            nodes=2,
            restartPolicy={"maxRestarts": 5, "backoffSeconds": 1},
        )
    )
    status = kube.wait_phase("cfgerr", "Failed")
    _measure("config-error-exit-78", started)
    failure = status["lastFailure"]
    assert failure["reason"] == "ConfigurationError"
    assert failure["counted"] is False
    assert failure["exitCode"] == 78
    assert "no committed checkpoint at that step" in failure["message"]
    assert status["restarts"] == 0 and status["attempt"] == 1
    failed = _condition(status, "Failed")
    assert failed is not None and failed["reason"] == "ConfigurationError"
    assert "no committed checkpoint at that step" in failed["message"]
    kube.wait_event("cfgerr", "ConfigurationError", contains="no committed checkpoint")
    # The node agent put what the container wrote into the pod's status, as the kubelet does.
    messages = [
        p.status.container_statuses[0].state.terminated.message
        for p in kube.pods("cfgerr")
        if p.status.container_statuses and p.status.container_statuses[0].state.terminated
    ]
    assert "resume.step 40: no committed checkpoint at that step" in messages


@pytest.mark.parametrize(
    ("case", "spec", "field"),
    [
        ("cpu-lots", {"resources": {"requests": {"cpu": "lots"}}}, "spec.resources.requests"),
        ("memory-negative", {"resources": {"limits": {"memory": "-1Gi"}}}, "spec.resources"),
        (
            "mount-dotdot",
            {"checkpoint": {"mountPath": "/checkpoints/../etc"}},
            "spec.checkpoint.mountPath",
        ),
        ("mount-root", {"checkpoint": {"mountPath": "/"}}, "spec.checkpoint.mountPath"),
    ],
)
def test_schema_refuses_before_any_pod(
    kube: Kube, case: str, spec: dict[str, Any], field: str
) -> None:
    with pytest.raises(ApiException) as caught:
        kube.create(job_body(f"refused-{case}", script=SLEEP_FOREVER, nodes=1, **spec))
    assert caught.value.status == 422
    assert field in caught.value.body
    assert kube.pods(f"refused-{case}") == []
