"""Pods meet the restricted Pod Security Standard; the operator's RBAC suffices
where OwnerReferencesPermissionEnforcement is on.

Covers, against the devcluster's API server (PodSecurity admission, and
OwnerReferencesPermissionEnforcement enabled by the devcluster):
- a job runs to Succeeded in a namespace labelled
  pod-security.kubernetes.io/enforce=restricted (the defaults pass);
- an overlay that asks for a privileged container is refused by admission
  there, and the job says so (PodsNotStarting / FailedCreate with the
  server's "violates PodSecurity" message) instead of waiting silently;
- the overlay's pod fields reach the pods (serviceAccountName,
  topologySpreadConstraints, envFrom, init containers, a native sidecar that
  the node agent stops once the trainer finished);
- the operator's generated namespaced rules (cairn.operator.core.rbac) let a
  ServiceAccount create a child with blockOwnerDeletion; the same rules
  without trainingjobs/finalizers are refused by the admission plugin.
"""

from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from cairn.operator.core import rbac
from tests.integration.devcluster import kube_helpers as kh
from tests.integration.operator.conftest import GROUP, VERSION, Kube, job_body

pytestmark = pytest.mark.cluster

RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted"}


def _restrict(kube: Kube) -> None:
    kube.core.patch_namespace(kube.namespace, {"metadata": {"labels": RESTRICTED}})


def _condition(status: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions") or () if c["type"] == kind), None)


def test_job_succeeds_in_a_restricted_namespace(kube: Kube) -> None:
    _restrict(kube)
    kube.core.create_namespaced_config_map(
        kube.namespace,
        client.V1ConfigMap(metadata=client.V1ObjectMeta(name="extra"), data={"GREETING": "hi"}),
    )
    script = "import os, sys; sys.exit(0 if os.environ.get('GREETING') == 'hi' else 3)"
    kube.create(
        job_body(
            "strict",
            script=script,
            nodes=2,
            template={
                "envFrom": [{"configMapRef": {"name": "extra"}}],
                "topologySpreadConstraints": [
                    {
                        "maxSkew": 2,
                        "topologyKey": "kubernetes.io/hostname",
                        "whenUnsatisfiable": "ScheduleAnyway",
                        "labelSelector": {"matchLabels": {"cairn.dev/job-name": "strict"}},
                    }
                ],
                "initContainers": [
                    {"name": "prepare", "image": "busybox", "command": ["true"]},
                ],
                # A native sidecar that never exits: the pod still completes.
                "sidecars": [
                    {
                        "name": "proxy",
                        "image": "envoy",
                        "command": ["python", "-c", "import time; time.sleep(600)"],
                    }
                ],
            },
        )
    )
    status = kube.wait_phase("strict", "Succeeded", timeout=90)
    assert status["restarts"] == 0
    pod = kube.pods("strict")[0]
    assert pod.spec.security_context.run_as_non_root is True
    assert pod.spec.security_context.seccomp_profile.type == "RuntimeDefault"
    trainer = pod.spec.containers[0]
    assert trainer.security_context.allow_privilege_escalation is False
    assert trainer.security_context.capabilities.drop == ["ALL"]
    assert trainer.termination_message_policy == "FallbackToLogsOnError"
    assert pod.spec.topology_spread_constraints[0].max_skew == 2
    assert pod.spec.init_containers[0].security_context.capabilities.drop == ["ALL"]
    assert pod.spec.init_containers[1].restart_policy == "Always"


def test_privileged_overlay_is_refused_visibly(kube: Kube) -> None:
    _restrict(kube)
    kube.create(
        job_body(
            "priv",
            script="print('never')",
            nodes=1,
            template={"containerSecurityContext": {"privileged": True}},
        )
    )

    def refused(status: dict[str, Any]) -> bool:
        stuck = _condition(status, "PodsNotStarting")
        return stuck is not None and stuck["reason"] == "FailedCreate"

    status = kube.wait_status("priv", "PodsNotStarting: FailedCreate", refused)
    stuck = _condition(status, "PodsNotStarting")
    assert stuck is not None and "violates PodSecurity" in stuck["message"]
    assert status["phase"] == "Starting"
    kube.wait_event("priv", "FailedCreate", contains="violates PodSecurity")
    assert kube.pods("priv") == []


def _service_account_client(kube: Kube, *, rules: list[Any], name: str) -> client.CoreV1Api:
    kube.core.create_namespaced_service_account(
        kube.namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name=name))
    )
    kube.rbac.create_namespaced_role(
        kube.namespace, {"metadata": {"name": name}, "rules": [dict(r) for r in rules]}
    )
    kube.rbac.create_namespaced_role_binding(
        kube.namespace,
        {
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": kube.namespace}],
        },
    )
    return client.CoreV1Api(kube.as_service_account(name))


def _owned_service(name: str, owner: dict[str, Any]) -> dict[str, Any]:
    meta = owner["metadata"]
    return {
        "metadata": {
            "name": name,
            "ownerReferences": [
                {
                    "apiVersion": f"{GROUP}/{VERSION}",
                    "kind": "TrainingJob",
                    "name": meta["name"],
                    "uid": meta["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {"clusterIP": "None", "ports": [{"port": 29500}]},
    }


def test_operator_rules_pass_owner_references_enforcement(kube: Kube) -> None:
    owner = kube.create(
        job_body("owner", script="pass", nodes=1, managedBy="example.com/not-cairn")
    )
    rules = rbac.rules()["namespaced"]
    as_operator = _service_account_client(kube, rules=rules, name="op-full")
    as_operator.create_namespaced_service(kube.namespace, _owned_service("child-a", owner))

    without = [r for r in rules if r["resources"] != ["trainingjobs/finalizers"]]
    assert len(without) == len(rules) - 1
    lacking = _service_account_client(kube, rules=without, name="op-lacking")
    with pytest.raises(ApiException) as caught:
        lacking.create_namespaced_service(kube.namespace, _owned_service("child-b", owner))
    assert caught.value.status == 403
    assert "blockOwnerDeletion" in caught.value.body


def test_overlay_service_account_writes_status_under_the_policy(kube: Kube) -> None:
    """template.serviceAccountName: the pods run as it, the status-writer Role
    is bound to it, and the status policy confines it like <job>-trainer."""
    kube.core.create_namespaced_service_account(
        kube.namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="team-sa"))
    )
    kube.create(
        job_body(
            "ownsa",
            script="import time; time.sleep(600)",
            nodes=1,
            template={"serviceAccountName": "team-sa"},
        )
    )
    kube.wait_phase("ownsa", "Running")
    assert kube.pods("ownsa")[0].spec.service_account_name == "team-sa"
    writer = client.CustomObjectsApi(kube.as_service_account("team-sa", pod="ownsa-a1-n0"))

    def patch(status: dict[str, Any]) -> None:
        writer.patch_namespaced_custom_object_status(
            GROUP, VERSION, kube.namespace, "trainingjobs", "ownsa", {"status": status}
        )

    def can_patch() -> bool:
        try:
            patch({"step": 3})
        except ApiException as exc:  # RBAC's cache may not have the binding yet
            if exc.status == 403 and "ValidatingAdmissionPolicy" not in str(exc.body):
                return False
            raise
        return True

    kh.wait_for(can_patch, timeout=60, what="team-sa patching the job's status.step")
    with pytest.raises(ApiException) as caught:
        patch({"phase": "Succeeded"})
    assert caught.value.status == 403
    assert "ValidatingAdmissionPolicy" in str(caught.value.body)
