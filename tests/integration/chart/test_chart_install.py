"""helm install / upgrade / uninstall on the devcluster, and the operator's real RBAC.

Covers: ``helm install`` starts the operator from the chart (the node agent
runs the Deployment's command, ``python -m cairn.operator``, in
the virtualenv) and a TrainingJob runs to Succeeded under it, with the
per-job Role the operator creates (RBAC's escalation check passes); the
operator logs no 403; deleting the job passes through the operator's
finalizer; the chart's ServiceAccount is allowed what the operator does and
denied the rest (``kubectl auth can-i`` impersonating it with its groups), in
the namespaced and the cluster-wide scope; ``helm upgrade`` rolls the pod, keeps one
replica, and a scope switch removes the namespaced Role for a ClusterRole;
``helm upgrade`` from an older chart whose CRD lacks a column upgrades the
live CRD; ``helm uninstall`` leaves nothing with the release's labels
(namespaced or cluster-scoped), only the CRD, kept on purpose.

Releases watch only their own temporary namespace (``watch.scope=namespaces``),
so they never touch other tests' jobs; the cluster-wide release runs 0
replicas (RBAC only). The CRD is adopted with ``--take-ownership`` because
other tests apply it from crds/ (same generator, same content).
"""

import contextlib
import json
import pathlib
import shutil
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from cairn.api import crdgen
from tests.conftest import DevclusterHandle
from tests.integration.devcluster import kube_helpers

from . import helmtools

pytestmark = pytest.mark.cluster
temp_namespace = contextlib.contextmanager(kube_helpers.temp_namespace)

RELEASE = "cairn"
SA = "cairn"


def helm_cmd(helm: pathlib.Path, handle: DevclusterHandle, *args: str, timeout: float = 150) -> str:
    return helmtools.ok(
        helmtools.run([str(helm), *args], kubeconfig=handle.kubeconfig, timeout=timeout)
    )


def install(
    helm: pathlib.Path,
    handle: DevclusterHandle,
    *,
    namespace: str,
    values: dict[str, str],
    verb: str = "install",
) -> str:
    return helm_cmd(
        helm,
        handle,
        verb,
        RELEASE,
        str(helmtools.CHART),
        "--namespace",
        namespace,
        "--take-ownership",
        "--wait",
        "--timeout",
        "120s",
        *helmtools.set_args(values),
    )


def operator_pods(handle: DevclusterHandle, namespace: str) -> list[client.V1Pod]:
    pods = handle.core.list_namespaced_pod(
        namespace,
        label_selector=f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=operator",
    ).items
    return [p for p in pods if p.metadata.deletion_timestamp is None]


@pytest.fixture(scope="module")
def release(helm: pathlib.Path, devcluster: DevclusterHandle) -> Iterator[str]:
    """A namespaced release watching its own namespace, with a running operator."""
    with temp_namespace(devcluster.core, prefix="chart") as namespace:
        values = {
            "watch.scope": "namespaces",
            "watch.namespaces": f"{{{namespace}}}",
        }
        install(helm, devcluster, namespace=namespace, values=values)
        try:
            kube_helpers.wait_for(
                lambda: any(
                    p.status.phase == "Running" for p in operator_pods(devcluster, namespace)
                ),
                timeout=60,
                what="the operator pod to run",
            )
            # Ready is not leading (a standby answers the probes too): wait for the Lease.
            kube_helpers.wait_for(
                lambda: _lease_holder(devcluster, namespace).startswith(
                    tuple(p.metadata.name for p in operator_pods(devcluster, namespace))
                ),
                timeout=60,
                what="the operator pod to hold the leader Lease",
            )
            yield namespace
        finally:
            helmtools.run(
                [str(helm), "uninstall", RELEASE, "-n", namespace, "--wait", "--timeout", "60s"],
                kubeconfig=devcluster.kubeconfig,
            )


def _lease_holder(handle: DevclusterHandle, namespace: str) -> str:
    try:
        lease = client.CoordinationV1Api(handle.api_client).read_namespaced_lease(
            "cairn-operator", namespace
        )
    except ApiException as exc:
        if exc.status == 404:
            return ""
        raise
    return str(lease.spec.holder_identity or "")


def can_i(
    handle: DevclusterHandle, *, sa_namespace: str, verb: str, resource: str, namespace: str | None
) -> bool:
    scope = ["--all-namespaces"] if namespace is None else ["-n", namespace]
    # `can-i VERB TYPE/NAME` reads a slash as a name: pass subresources explicitly.
    resource, _, subresource = resource.partition("/")
    if subresource:
        scope.append(f"--subresource={subresource}")
    result = helmtools.run(
        [
            str(helmtools.KUBECTL),
            "auth",
            "can-i",
            verb,
            resource,
            *scope,
            f"--as=system:serviceaccount:{sa_namespace}:{SA}",
            "--as-group=system:serviceaccounts",
            f"--as-group=system:serviceaccounts:{sa_namespace}",
            "--as-group=system:authenticated",
        ],
        kubeconfig=handle.kubeconfig,
    )
    assert result.stdout.strip() in ("yes", "no"), result.stderr
    return result.stdout.strip() == "yes"


