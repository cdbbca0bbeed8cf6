"""Status integrity: the API server refuses the trainer token's writes to operator fields.

Covers, with a real TokenRequest token of the ``<job>-trainer`` ServiceAccount
(the operator's per-job Role lets it patch its own job's /status) and the
``ValidatingAdmissionPolicy`` from ``crds/`` installed with the CRD: patching
``status.step`` and ``status.checkpoints`` passes; patching ``phase``,
``attempt`` or ``restarts``, adding an operator field (``completionTime``),
removing one, or asserting ``checkpoints.lastUploaded.verified: true`` is
refused (403 from the policy, the message names the field) and leaves the job as it
was; the operator (admin credentials here) still writes ``phase``. Only rank 0
mounts the token (pods of a two-node job).
"""

from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from tests.integration.devcluster import kube_helpers as kh
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

pytestmark = pytest.mark.cluster


def _writer(kube: Kube, name: str) -> client.CustomObjectsApi:
    """The job's trainer token, once RBAC has the operator's RoleBinding."""
    custom = client.CustomObjectsApi(kube.as_service_account(f"{name}-trainer"))

    def can_patch() -> bool:
        try:
            _patch(custom, kube.namespace, name, {"step": 1})
        except ApiException as exc:  # the new RoleBinding may not be in RBAC's cache yet
            if exc.status == 403:
                return False
            raise
        return True

    kh.wait_for(can_patch, timeout=WAIT, what="the trainer token patching its own status")
    return custom


def _patch(custom: client.CustomObjectsApi, ns: str, name: str, status: dict[str, Any]) -> None:
    custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, ns, PLURAL, name, {"status": status}, field_manager="cairn-writer"
    )


def _refused(custom: client.CustomObjectsApi, ns: str, name: str, status: dict[str, Any]) -> str:
    with pytest.raises(ApiException) as caught:
        _patch(custom, ns, name, status)
    assert caught.value.status == 403, caught.value
    assert "ValidatingAdmissionPolicy" in str(caught.value.body)
    return str(caught.value.body)


@pytest.fixture
def running(kube: Kube) -> tuple[Kube, str]:
    kube.create(job_body("guarded", script=SLEEP_FOREVER, nodes=2))
    kube.wait_phase("guarded", "Running")
    return kube, "guarded"


def test_trainer_token_writes_step_and_checkpoints(running: tuple[Kube, str]) -> None:
    kube, name = running
    custom = _writer(kube, name)
    _patch(custom, kube.namespace, name, {"step": 42})
    committed = {"step": 40, "time": "2026-11-23T10:00:00Z", "bytes": 10}
    _patch(custom, kube.namespace, name, {"checkpoints": {"lastCommitted": committed}})
    status = kube.status(name)
    assert status["step"] == 42
    assert status["checkpoints"]["lastCommitted"]["step"] == 40


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("phase", "Succeeded"),
        ("attempt", 99),
        ("restarts", 5),
        ("completionTime", "2026-11-23T10:00:00Z"),
    ],
)
def test_trainer_token_cannot_write_operator_fields(
    running: tuple[Kube, str], field: str, value: object
) -> None:
    kube, name = running
    custom = _writer(kube, name)
    before = kube.status(name)  # completionTime: absent while running, so an added field
    body = _refused(custom, kube.namespace, name, {field: value})
    assert f"status.{field}" in body
    after = kube.status(name)
    assert after.get(field) == before.get(field)
    assert after["phase"] == "Running"


def test_trainer_token_cannot_remove_an_operator_field(running: tuple[Kube, str]) -> None:
    kube, name = running
    custom = _writer(kube, name)
    body = _refused(custom, kube.namespace, name, {"attempt": None})
    assert "status.attempt" in body
    assert kube.status(name)["attempt"] >= 1


def test_trainer_token_cannot_assert_verified(running: tuple[Kube, str]) -> None:
    kube, name = running
    custom = _writer(kube, name)
    uploaded = {"step": 5, "uri": "s3://b/p/step-000000005", "verified": True}
    body = _refused(custom, kube.namespace, name, {"checkpoints": {"lastUploaded": uploaded}})
    assert "verified" in body
    uploaded["verified"] = False
    _patch(custom, kube.namespace, name, {"checkpoints": {"lastUploaded": uploaded}})
    assert kube.status(name)["checkpoints"]["lastUploaded"]["step"] == 5


def test_operator_identity_is_not_confined(running: tuple[Kube, str]) -> None:
    kube, name = running
    patched = kube.custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, kube.namespace, PLURAL, name, {"status": {"restartsCountTowardsMax": 1}}
    )
    assert patched["status"]["restartsCountTowardsMax"] == 1


def test_only_rank_zero_mounts_the_token(running: tuple[Kube, str]) -> None:
    kube, name = running
    pods = kube.core.list_namespaced_pod(kube.namespace, label_selector=f"{LABEL_JOB}={name}").items
    mounts = {
        p.metadata.labels["cairn.dev/rank"]: p.spec.automount_service_account_token for p in pods
    }
    assert mounts == {"0": True, "1": False}
