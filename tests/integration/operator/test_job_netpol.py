"""The job's NetworkPolicy, as the real operator creates it (issue 20 item 2).

Covers: for a running job the operator has created `<job>-ingress`, owned by
the job (controller ownerReference, owner labels), selecting the job's pods
by `cairn.dev/job-name`, Ingress only, admitting only the job's own pods on
every port (no `ports`, no egress rule); it exists before the job's pods
(its creationTimestamp is not after the first pod's); deleting the job lets
the API server's garbage collector delete the policy. A foreign policy
under the job's policy name (one admitting everyone) is not adopted:
NameConflict, no pod, until it is deleted. Enforcement (a pod
outside the job refused, one inside admitted) is the devcluster's part:
tests/integration/devcluster (netpol-enforce).
"""

from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from tests.integration.devcluster import kube_helpers as kh
from tests.integration.operator.conftest import (
    GROUP,
    PLURAL,
    SLEEP_FOREVER,
    VERSION,
    WAIT,
    Kube,
    job_body,
)

pytestmark = pytest.mark.cluster

JOB = "fenced"
POLICY = f"{JOB}-ingress"


def _policy_gone(networking: client.NetworkingV1Api, namespace: str) -> bool:
    try:
        networking.read_namespaced_network_policy(POLICY, namespace)
    except ApiException as error:
        return bool(error.status == 404)
    return False


def test_job_gets_an_owned_ingress_policy_collected_with_it(kube: Kube) -> None:
    networking = client.NetworkingV1Api(kube.api_client)
    job = kube.create(job_body(JOB, script=SLEEP_FOREVER, nodes=1))
    (pod,) = kube.wait_pods_running(JOB, attempt=1, count=1)
    policy = networking.read_namespaced_network_policy(POLICY, kube.namespace)

    (ref,) = policy.metadata.owner_references
    assert (ref.kind, ref.name, ref.uid, ref.controller) == (
        "TrainingJob",
        JOB,
        job["metadata"]["uid"],
        True,
    )
    assert policy.metadata.labels == {
        "cairn.dev/job-name": JOB,
        "app.kubernetes.io/managed-by": "cairn",
    }
    spec: dict[str, Any] = kube.api_client.sanitize_for_serialization(policy.spec)
    own_pods = {"matchLabels": {"cairn.dev/job-name": JOB}}
    assert spec == {
        "podSelector": own_pods,
        "policyTypes": ["Ingress"],
        "ingress": [{"from": [{"podSelector": own_pods}]}],
    }
    assert pod.metadata.labels["cairn.dev/job-name"] == JOB  # the policy selects it
    assert policy.metadata.creation_timestamp <= pod.metadata.creation_timestamp

    kube.custom.delete_namespaced_custom_object(GROUP, VERSION, kube.namespace, PLURAL, JOB)
    kh.wait_for(
        lambda: _policy_gone(networking, kube.namespace),
        timeout=WAIT,
        what="the garbage collector to delete the job's NetworkPolicy",
    )


def test_foreign_policy_under_the_name_holds_the_pods(kube: Kube) -> None:
    """A NetworkPolicy named `<job>-ingress` that the job does not own (one that
    could admit anyone) is not adopted: NameConflict, no pod until it is gone."""
    networking = client.NetworkingV1Api(kube.api_client)
    admit_all = {
        "metadata": {"name": "open-ingress"},
        "spec": {"podSelector": {}, "policyTypes": ["Ingress"], "ingress": [{}]},
    }
    networking.create_namespaced_network_policy(kube.namespace, admit_all)
    kube.create(job_body("open", script=SLEEP_FOREVER, nodes=1))

    def conflicted(status: dict[str, Any]) -> bool:
        return any(
            c["type"] == "NameConflict" and c["status"] == "True"
            for c in status.get("conditions") or ()
        )

    status = kube.wait_status("open", "NameConflict", conflicted)
    condition = next(c for c in status["conditions"] if c["type"] == "NameConflict")
    assert "NetworkPolicy open-ingress" in condition["message"]
    assert kube.pods("open") == [], "no pod starts behind a foreign policy"
    foreign = networking.read_namespaced_network_policy("open-ingress", kube.namespace)
    assert not foreign.metadata.owner_references, "the foreign policy was not adopted"

    networking.delete_namespaced_network_policy("open-ingress", kube.namespace)
    kube.wait_phase("open", "Running", attempt=1)
    owned = networking.read_namespaced_network_policy("open-ingress", kube.namespace)
    assert owned.metadata.owner_references[0].kind == "TrainingJob"