def test_operator_from_chart_runs_a_job(devcluster: DevclusterHandle, release: str) -> None:
    custom = client.CustomObjectsApi(devcluster.api_client)
    custom.create_namespaced_custom_object(
        "cairn.dev",
        "v1alpha1",
        release,
        "trainingjobs",
        {
            "apiVersion": "cairn.dev/v1alpha1",
            "kind": "TrainingJob",
            "metadata": {"name": "tiny"},
            "spec": {
                "nodes": 1,
                "image": "cairn-trainer:dev",
                "command": ["python", "-c", "print('tiny ran')"],
            },
        },
    )

    def phase() -> str | None:
        job: dict[str, Any] = custom.get_namespaced_custom_object(
            "cairn.dev", "v1alpha1", release, "trainingjobs", "tiny"
        )
        found: str | None = job.get("status", {}).get("phase")
        return found

    kube_helpers.wait_for(
        lambda: phase() == "Succeeded",
        timeout=90,
        what="the job to succeed under the chart's operator",
    )
    assert kube_helpers.pod_log(devcluster.core, "tiny-a1-n0", release).strip() == "tiny ran"
    rbac_api = client.RbacAuthorizationV1Api(devcluster.api_client)
    assert rbac_api.read_namespaced_role("tiny-status-writer", release).rules[0].verbs == [
        "get",
        "patch",
    ]
    [pod] = operator_pods(devcluster, release)
    log = kube_helpers.pod_log(devcluster.core, pod.metadata.name, release)
    assert "reconciled" in log
    # (not "403": timestamps carry milliseconds)
    assert "Forbidden" not in log, log
    # Deleting the job goes through the operator's finalizer (a metadata patch):
    # with the chart's RBAC the operator releases it, so the job really goes.
    custom.delete_namespaced_custom_object("cairn.dev", "v1alpha1", release, "trainingjobs", "tiny")

    def gone() -> bool:
        try:
            custom.get_namespaced_custom_object(
                "cairn.dev", "v1alpha1", release, "trainingjobs", "tiny"
            )
        except ApiException as error:
            return bool(error.status == 404)
        return False

    kube_helpers.wait_for(gone, timeout=30, what="the operator to release its finalizer")


ALLOWED = [
    ("create", "pods"),
    ("delete", "pods"),
    ("watch", "pods"),
    ("patch", "trainingjobs.cairn.dev"),
    ("patch", "trainingjobs.cairn.dev/status"),
    ("create", "roles.rbac.authorization.k8s.io"),
    ("create", "rolebindings.rbac.authorization.k8s.io"),
    ("create", "services"),
    ("create", "serviceaccounts"),
    ("create", "events"),
    # The S3 credentials Secret a job names (storage: verification, retention, onDelete),
    # and the job's manifest-key Secret (read by the S3 pass to check signatures).
    ("get", "secrets"),
    # The job's manifest-key Secret, created once with the job's other children.
    ("create", "secrets"),
    # The job's NetworkPolicy (its network boundary; the garbage collector deletes it).
    ("create", "networkpolicies.networking.k8s.io"),
    ("get", "networkpolicies.networking.k8s.io"),
    # spec.ttlSecondsAfterFinished: the operator deletes finished jobs.
    ("delete", "trainingjobs.cairn.dev"),
]
DENIED = [
    ("list", "secrets"),
    ("watch", "secrets"),
    ("update", "secrets"),
    ("delete", "secrets"),
    ("update", "trainingjobs.cairn.dev"),
    ("create", "deployments.apps"),
    ("patch", "pods"),
    ("escalate", "roles.rbac.authorization.k8s.io"),
    ("bind", "roles.rbac.authorization.k8s.io"),
    ("delete", "roles.rbac.authorization.k8s.io"),
    ("delete", "networkpolicies.networking.k8s.io"),
    ("patch", "networkpolicies.networking.k8s.io"),
    ("create", "pods/exec"),
    ("create", "serviceaccounts/token"),
    ("get", "pods/log"),
    ("update", "trainingjobs.cairn.dev/status"),
]
CLUSTER_DENIED = [
    ("list", "secrets"),
    ("delete", "nodes"),
    ("get", "nodes"),
    ("create", "clusterroles.rbac.authorization.k8s.io"),
    ("delete", "customresourcedefinitions.apiextensions.k8s.io"),
    ("delete", "namespaces"),
    ("create", "pods"),
]


