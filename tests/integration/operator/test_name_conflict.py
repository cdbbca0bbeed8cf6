"""Adopt only your own: an object with a child's name that this job does not own.

Covers: a Service named like the job, created before the job (so the job's
headless Service gets 409): the job is not adopted into it; it reports the
NameConflict condition and a Warning event naming the Service, creates no
pod (rendezvous would hang behind a foreign Service), and starts normally once
the user deletes the foreign Service.
"""

import time

import pytest
from kubernetes import client

from tests.integration.operator.conftest import SLEEP_FOREVER, Kube, job_body

pytestmark = pytest.mark.cluster


def test_preexisting_service_is_a_name_conflict(kube: Kube) -> None:
    foreign = client.V1Service(
        metadata=client.V1ObjectMeta(name="clash", labels={"team": "someone-else"}),
        spec=client.V1ServiceSpec(
            selector={"app": "web"}, ports=[client.V1ServicePort(port=80, target_port=8080)]
        ),
    )
    kube.core.create_namespaced_service(kube.namespace, foreign)
    started = time.monotonic()
    kube.create(job_body("clash", script=SLEEP_FOREVER, nodes=1))

    def conflicted(status: dict[str, object]) -> bool:
        return any(
            c["type"] == "NameConflict" and c["status"] == "True"
            for c in status.get("conditions") or ()  # type: ignore[attr-defined]
        )

    status = kube.wait_status("clash", "NameConflict", conflicted)
    print(f"MEASURE name-conflict {time.monotonic() - started:.1f}")
    condition = next(c for c in status["conditions"] if c["type"] == "NameConflict")
    assert "Service clash" in condition["message"]
    assert status["phase"] == "Starting"
    event = kube.wait_event("clash", "NameConflict", contains="Service clash")
    assert event.type == "Warning"
    assert kube.pods("clash") == [], "no pod starts behind a foreign Service"
    service = kube.core.read_namespaced_service("clash", kube.namespace)
    assert not service.metadata.owner_references, "the foreign Service was not adopted"
    assert service.spec.selector == {"app": "web"}

    kube.core.delete_namespaced_service("clash", kube.namespace)
    kube.wait_phase("clash", "Running", attempt=1, timeout=90)
    status = kube.status("clash")
    condition = next(c for c in status["conditions"] if c["type"] == "NameConflict")
    assert condition["status"] == "False"
    owned = kube.core.read_namespaced_service("clash", kube.namespace)
    assert owned.metadata.owner_references[0].kind == "TrainingJob"
