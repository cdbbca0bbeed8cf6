"""Ownership, not labels: a pod that only carries a job's labels never steers it.

Against the devcluster's API server (restricted Pod Security enforced in the
namespace) and the shared operator. Covers:

- beside a running job, a decoy the operator never made (labels
  ``cairn.dev/job-name=<job>``, ``cairn.dev/attempt: "99"``,
  ``cairn.dev/rank: "0"``, an impossible nodeSelector, restricted securityContext,
  no ownerReference) and an impostor (the job as its controller ownerReference,
  a name the operator never gives): each is reported once, a Warning
  ``ForeignPod`` Event naming it; suspending the job still reaches Suspended
  with the job's own pods gone, both strangers untouched and not reported again;
- deleting the job with ``onDelete: Delete`` (the handler deletes the job's pods
  and waits for them before emptying its S3 prefix) leaves the decoy alone;
- a queued job (Kueue): suspending it while admitted deactivates its
  Workload, and the operator still releases the quota with a decoy live.
"""

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from cairn.devcluster import kueue
from cairn.operator.core import kueueplan as protocol
from cairn.operator.core import podowner
from tests.integration.devcluster import kube_helpers as kh
from tests.integration.operator import kueue_helpers as kq
from tests.integration.operator.conftest import (
    GROUP,
    LABEL_JOB,
    PLURAL,
    SLEEP_FOREVER,
    VERSION,
    WAIT,
    Kube,
    job_body,
)

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted"}
SECRET = "s3-creds"


def _stranger(
    name: str, *, job: str, rank: str, owner: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A pod the operator never made, with the job's labels; it never schedules."""
    metadata: dict[str, Any] = {
        "name": name,
        "labels": {LABEL_JOB: job, "cairn.dev/attempt": "99", "cairn.dev/rank": rank},
    }
    if owner is not None:
        metadata["ownerReferences"] = [owner]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {
            "nodeSelector": {"cairn.dev/no-such-node": "true"},
            "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [
                {
                    "name": "trainer",
                    "image": "cairn-trainer:dev",
                    "command": ["python", "-c", SLEEP_FOREVER],
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "capabilities": {"drop": ["ALL"]},
                    },
                }
            ],
        },
    }


def _controller(job: dict[str, Any]) -> dict[str, Any]:
    """The job as controller ownerReference (no blockOwnerDeletion: any pod creator may)."""
    meta = job["metadata"]
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainingJob",
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
    }


def _untouched(kube: Kube, name: str) -> None:
    pod = kube.core.read_namespaced_pod(name, kube.namespace)
    assert pod.metadata.deletion_timestamp is None, f"{name} is being deleted"


def _reports(kube: Kube, job: str, pod: str) -> list[Any]:
    return [
        e
        for e in kube.events(job)
        if e.reason == podowner.REASON_FOREIGN_POD and e.message.startswith(f"pod {pod} ")
    ]


@pytest.fixture
def bucket(kube: Kube) -> Iterator[str]:
    """An empty bucket, and the Secret with the devcluster's S3 key pair."""
    creds = kube.handle.s3_credentials
    name = f"foreign-{uuid.uuid4().hex[:10]}"
    s3: Any = kube.handle.target.s3_client()
    s3.create_bucket(Bucket=name)
    kube.core.create_namespaced_secret(
        kube.namespace,
        client.V1Secret(
            metadata=client.V1ObjectMeta(name=SECRET),
            string_data={
                "AWS_ACCESS_KEY_ID": creds.access_key,
                "AWS_SECRET_ACCESS_KEY": creds.secret_key,
            },
        ),
    )
    try:
        yield name
    finally:
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket=name)
        for page in pages:
            for item in page.get("Contents", []):
                s3.delete_object(Bucket=name, Key=item["Key"])
        s3.delete_bucket(Bucket=name)