def test_namespaced_rbac_allows_what_the_operator_does(
    devcluster: DevclusterHandle, release: str
) -> None:
    denied = [
        (v, r)
        for v, r in ALLOWED
        if not can_i(devcluster, sa_namespace=release, verb=v, resource=r, namespace=release)
    ]
    assert denied == []
    assert can_i(
        devcluster,
        sa_namespace=release,
        verb="list",
        resource="customresourcedefinitions.apiextensions.k8s.io",
        namespace=None,
    )
    for kind in ("validatingadmissionpolicies", "validatingadmissionpolicybindings"):
        # policycheck: no pods start unless the status policy and its binding exist.
        assert can_i(
            devcluster,
            sa_namespace=release,
            verb="get",
            resource=f"{kind}.admissionregistration.k8s.io",
            namespace=None,
        )


def test_namespaced_rbac_denies_the_rest(devcluster: DevclusterHandle, release: str) -> None:
    allowed = [
        (v, r)
        for v, r in DENIED
        if can_i(devcluster, sa_namespace=release, verb=v, resource=r, namespace=release)
    ]
    allowed += [
        ("*", f"{v} {r}")
        for v, r in CLUSTER_DENIED
        if can_i(devcluster, sa_namespace=release, verb=v, resource=r, namespace=None)
    ]
    # Only its own namespace: not "default", not the demo's.
    allowed += [
        ("default", r)
        for r in ("pods", "trainingjobs.cairn.dev")
        if can_i(
            devcluster,
            sa_namespace=release,
            verb="create" if r == "pods" else "patch",
            resource=r,
            namespace="default",
        )
    ]
    assert allowed == []


def test_cluster_scope_rbac(helm: pathlib.Path, devcluster: DevclusterHandle) -> None:
    with temp_namespace(devcluster.core, prefix="chart-cl") as namespace:
        install(
            helm,
            devcluster,
            namespace=namespace,
            values={"replicaCount": "0", "crds.install": "false"},
        )
        try:
            for verb, resource in ALLOWED:
                assert can_i(
                    devcluster, sa_namespace=namespace, verb=verb, resource=resource, namespace=None
                ), (verb, resource)
                assert can_i(
                    devcluster,
                    sa_namespace=namespace,
                    verb=verb,
                    resource=resource,
                    namespace="default",
                ), (verb, resource)
            for verb, resource in DENIED + CLUSTER_DENIED[:-1]:
                assert not can_i(
                    devcluster, sa_namespace=namespace, verb=verb, resource=resource, namespace=None
                ), (verb, resource)
        finally:
            helm_cmd(
                helm,
                devcluster,
                "uninstall",
                RELEASE,
                "-n",
                namespace,
                "--wait",
                "--timeout",
                "60s",
            )


def _leftovers(handle: DevclusterHandle, namespace: str, instance: str) -> list[str]:
    selector = f"app.kubernetes.io/instance={instance}"
    out = helmtools.kubectl(
        handle.kubeconfig,
        "get",
        "deployments,replicasets,pods,services,serviceaccounts,roles,rolebindings,configmaps,secrets",
        "-n",
        namespace,
        "-l",
        selector,
        "-o",
        "json",
    )
    items: list[dict[str, Any]] = [
        i for i in json.loads(out)["items"] if not i["metadata"].get("deletionTimestamp")
    ]
    out = helmtools.kubectl(
        handle.kubeconfig, "get", "clusterroles,clusterrolebindings", "-l", selector, "-o", "json"
    )
    # Cluster-scoped objects of THIS release: another release of the same name
    # in another namespace (the module's `release`, whose crds.install=true
    # brings the user-role ClusterRoles) is not this one's orphan.
    items += [
        i
        for i in json.loads(out)["items"]
        if (i["metadata"].get("annotations") or {}).get("meta.helm.sh/release-namespace")
        in (None, namespace)
    ]
    # Helm's release records are Secrets labelled owner=helm,name=<release>.
    out = helmtools.kubectl(
        handle.kubeconfig,
        "get",
        "secrets",
        "-n",
        namespace,
        "-l",
        f"owner=helm,name={instance}",
        "-o",
        "json",
    )
    items += json.loads(out)["items"]
    return [f"{i['kind']}/{i['metadata']['name']}" for i in items]


