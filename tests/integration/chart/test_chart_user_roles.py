"""The chart's PodDisruptionBudget, the ClusterRoles for people who run jobs, its NOTES.

Covers: a PodDisruptionBudget (minAvailable 1, the Deployment's selector) only
when replicaCount > 1; `cairn-trainingjob-viewer`/`-editor` rendered with the
aggregation labels of the built-in view/edit/admin roles, and left out with
`rbac.userRoles=false` or `crds.install=false`; on the devcluster's real
API server (RBAC, the controller-manager's ClusterRole aggregation), with the
roles applied from the rendered chart: a user bound to the built-in `edit`
role in one namespace creates a TrainingJob there (impersonated, a real
create) but cannot write its status nor create one in another namespace; a
`view` user reads it and cannot create one. The NOTES a real `helm install`
(server dry run) prints name the published distribution (`cairn-training`
with its `trainer` and `plugin` extras), the image, Secret and job steps,
and the user roles only when they are installed.
"""

import contextlib
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.conftest import DevclusterHandle
from tests.integration.devcluster import kube_helpers

from . import helmtools

temp_namespace = contextlib.contextmanager(kube_helpers.temp_namespace)

EDITOR_USER = "cairn-test-editor"
VIEWER_USER = "cairn-test-viewer"
AGGREGATION_TIMEOUT_S = 60


def _render(helm: pathlib.Path, values: dict[str, str]) -> list[dict[str, Any]]:
    return helmtools.documents(helmtools.template(helm, namespace="cairn-system", values=values))


