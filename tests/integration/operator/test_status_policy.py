"""Status integrity: the API server refuses writes that are not the job's writer pod's.

Covers, with real TokenRequest tokens bound to pods (as the kubelet binds a
pod's projected token: the API server puts the pod's name in
``userInfo.extra``) and the ``ValidatingAdmissionPolicy`` from ``crds/``
installed with the CRD: the job's rank-0 pod patching ``status.step`` and
``status.checkpoints`` passes; patching ``phase``, ``attempt`` or
``restarts``, adding an operator field (``completionTime``), removing one, or
claiming verification in any writer field (each place the policy names) is
refused (403 from the policy, the message names the field) and leaves the
job as it was. Identity: a token of the job's ServiceAccount bound to no pod,
to a stranger pod, or to a pod named like another attempt's rank 0 is
refused; with one ServiceAccount shared by two jobs, job A's writer pod
cannot write job B's status. The operator (admin credentials here) still
writes ``phase``. Only rank 0 mounts the token (pods of a two-node job).
With the policy (or its binding) deleted, a new job gets
``StatusPolicyMissing`` (condition and Warning Event) and no status Role,
RoleBinding or pod; restored, it starts (the policy is always reinstalled).
"""

import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from cairn.operator import policycheck
from cairn.operator.core import names, statuspolicy
from tests import demo
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


def _writer_pod(kube: Kube, name: str) -> str:
    return names.pod_name(job=name, attempt=kube.status(name)["attempt"], rank=0)


def _writer(kube: Kube, name: str, *, account: str | None = None) -> client.CustomObjectsApi:
    """A token bound to the job's rank-0 pod, once RBAC has the operator's RoleBinding."""
    account = account or names.service_account_name(name)
    token = kube.as_service_account(account, pod=_writer_pod(kube, name))
    custom = client.CustomObjectsApi(token)

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


CLAIMS: dict[str, dict[str, Any]] = {
    "status.checkpoints.lastUploaded.verified": {
        "checkpoints": {"lastUploaded": {"step": 5, "uri": "s3://b/p/step-5", "verified": True}}
    },
    "status.checkpoints.history[].state": {
        "checkpoints": {
            "history": [{"step": 4, "state": "uploaded"}, {"step": 5, "state": "verified"}]
        }
    },
}
"""One writer patch per place the policy finds a verification claim (the CRD schema walk)."""


def test_every_verification_claim_has_a_case() -> None:
    assert {path for _, path in statuspolicy.verified_claims()} == set(CLAIMS)


@pytest.mark.parametrize("path", sorted(CLAIMS))
def test_trainer_token_cannot_claim_verification(running: tuple[Kube, str], path: str) -> None:
    kube, name = running
    custom = _writer(kube, name)
    body = _refused(custom, kube.namespace, name, CLAIMS[path])
    assert path in body
    assert kube.status(name).get("checkpoints") is None


def test_trainer_token_writes_unverified_upload(running: tuple[Kube, str]) -> None:
    kube, name = running
    custom = _writer(kube, name)
    uploaded = {"step": 5, "uri": "s3://b/p/step-000000005", "verified": False}
    history = [{"step": 5, "state": "uploaded"}]
    _patch(
        custom,
        kube.namespace,
        name,
        {"checkpoints": {"lastUploaded": uploaded, "history": history}},
    )
    assert kube.status(name)["checkpoints"]["lastUploaded"]["step"] == 5


def _stranger_pod(kube: Kube, name: str, account: str) -> str:
    """A pod the operator never made, running as `account`, never scheduled."""
    drop = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    kube.core.create_namespaced_pod(
        kube.namespace,
        {
            "metadata": {"name": name},
            "spec": {
                "serviceAccountName": account,
                "nodeSelector": {"cairn.dev/no-such-node": "true"},
                "securityContext": {
                    "runAsNonRoot": True,
                    "seccompProfile": {"type": "RuntimeDefault"},
                },
                "containers": [
                    {"name": "c", "image": "cairn-trainer:dev", "securityContext": drop}
                ],
            },
        },
    )
    return name


def test_token_bound_to_no_pod_is_refused(running: tuple[Kube, str]) -> None:
    kube, name = running
    _writer(kube, name)  # RBAC has the binding
    unbound = client.CustomObjectsApi(kube.as_service_account(names.service_account_name(name)))
    body = _refused(unbound, kube.namespace, name, {"step": 3})
    assert "bound to no pod" in body
    assert _writer_pod(kube, name) in body