def test_upgrade_then_uninstall_leaves_no_orphans(
    helm: pathlib.Path, devcluster: DevclusterHandle
) -> None:
    with temp_namespace(devcluster.core, prefix="chart-up") as namespace:
        # crds.install=false throughout: an upgrade that drops the CRD from a
        # release deletes it unless the *live* CRD still carries the keep
        # annotation, and other tests replace the CRD (stripping annotations).
        values = {
            "watch.scope": "namespaces",
            "watch.namespaces": f"{{{namespace}}}",
            "crds.install": "false",
        }
        install(helm, devcluster, namespace=namespace, values=values)
        kube_helpers.wait_for(
            lambda: len(operator_pods(devcluster, namespace)) == 1,
            timeout=60,
            what="one operator pod",
        )
        [before] = operator_pods(devcluster, namespace)
        out = install(
            helm,
            devcluster,
            namespace=namespace,
            values={**values, "operator.verbose": "true"},
            verb="upgrade",
        )
        assert "REVISION: 2" in out

        def rolled() -> bool:
            pods = operator_pods(devcluster, namespace)
            return (
                len(pods) == 1
                and pods[0].metadata.uid != before.metadata.uid
                and pods[0].status.phase == "Running"
            )

        kube_helpers.wait_for(rolled, timeout=90, what="the upgraded operator pod")
        [after] = operator_pods(devcluster, namespace)
        assert "--verbose" in after.spec.containers[0].command
        # Switching scope drops the namespaced Role/RoleBinding for a ClusterRole
        # (0 replicas: a cluster-wide operator would touch other tests' jobs).
        install(
            helm,
            devcluster,
            namespace=namespace,
            values={"replicaCount": "0", "crds.install": "false"},
            verb="upgrade",
        )
        left = _leftovers(devcluster, namespace, RELEASE)
        assert "Role/cairn" not in left and "RoleBinding/cairn" not in left
        assert {"ClusterRole/cairn", "ClusterRoleBinding/cairn", "Deployment/cairn"} <= set(left)
        kube_helpers.wait_for(
            lambda: operator_pods(devcluster, namespace) == [], timeout=60, what="0 replicas"
        )
        helm_cmd(
            helm, devcluster, "uninstall", RELEASE, "-n", namespace, "--wait", "--timeout", "60s"
        )
        seen: list[list[str]] = [[]]

        def none_left() -> bool:
            seen[0] = _leftovers(devcluster, namespace, RELEASE)
            return seen[0] == []

        try:
            kube_helpers.wait_for(none_left, timeout=60, what="no object of the release left")
        except AssertionError as exc:  # name what stayed
            raise AssertionError(f"{exc}: {seen[0]}") from None
        crd = client.ApiextensionsV1Api(devcluster.api_client).read_custom_resource_definition(
            "trainingjobs.cairn.dev"
        )
        assert crd.metadata.annotations["helm.sh/resource-policy"] == "keep"
        with pytest.raises(ApiException) as missing:
            client.AppsV1Api(devcluster.api_client).read_namespaced_deployment(RELEASE, namespace)
        assert missing.value.status == 404


def test_upgrade_upgrades_the_crd(
    helm: pathlib.Path, devcluster: DevclusterHandle, tmp_path: pathlib.Path
) -> None:
    """The reason the CRD is a template: an older chart's CRD is replaced on upgrade."""
    old_chart = tmp_path / "cairn-old"
    shutil.copytree(helmtools.CHART, old_chart)
    crd_template = old_chart / "templates" / "crd.yaml"
    column = (
        "    - name: Message\n      type: string\n"
        '      jsonPath: .status.conditions[?(@.type=="Ready")].message\n      priority: 1\n'
    )
    assert column in crd_template.read_text()
    crd_template.write_text(crd_template.read_text().replace(column, ""))
    extensions = client.ApiextensionsV1Api(devcluster.api_client)

    def columns() -> list[str]:
        crd = extensions.read_custom_resource_definition("trainingjobs.cairn.dev")
        return [c.name for c in crd.spec.versions[0].additional_printer_columns]

    with temp_namespace(devcluster.core, prefix="chart-crd") as namespace:
        values = {
            "replicaCount": "0",
            "watch.scope": "namespaces",
            "watch.namespaces": f"{{{namespace}}}",
        }
        try:
            helm_cmd(
                helm,
                devcluster,
                "install",
                RELEASE,
                str(old_chart),
                "-n",
                namespace,
                "--take-ownership",
                "--wait",
                "--timeout",
                "60s",
                *helmtools.set_args(values),
            )
            assert "Message" not in columns()
            install(helm, devcluster, namespace=namespace, values=values, verb="upgrade")
            assert columns()[-1] == "Message"
            live = extensions.read_custom_resource_definition("trainingjobs.cairn.dev")
            assert (
                live.spec.versions[0].additional_printer_columns[-1].json_path
                == (crdgen.PRINTER_COLUMNS[-1]["jsonPath"])
            )
        finally:
            # Whatever happened, leave the cluster with the current CRD.
            helmtools.kubectl(
                devcluster.kubeconfig,
                "apply",
                "--server-side",
                "--force-conflicts",
                "-f",
                str(helmtools.REPO / "crds"),
            )
            helmtools.run(
                [str(helm), "uninstall", RELEASE, "-n", namespace, "--wait", "--timeout", "60s"],
                kubeconfig=devcluster.kubeconfig,
            )
