"""Suspend and resume, and which spec fields may change when.

Covers: while the job runs, the API server (CEL) rejects a change of
run-defining fields (spec.nodes, spec.command) with a message that says
they can only change while suspended; `suspend: true` deletes the pods →
Suspending → Suspended (Suspended condition, startTime cleared,
observedGeneration current, event Suspended); while suspended the same
fields are editable; `suspend: false` starts attempt 2 with the edited spec
(3 pods running the new command), with the event Resumed.
"""

import pytest
from kubernetes.client.rest import ApiException

from tests.integration.operator.conftest import SLEEP_FOREVER, JobWatch, Kube, job_body

pytestmark = pytest.mark.cluster

NEW_COMMAND = ["python", "-c", "import time; time.sleep(601)"]


def _rejected(kube: Kube, spec: dict[str, object], field: str) -> None:
    with pytest.raises(ApiException) as caught:
        kube.patch_spec("sus", spec)
    assert caught.value.status == 422
    assert f"spec.{field} can only change while the job is suspended" in caught.value.body


def test_suspend_and_resume(kube: Kube) -> None:
    created = kube.create(job_body("sus", script=SLEEP_FOREVER))
    recorder = JobWatch(kube, "sus", resource_version=created["metadata"]["resourceVersion"])
    try:
        kube.wait_phase("sus", "Running", attempt=1)
        kube.wait_pods_running("sus", attempt=1, count=2)

        _rejected(kube, {"nodes": 3}, "nodes")
        _rejected(kube, {"command": NEW_COMMAND}, "command")

        kube.patch_spec("sus", {"suspend": True})
        status = kube.wait_phase("sus", "Suspended")
        kube.wait_no_pods("sus")
        assert status["attempt"] == 1
        assert "startTime" not in status
        suspended = next(c for c in status["conditions"] if c["type"] == "Suspended")
        assert (suspended["status"], suspended["reason"]) == ("True", "Suspended")
        event = kube.wait_event("sus", "Suspended")
        assert event.type == "Normal"
        job = kube.job("sus")
        assert job["status"]["observedGeneration"] == job["metadata"]["generation"]

        kube.patch_spec("sus", {"nodes": 3, "command": NEW_COMMAND})
        kube.patch_spec("sus", {"suspend": False})
        status = kube.wait_phase("sus", "Running", attempt=2)
        pods = kube.wait_pods_running("sus", attempt=2, count=3)
        assert [p.metadata.name for p in pods] == ["sus-a2-n0", "sus-a2-n1", "sus-a2-n2"]
        assert all(p.spec.containers[0].command == NEW_COMMAND for p in pods)
        assert status["restarts"] == 0
        assert status["restartsCountTowardsMax"] == 0
        assert status["startTime"]
        resumed = kube.wait_event("sus", "Resumed", contains="attempt 2")
        assert resumed.type == "Normal"
    finally:
        recorder.stop()
    phases = [s.get("phase") for s in recorder.statuses()]
    assert "Suspending" in phases, phases