def _kinds(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


@pytest.mark.parametrize("replicas", [0, 1])
def test_no_disruption_budget_for_at_most_one_replica(helm: pathlib.Path, replicas: int) -> None:
    docs = _render(helm, {"replicaCount": str(replicas)})
    assert _kinds(docs, "PodDisruptionBudget") == []


def test_disruption_budget_keeps_one_of_several_replicas(helm: pathlib.Path) -> None:
    docs = _render(helm, {"replicaCount": "3"})
    [pdb] = _kinds(docs, "PodDisruptionBudget")
    [deployment] = _kinds(docs, "Deployment")
    assert pdb["metadata"]["namespace"] == "cairn-system"
    assert pdb["spec"] == {
        "minAvailable": 1,
        "selector": deployment["spec"]["selector"],
    }


def test_user_roles_aggregate_into_view_and_edit(helm: pathlib.Path) -> None:
    roles = {d["metadata"]["name"]: d for d in _kinds(_render(helm, {}), "ClusterRole")}
    viewer, editor = (roles[name] for name in helmtools.USER_ROLES)
    aggregate = "rbac.authorization.k8s.io/aggregate-to-"
    assert {k for k, v in viewer["metadata"]["labels"].items() if k.startswith(aggregate)} == {
        f"{aggregate}{role}" for role in ("view", "edit", "admin")
    }
    assert {k for k, v in editor["metadata"]["labels"].items() if k.startswith(aggregate)} == {
        f"{aggregate}{role}" for role in ("edit", "admin")
    }
    assert all(v == "true" for k, v in editor["metadata"]["labels"].items() if aggregate in k)
    verbs = {r["resources"][0]: set(r["verbs"]) for r in editor["rules"]}
    assert "create" in verbs["trainingjobs"]
    assert verbs["trainingjobs/status"] == {"get", "list", "watch"}  # status is not the user's
    assert all(set(r["verbs"]) == {"get", "list", "watch"} for r in viewer["rules"])


@pytest.mark.parametrize("values", [{"rbac.userRoles": "false"}, {"crds.install": "false"}])
def test_user_roles_switch_off(helm: pathlib.Path, values: dict[str, str]) -> None:
    names = {d["metadata"]["name"] for d in _kinds(_render(helm, values), "ClusterRole")}
    assert not names & set(helmtools.USER_ROLES)


def _as(handle: DevclusterHandle, user: str, *args: str, stdin: str | None = None) -> str:
    """kubectl impersonating `user`; stdout, or the error text of a refusal."""
    result = helmtools.run(
        [str(helmtools.KUBECTL), f"--as={user}", *args], kubeconfig=handle.kubeconfig, stdin=stdin
    )
    return result.stdout if result.returncode == 0 else f"ERROR {result.stderr}"


def _can(handle: DevclusterHandle, user: str, verb: str, resource: str, namespace: str) -> bool:
    answer = _as(handle, user, "auth", "can-i", verb, resource, "-n", namespace)
    return answer.strip() == "yes"


@pytest.fixture
def user_roles(helm: pathlib.Path, devcluster: DevclusterHandle) -> Iterator[None]:
    """The chart's user roles (and its CRD) applied to the cluster, deleted afterwards."""
    text = helmtools.ok(
        helmtools.run(
            [
                str(helm),
                "template",
                "cairn",
                str(helmtools.CHART),
                "--kube-version",
                helmtools.KUBE_VERSION,
                "--show-only",
                "templates/crd.yaml",
                "--show-only",
                "templates/user-roles.yaml",
            ]
        )
    )
    apply = ["apply", "--server-side", "--force-conflicts", "--field-manager=chart-test"]
    helmtools.kubectl(devcluster.kubeconfig, *apply, "-f", "-", stdin=text)
    yield
    helmtools.kubectl(
        devcluster.kubeconfig, "delete", "clusterrole", *helmtools.USER_ROLES, "--ignore-not-found"
    )


def _bind(handle: DevclusterHandle, *, namespace: str, role: str, user: str) -> None:
    helmtools.kubectl(
        handle.kubeconfig,
        "create",
        "rolebinding",
        f"{user}-{role}",
        f"--clusterrole={role}",
        f"--user={user}",
        "-n",
        namespace,
    )


JOB = {
    "apiVersion": "cairn.dev/v1alpha1",
    "kind": "TrainingJob",
    "metadata": {"name": "by-an-editor"},
    "spec": {
        # Another controller's job: a Cairn operator on the cluster leaves it alone.
        "managedBy": "example.com/not-cairn",
        "nodes": 1,
        "image": "cairn-trainer:dev",
        "command": ["python", "-c", "pass"],
        "checkpoint": {"upload": {"uri": "s3://cairn-test/by-an-editor"}},
    },
}


@pytest.mark.cluster
def test_namespace_edit_user_creates_a_trainingjob(
    devcluster: DevclusterHandle, user_roles: None
) -> None:
    with (
        temp_namespace(devcluster.core, prefix="chart-roles") as namespace,
        temp_namespace(devcluster.core, prefix="chart-roles-other") as other,
    ):
        _bind(devcluster, namespace=namespace, role="edit", user=EDITOR_USER)
        _bind(devcluster, namespace=namespace, role="view", user=VIEWER_USER)
        # The controller-manager aggregates the labelled roles into edit/view.
        kube_helpers.wait_for(
            lambda: (
                _can(devcluster, EDITOR_USER, "create", "trainingjobs.cairn.dev", namespace)
                and _can(devcluster, VIEWER_USER, "list", "trainingjobs.cairn.dev", namespace)
            ),
            timeout=AGGREGATION_TIMEOUT_S,
            what="ClusterRole aggregation of the chart's user roles into edit and view",
        )
        created = _as(
            devcluster,
            EDITOR_USER,
            "create",
            "-n",
            namespace,
            "-f",
            "-",
            "-o",
            "name",
            stdin=yaml.safe_dump(JOB),
        )
        assert created.strip() == "trainingjob.cairn.dev/by-an-editor", created
        elsewhere = _as(
            devcluster, EDITOR_USER, "create", "-n", other, "-f", "-", stdin=yaml.safe_dump(JOB)
        )
        assert elsewhere.startswith("ERROR") and "forbidden" in elsewhere, elsewhere
        assert not _can(devcluster, EDITOR_USER, "patch", "trainingjobs.cairn.dev", other)
        status = _as(
            devcluster,
            EDITOR_USER,
            "patch",
            "trainingjob",
            "by-an-editor",
            "-n",
            namespace,
            "--subresource=status",
            "--type=merge",
            "-p",
            '{"status": {"step": 99}}',
        )
        assert status.startswith("ERROR") and "forbidden" in status, status
        read = _as(devcluster, VIEWER_USER, "get", "trainingjob", "-n", namespace, "-o", "name")
        assert read.strip() == "trainingjob.cairn.dev/by-an-editor", read
        by_viewer = {**JOB, "metadata": {"name": "by-a-viewer"}}
        refused = _as(
            devcluster,
            VIEWER_USER,
            "create",
            "-n",
            namespace,
            "-f",
            "-",
            stdin=yaml.safe_dump(by_viewer),
        )
        assert refused.startswith("ERROR") and "forbidden" in refused, refused


@pytest.mark.cluster
@pytest.mark.parametrize("user_roles", [True, False])
def test_notes_walk_a_new_user_through(
    helm: pathlib.Path, devcluster: DevclusterHandle, user_roles: bool
) -> None:
    out = helmtools.ok(
        helmtools.run(
            [
                str(helm),
                "install",
                "notes",
                str(helmtools.CHART),
                "--namespace",
                "default",
                "--dry-run=server",
                "--take-ownership",  # the CRD other tests applied from crds/
                "--set",
                f"rbac.userRoles={str(user_roles).lower()}",
            ],
            kubeconfig=devcluster.kubeconfig,
        )
    )
    notes = out.split("\nNOTES:\n", 1)[1]
    assert "pip install 'cairn-training[trainer]'" in notes
    assert "pip install 'cairn-training[plugin]'" in notes
    assert "pip install cairn" not in notes.replace("pip install 'cairn-training", "")
    assert "create secret generic" in notes and "credentialsSecretRef" in notes
    assert ("cairn-trainingjob-editor" in notes) is user_roles
