"""The chart as rendered by the pinned helm, and validated by the real API server.

Covers: ``helm lint --strict`` for default and non-default values;
values.schema.json rejecting bad values; the CRD template equals
``cairn.api.crdgen.crd()`` (the source of ``crds/``) apart from the chart's
labels and the keep annotation, and disappears with ``crds.install=false``;
RBAC rules equal ``cairn.operator.core.rbac`` in both watch scopes (ClusterRole,
or a Role per watched namespace); the Deployment's real command, probes,
security context, rolling update (leader election on); metrics Service and the
optional ServiceMonitor; and a server-side dry-run of the whole output on the
devcluster (kube-apiserver 1.34 schemas, RBAC, CRD validation) for four
value sets.
"""

import contextlib
import pathlib
from typing import Any

import pytest

from cairn.api import crdgen
from cairn.operator.core import rbac
from tests.conftest import DevclusterHandle
from tests.integration.devcluster import kube_helpers

from . import helmtools

temp_namespace = contextlib.contextmanager(kube_helpers.temp_namespace)

NAMESPACED: dict[str, str] = {"watch.scope": "namespaces", "watch.namespaces": "{ml-a,ml-b}"}
VALUE_SETS: dict[str, dict[str, str]] = {
    "default": {},
    "namespaced": NAMESPACED,
    "no-crd-no-metrics": {
        "crds.install": "false",
        "metrics.enabled": "false",
        "serviceAccount.name": "custom-sa",
        "operator.verbose": "true",
        "replicaCount": "0",
    },
    "pinned": {
        "image.tag": "0.1.0-rc1",
        "priorityClassName": "system-cluster-critical",
        "nodeSelector.kubernetes\\.io/os": "linux",
        "crds.keep": "false",
        "operator.extraArgs": "{--verbose}",
    },
}


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def operator_cluster_roles(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        d for d in by_kind(docs, "ClusterRole") if d["metadata"]["name"] not in helmtools.USER_ROLES
    ]


def render(
    helm: pathlib.Path, values: dict[str, str], namespace: str = "cairn-system"
) -> list[dict[str, Any]]:
    return helmtools.documents(helmtools.template(helm, namespace=namespace, values=values))


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_lint_strict(helm: pathlib.Path, name: str) -> None:
    out = helmtools.ok(
        helmtools.run(
            [
                str(helm),
                "lint",
                "--strict",
                str(helmtools.CHART),
                *helmtools.set_args(VALUE_SETS[name]),
            ]
        )
    )
    assert "0 chart(s) failed" in out
    assert "[WARNING]" not in out and "[ERROR]" not in out


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"watch.scope": "namespaces"}, "minItems"),
        ({"watch.namespaces": "{ml}"}, "maxItems"),
        ({"watch.scope": "everywhere"}, "watch/scope"),
        ({"replicaCount": "2", "leaderElection.enabled": "false"}, "maximum"),
        ({"operator.logFormat": "json"}, "logFormat"),
        ({"unknownKey": "1"}, "unknownKey"),
        ({"metrics.port": "0"}, "minimum"),
    ],
)
def test_schema_rejects(helm: pathlib.Path, values: dict[str, str], complaint: str) -> None:
    result = helmtools.run(
        [
            str(helm),
            "template",
            "x",
            str(helmtools.CHART),
            "--kube-version",
            helmtools.KUBE_VERSION,
            *helmtools.set_args(values),
        ]
    )
    assert result.returncode != 0
    assert "values don't meet the specifications of the schema" in result.stderr
    assert complaint in result.stderr


def test_crd_template_is_crdgen_output(helm: pathlib.Path) -> None:
    [crd] = by_kind(render(helm, {}), "CustomResourceDefinition")
    meta = crd["metadata"]
    assert meta.pop("annotations") == {"helm.sh/resource-policy": "keep"}
    assert meta.pop("labels")["app.kubernetes.io/managed-by"] == "Helm"
    assert crd == crdgen.crd()


def test_crd_switches(helm: pathlib.Path) -> None:
    assert by_kind(render(helm, {"crds.install": "false"}), "CustomResourceDefinition") == []
    [crd] = by_kind(render(helm, {"crds.keep": "false"}), "CustomResourceDefinition")
    assert "annotations" not in crd["metadata"]