def test_strangers_neither_block_suspend_nor_die_with_the_job(kube: Kube, bucket: str) -> None:
    kube.core.patch_namespace(kube.namespace, {"metadata": {"labels": RESTRICTED}})
    checkpoint = {
        "upload": {
            "uri": f"s3://{bucket}/run",
            "endpoint": kube.handle.s3_pod_endpoint,
            "credentialsSecretRef": {"name": SECRET},
        },
        "onDelete": "Delete",
    }
    job = kube.create(job_body("owned", script=SLEEP_FOREVER, checkpoint=checkpoint))
    kube.wait_phase("owned", "Running", attempt=1)
    kube.wait_pods_running("owned", attempt=1, count=2)

    decoy = _stranger("decoy", job="owned", rank="0")
    impostor = _stranger("impostor", job="owned", rank="1", owner=_controller(job))
    for body in (decoy, impostor):
        kube.core.create_namespaced_pod(kube.namespace, body)  # restricted admission passes it
    kube.wait_event("owned", podowner.REASON_FOREIGN_POD, contains="pod decoy ")
    kube.wait_event("owned", podowner.REASON_FOREIGN_POD, contains="pod impostor ")

    # Both ranks stay; the job is not frozen by an "attempt 99" ahead of its status.
    kube.patch_spec("owned", {"suspend": True})
    status = kube.wait_phase("owned", "Suspended", timeout=WAIT)
    assert status["attempt"] == 1
    kh.wait_for(lambda: not kube.pods("owned", attempt=1), timeout=WAIT, what="own pods gone")
    for name in ("decoy", "impostor"):
        _untouched(kube, name)
        [report] = _reports(kube, "owned", name)  # once, though many reconciles ran since
        assert report.type == "Warning" and report.count == 1
        assert "ignored" in report.message
    assert "no controller ownerReference" in _reports(kube, "owned", "decoy")[0].message
    assert "owned-a99-n1" in _reports(kube, "owned", "impostor")[0].message

    # onDelete: Delete deletes the job's pods (and waits for them) before the
    # S3 cleanup; the decoy is not the job's and stays.
    kube.custom.delete_namespaced_custom_object(GROUP, VERSION, kube.namespace, PLURAL, "owned")

    def job_gone() -> bool:
        try:
            kube.job("owned")
        except ApiException as error:
            if error.status == 404:
                return True
            raise
        return False

    kh.wait_for(job_gone, timeout=WAIT, what="the job deleted")
    _untouched(kube, "decoy")


@pytest.fixture
def qkube(kube: Kube) -> Iterator[Kube]:
    kq.kueue_ready(kube.handle.target)
    kueue.ensure_queues(
        kube.handle.target, namespace=kube.namespace, quota={"cpu": "1", "memory": "1Gi"}
    )
    yield kube
    kq.drain(kube.api_client, kube.namespace)


def test_kueue_releases_the_quota_with_a_decoy_present(qkube: Kube) -> None:
    requests = {"requests": {"cpu": "500m", "memory": "64Mi"}}
    qkube.create(kq.queued(job_body("queued", script=SLEEP_FOREVER, resources=requests)))
    qkube.wait_phase("queued", "Running", attempt=1)
    qkube.core.create_namespaced_pod(qkube.namespace, _stranger("decoy", job="queued", rank="0"))
    qkube.wait_event("queued", podowner.REASON_FOREIGN_POD, contains="pod decoy ")

    qkube.patch_spec("queued", {"suspend": True})
    qkube.wait_phase("queued", "Suspended")
    kq.wait_workload(
        qkube.api_client,
        qkube.namespace,
        "queued",
        lambda w: w["spec"].get("active") is False and "admission" not in (w.get("status") or {}),
        what="inactive with its quota released",
    )
    # Released by the operator (a fresh list of the job's own pods found none).
    qkube.wait_event("queued", protocol.REASON_QUOTA_RELEASED)
    _untouched(qkube, "decoy")
