"""The chart's leader election, S3 settings and status policy, as rendered by helm.

Covers: leader election on by default (``CAIRN_LEADER_ELECT`` and the Lease
timing in the operator's environment, a Role on ``leases`` in the release
namespace only, bound to the operator's ServiceAccount, rolling updates);
``replicaCount: 2`` accepted with it and refused without it (Recreate
then); the S3 settings reach the environment (identity off, allow-list
joined); the status policy and its binding equal ``cairn.operator.core.statuspolicy``
apart from the chart's labels and keep annotation, and are left out with
``crds.statusPolicy=false`` or ``crds.install=false``. On the devcluster:
``helm install`` with ``replicaCount: 2`` runs one leader and one standby
pod; force-deleting the leader pod (grace 0: SIGTERM then SIGKILL at once)
hands the Lease to the standby (time printed) and the Deployment's
replacement pod stands by.
"""

import contextlib
import pathlib
import time
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from cairn.operator.core import rbac, statuspolicy
from tests.conftest import DevclusterHandle
from tests.integration.devcluster import kube_helpers

from . import helmtools
from .test_chart_install import RELEASE, install, operator_pods
from .test_chart_render import by_kind, render


def _env(docs: list[dict[str, Any]]) -> dict[str, str]:
    [deployment] = by_kind(docs, "Deployment")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value", "") for e in container["env"]}


def test_leader_election_by_default(helm: pathlib.Path) -> None:
    docs = render(helm, {"replicaCount": "2"})
    env = _env(docs)
    assert env["CAIRN_LEADER_ELECT"] == "true"
    assert (env["CAIRN_LEASE_NAME"], env["CAIRN_LEASE_DURATION_SECONDS"]) == (
        "cairn-operator",
        "15",
    )
    assert (env["CAIRN_RENEW_DEADLINE_SECONDS"], env["CAIRN_RETRY_PERIOD_SECONDS"]) == ("10", "2")
    [deployment] = by_kind(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    [role] = by_kind(docs, "Role")
    assert role["metadata"] == {
        **role["metadata"],
        "name": "cairn-leader",
        "namespace": "cairn-system",
    }
    assert role["rules"] == list(rbac.LEADER_RULES)
    [binding] = by_kind(docs, "RoleBinding")
    assert binding["roleRef"]["name"] == "cairn-leader"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "cairn", "namespace": "cairn-system"}
    ]


def test_without_leader_election_one_replica_recreated(helm: pathlib.Path) -> None:
    docs = render(helm, {"leaderElection.enabled": "false"})
    assert _env(docs)["CAIRN_LEADER_ELECT"] == "false"
    assert "CAIRN_LEASE_NAME" not in _env(docs)
    [deployment] = by_kind(docs, "Deployment")
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert by_kind(docs, "Role") == []
    refused = helmtools.run(
        [
            str(helm),
            "template",
            "x",
            str(helmtools.CHART),
            "--kube-version",
            helmtools.KUBE_VERSION,
            *helmtools.set_args({"leaderElection.enabled": "false", "replicaCount": "2"}),
        ]
    )
    assert refused.returncode != 0
    assert "maximum" in refused.stderr


def test_s3_settings_reach_the_operator(helm: pathlib.Path) -> None:
    env = _env(render(helm, {}))
    assert (env["CAIRN_S3_ALLOW_OPERATOR_IDENTITY"], env["CAIRN_S3_ENDPOINT_ALLOWLIST"]) == (
        "false",
        "",
    )
    env = _env(
        render(
            helm,
            {
                "s3.allowOperatorIdentity": "true",
                "s3.endpointAllowList": "{http://minio.ml:9000,https://s3.example.com}",
            },
        )
    )
    assert env["CAIRN_S3_ALLOW_OPERATOR_IDENTITY"] == "true"
    assert env["CAIRN_S3_ENDPOINT_ALLOWLIST"] == "http://minio.ml:9000,https://s3.example.com"