def test_cluster_scope_rbac(helm: pathlib.Path) -> None:
    docs = render(helm, {})
    roles = {d["metadata"]["name"]: d["rules"] for d in operator_cluster_roles(docs)}
    assert roles == {
        "cairn": list(rbac.NAMESPACED_RULES + rbac.KUEUE_RULES),
        "cairn-cluster": list(rbac.CLUSTER_RULES + rbac.KUEUE_CLUSTER_RULES),
    }
    # The only namespaced RBAC: the leader-election Lease in the release namespace.
    assert [r["metadata"]["name"] for r in by_kind(docs, "Role")] == ["cairn-leader"]
    assert [b["metadata"]["name"] for b in by_kind(docs, "RoleBinding")] == ["cairn-leader"]
    for binding in by_kind(docs, "ClusterRoleBinding"):
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "cairn", "namespace": "cairn-system"}
        ]
    [deployment] = by_kind(docs, "Deployment")
    assert "--all-namespaces" in deployment["spec"]["template"]["spec"]["containers"][0]["command"]


def test_namespaced_rbac(helm: pathlib.Path) -> None:
    docs = render(helm, NAMESPACED)
    assert [d["metadata"]["name"] for d in operator_cluster_roles(docs)] == ["cairn-cluster"]
    roles = [r for r in by_kind(docs, "Role") if r["metadata"]["name"] != "cairn-leader"]
    assert [r["metadata"]["namespace"] for r in roles] == ["ml-a", "ml-b"]
    assert all(r["rules"] == list(rbac.NAMESPACED_RULES + rbac.KUEUE_RULES) for r in roles)
    bindings = [b for b in by_kind(docs, "RoleBinding") if b["metadata"]["name"] != "cairn-leader"]
    assert [b["metadata"]["namespace"] for b in bindings] == ["ml-a", "ml-b"]
    [deployment] = by_kind(docs, "Deployment")
    command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[-2:] == ["--namespace=ml-a", "--namespace=ml-b"]
    assert "--all-namespaces" not in command


def test_kueue_rbac_switch(helm: pathlib.Path) -> None:
    """rbac.kueue=false leaves out the Workload rules in both scopes."""
    for values in ({"rbac.kueue": "false"}, {**NAMESPACED, "rbac.kueue": "false"}):
        docs = render(helm, values)
        rules = [
            r for d in by_kind(docs, "ClusterRole") + by_kind(docs, "Role") for r in d["rules"]
        ]
        assert rules and not [r for r in rules if "kueue.x-k8s.io" in r["apiGroups"]]


def test_deployment(helm: pathlib.Path) -> None:
    [deployment] = by_kind(render(helm, {}), "Deployment")
    spec = deployment["spec"]
    # Leader election (default on) makes a rolling update safe.
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "RollingUpdate"}
    pod = spec["template"]["spec"]
    [container] = pod["containers"]
    assert container["command"] == [
        "python",
        "-m",
        "cairn.operator",
        "--liveness=http://0.0.0.0:8080/healthz",
        "--all-namespaces",
    ]
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert {"name": "health", "containerPort": 8080, "protocol": "TCP"} in container["ports"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "privileged": False,
        "capabilities": {"drop": ["ALL"]},
    }
    assert container["resources"]["requests"] == {"cpu": "50m", "memory": "256Mi"}
    assert container["resources"]["limits"] == {"memory": "768Mi"}
    [spread] = pod["topologySpreadConstraints"]
    assert spread["labelSelector"]["matchLabels"] == spec["selector"]["matchLabels"]
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    assert pod["serviceAccountName"] == "cairn"


def test_metrics(helm: pathlib.Path) -> None:
    docs = render(helm, {"metrics.serviceMonitor.enabled": "true"})
    [service] = by_kind(docs, "Service")
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"}
    ]
    [monitor] = by_kind(docs, "ServiceMonitor")
    assert monitor["spec"]["endpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "30s"}
    ]
    assert monitor["spec"]["selector"] == {"matchLabels": service["spec"]["selector"]}
    assert by_kind(render(helm, {"metrics.enabled": "false"}), "Service") == []


@pytest.mark.cluster
@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_server_side_dry_run(helm: pathlib.Path, devcluster: DevclusterHandle, name: str) -> None:
    with temp_namespace(devcluster.core, prefix="chart-dry") as namespace:
        values = dict(VALUE_SETS[name])
        if name == "namespaced":
            values["watch.namespaces"] = f"{{{namespace}}}"
        text = helmtools.template(helm, namespace=namespace, values=values)
        out = helmtools.kubectl(
            devcluster.kubeconfig,
            "apply",
            "--dry-run=server",
            "--server-side",
            "--force-conflicts",
            "--field-manager=helm-dry-run",
            "-f",
            "-",
            stdin=text,
        )
        kinds = {line.split("/")[0] for line in out.splitlines()}
        expected = {d["kind"].lower() for d in helmtools.documents(text)}
        assert {k.split(".")[0] for k in kinds} == expected
        assert all(line.endswith("(server dry run)") for line in out.splitlines())
