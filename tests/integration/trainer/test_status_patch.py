"""The writer's status patches, applied by the real API server, leave no stale field.

A merge patch keeps every key it does not mention, so the reporter sends
null for what the writer no longer has. Covers, against the devcluster's
kube-apiserver and the generated CRD: once the last in-flight save is done,
`checkpoints.inFlight` is gone; a commit without a measured stall does not
inherit the previous step's `stallSeconds`; lists are replaced whole; a new
attempt's writer that has not committed yet leaves the previous attempt's
records standing; the operator's fields (`status.phase`) are untouched.
"""

import datetime
from collections.abc import Iterator

import pytest
from kubernetes import client

from cairn.api import jobstatus, trainingjob
from cairn.checkpoint import status_reporter
from tests import demo
from tests.conftest import DevclusterHandle
from tests.integration.devcluster import kube_helpers

pytestmark = pytest.mark.cluster

T0 = datetime.datetime(2026, 11, 23, tzinfo=datetime.UTC)


def _job() -> dict[str, object]:
    return {
        "apiVersion": trainingjob.API_VERSION,
        "kind": "TrainingJob",
        "metadata": {"name": "reported"},
        # Another controller's job: the shared Cairn operator neither creates
        # pods nor writes the operator's fields this test sets itself.
        "spec": {
            "suspend": True,
            "nodes": 1,
            "image": "cairn-trainer:dev",
            "managedBy": "example.com/not-cairn",
        },
    }


@pytest.fixture
def namespace(devcluster: DevclusterHandle) -> Iterator[str]:
    yield from kube_helpers.temp_namespace(devcluster.core, "report")


def test_cleared_fields_are_gone_on_the_server(
    devcluster: DevclusterHandle, namespace: str
) -> None:
    demo.install_crd(devcluster.api_client)
    custom = client.CustomObjectsApi(devcluster.api_client)
    group, version = trainingjob.API_VERSION.split("/")
    custom.create_namespaced_custom_object(group, version, namespace, trainingjob.PLURAL, _job())
    # The operator's field, set the way the operator sets it.
    custom.patch_namespaced_custom_object_status(
        group,
        version,
        namespace,
        trainingjob.PLURAL,
        "reported",
        {"status": {"phase": "Suspended"}},
        _content_type="application/merge-patch+json",
    )
    patch = status_reporter.kubernetes_patcher(
        api_client=devcluster.api_client, namespace=namespace, name="reported"
    )
    during = jobstatus.CheckpointsStatus(
        last_committed=jobstatus.CommittedCheckpoint(
            step=5, time=T0, bytes=100, write_seconds=0.5, stall_seconds=0.01
        ),
        in_flight=[jobstatus.InFlightCheckpoint(step=10, stage="staging", since=T0)],
        history=[
            jobstatus.CheckpointRecord(step=5, state="committed", time=T0, bytes=100),
        ],
    )
    patch(status_reporter.status_body(step=10, checkpoints=during))
    after = jobstatus.CheckpointsStatus(
        last_committed=jobstatus.CommittedCheckpoint(step=10, time=T0, write_seconds=0.4),
        history=[
            jobstatus.CheckpointRecord(step=10, state="committed", time=T0),
            jobstatus.CheckpointRecord(step=5, state="rotated", time=T0, bytes=100),
        ],
    )
    patch(status_reporter.status_body(step=11, checkpoints=after))
    # Attempt 2's writer, resumed, before its first commit.
    resumed = jobstatus.CheckpointsStatus(
        resumed_from=jobstatus.ResumedFrom(step=10, attempt=2, source="local")
    )
    patch(status_reporter.status_body(step=10, checkpoints=resumed))

    status = custom.get_namespaced_custom_object(
        group, version, namespace, trainingjob.PLURAL, "reported"
    )["status"]
    checkpoints = status["checkpoints"]
    assert "inFlight" not in checkpoints
    assert checkpoints["lastCommitted"] == {
        "step": 10,
        "time": "2026-11-23T00:00:00Z",
        "writeSeconds": 0.4,
    }
    assert checkpoints["history"] == [
        {"step": 10, "state": "committed", "time": "2026-11-23T00:00:00Z"},
        {"step": 5, "state": "rotated", "time": "2026-11-23T00:00:00Z", "bytes": 100},
    ]
    assert checkpoints["resumedFrom"] == {"step": 10, "attempt": 2, "source": "local"}
    assert status["step"] == 10
    assert status["phase"] == "Suspended"
    # What a next attempt's writer reads back through the API to go on from.
    read = status_reporter.read_checkpoints(
        api_client=devcluster.api_client, namespace=namespace, name="reported"
    )
    assert read is not None
    assert [(r.step, r.state) for r in read.history or []] == [(10, "committed"), (5, "rotated")]
    assert read.last_committed is not None and read.last_committed.step == 10