def test_status_policy_is_the_generated_one(helm: pathlib.Path) -> None:
    docs = render(helm, {})
    rendered = [
        *by_kind(docs, "ValidatingAdmissionPolicy"),
        *by_kind(docs, "ValidatingAdmissionPolicyBinding"),
    ]
    for document in rendered:
        meta = document["metadata"]
        assert meta.pop("annotations") == {"helm.sh/resource-policy": "keep"}
        assert meta.pop("labels")["app.kubernetes.io/instance"] == "cairn"
    assert rendered == statuspolicy.documents()
    for switch in ("crds.statusPolicy", "crds.install"):
        assert by_kind(render(helm, {switch: "false"}), "ValidatingAdmissionPolicy") == []


def _holder(handle: DevclusterHandle, namespace: str) -> str:
    try:
        lease = client.CoordinationV1Api(handle.api_client).read_namespaced_lease(
            "cairn-operator", namespace
        )
    except ApiException as exc:
        if exc.status == 404:
            return ""
        raise
    return str(lease.spec.holder_identity or "")


def _leader_pod(handle: DevclusterHandle, namespace: str) -> str | None:
    """The running operator pod that holds the Lease (identity: ``<pod>_<pid>_<rand>``)."""
    holder = _holder(handle, namespace)
    running = [p for p in operator_pods(handle, namespace) if p.status.phase == "Running"]
    return next(
        (p.metadata.name for p in running if holder.startswith(p.metadata.name + "_")), None
    )


class _Renewals:
    """When the old leader's renewals stopped: its process really died then."""

    def __init__(self, handle: DevclusterHandle, namespace: str) -> None:
        self.handle, self.namespace = handle, namespace
        self.old_holder = _holder(handle, namespace)
        self.seen: object = None
        self.last = time.monotonic()

    def look(self) -> None:
        lease = client.CoordinationV1Api(self.handle.api_client).read_namespaced_lease(
            "cairn-operator", self.namespace
        )
        if lease.spec.holder_identity == self.old_holder and lease.spec.renew_time != self.seen:
            self.seen = lease.spec.renew_time
            self.last = time.monotonic()


@pytest.mark.cluster
def test_two_replicas_survive_a_killed_leader(
    helm: pathlib.Path, devcluster: DevclusterHandle
) -> None:
    temp_namespace = contextlib.contextmanager(kube_helpers.temp_namespace)
    with temp_namespace(devcluster.core, prefix="chart-ha") as namespace:
        values = {
            "watch.scope": "namespaces",
            "watch.namespaces": f"{{{namespace}}}",
            "crds.install": "false",
            "replicaCount": "2",
        }
        install(helm, devcluster, namespace=namespace, values=values)
        try:
            _kill_leader_pod(devcluster, namespace)
        finally:
            helmtools.run(
                [str(helm), "uninstall", RELEASE, "-n", namespace, "--wait", "--timeout", "60s"],
                kubeconfig=devcluster.kubeconfig,
            )


def _kill_leader_pod(devcluster: DevclusterHandle, namespace: str) -> None:
    def running() -> set[str]:
        pods = operator_pods(devcluster, namespace)
        return {p.metadata.name for p in pods if p.status.phase == "Running"}

    kube_helpers.wait_for(lambda: len(running()) == 2, timeout=90, what="two operator pods")
    leader = kube_helpers.wait_for(
        lambda: _leader_pod(devcluster, namespace), timeout=60, what="a leader pod"
    )
    survivors = running() - {leader}
    renewals = _Renewals(devcluster, namespace)
    devcluster.core.delete_namespaced_pod(leader, namespace, grace_period_seconds=0)
    killed = time.monotonic()

    def new_leader() -> str | None:
        renewals.look()
        found = _leader_pod(devcluster, namespace)
        return found if found not in (None, leader) else None

    successor = kube_helpers.wait_for(new_leader, timeout=90, what="another pod to take the Lease")
    taken = time.monotonic() - killed
    print(
        f"\nleader pod force-deleted: its last renewal {renewals.last - killed:.1f} s later, "
        f"Lease taken by {'the standby' if successor in survivors else 'the replacement pod'} "
        f"{taken:.1f} s after the deletion ({time.monotonic() - renewals.last:.1f} s after "
        "that last renewal)"
    )
    kube_helpers.wait_for(
        lambda: len(running() - {leader}) == 2, timeout=90, what="a second pod again"
    )
    assert _leader_pod(devcluster, namespace) == successor