@pytest.mark.parametrize("stranger", ["notebook", "guarded-a9-n0"])
def test_stranger_pod_with_the_job_account_is_refused(
    running: tuple[Kube, str], stranger: str
) -> None:
    """Same ServiceAccount, a pod the operator never made (any name, or the
    name of an attempt that is not the current one): refused."""
    kube, name = running
    _writer(kube, name)
    pod = _stranger_pod(kube, stranger, names.service_account_name(name))
    token = client.CustomObjectsApi(
        kube.as_service_account(names.service_account_name(name), pod=pod)
    )
    body = _refused(token, kube.namespace, name, {"step": 3})
    assert f"bound to pod {stranger}" in body
    assert kube.status(name).get("step") != 3


def test_job_a_pod_cannot_write_job_b_with_a_shared_account(kube: Kube) -> None:
    """RBAC lets a ServiceAccount shared by two jobs patch both jobs' status;
    the policy lets each job's writer pod write only its own job."""
    kube.core.create_namespaced_service_account(
        kube.namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="shared-sa"))
    )
    template = {"serviceAccountName": "shared-sa"}
    for job in ("ajob", "bjob"):
        kube.create(job_body(job, script=SLEEP_FOREVER, nodes=1, template=template))
    for job in ("ajob", "bjob"):
        kube.wait_phase(job, "Running")
    as_a = _writer(kube, "ajob", account="shared-sa")
    _writer(kube, "bjob", account="shared-sa")  # RBAC lets shared-sa write bjob too
    body = _refused(as_a, kube.namespace, "bjob", {"step": 9})
    assert f"bound to pod {_writer_pod(kube, 'ajob')}" in body
    assert _writer_pod(kube, "bjob") in body
    assert kube.status("bjob").get("step") != 9
    _patch(as_a, kube.namespace, "ajob", {"step": 9})
    assert kube.status("ajob")["step"] == 9


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


@pytest.fixture(params=["policy", "binding"])
def policy_deleted(request: pytest.FixtureRequest, kube: Kube) -> Iterator[str]:
    """The cluster-wide status policy or its binding deleted, reinstalled after."""
    admission = client.AdmissionregistrationV1Api(kube.api_client)
    delete = {
        "policy": admission.delete_validating_admission_policy,
        "binding": admission.delete_validating_admission_policy_binding,
    }[request.param]
    try:
        delete(statuspolicy.POLICY_NAME)
        # The operator caches a present policy this long: a job created sooner may start.
        cached_until = time.monotonic() + policycheck.SHARED.present_ttl_seconds + 1
        kh.wait_for(
            lambda: time.monotonic() >= cached_until,
            timeout=WAIT,
            what="the operator's cached verdict (present) to expire",
        )
        yield request.param
    finally:
        demo.install_status_policy(kube.api_client)


def _missing(status: dict[str, Any]) -> dict[str, Any] | None:
    found = [c for c in status.get("conditions") or () if c["type"] == "StatusPolicyMissing"]
    return found[0] if found and found[0]["status"] == "True" else None


def test_missing_status_policy_holds_the_pods_until_restored(
    kube: Kube, policy_deleted: str
) -> None:
    kube.create(job_body("held", script=SLEEP_FOREVER, nodes=1))
    status = kube.wait_status("held", "StatusPolicyMissing=True", _missing)
    condition = _missing(status)
    assert condition is not None
    kind = (
        "ValidatingAdmissionPolicyBinding"
        if policy_deleted == "binding"
        else "ValidatingAdmissionPolicy"
    )
    assert condition["reason"] == "StatusPolicyMissing"
    assert f"{kind} {statuspolicy.POLICY_NAME} is not installed" in condition["message"]
    assert kube.wait_event("held", "StatusPolicyMissing").type == "Warning"
    assert kube.pods("held") == []
    for read in (kube.rbac.read_namespaced_role, kube.rbac.read_namespaced_role_binding):
        with pytest.raises(ApiException) as caught:
            read(names.role_name("held"), kube.namespace)
        assert caught.value.status == 404
    demo.install_status_policy(kube.api_client)
    status = kube.wait_phase("held", "Running")
    assert _missing(status) is None
