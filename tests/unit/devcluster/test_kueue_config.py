"""How the devcluster configures Kueue: pure mappings, no cluster.

Covers: CRDs keep only v1beta2 (served and stored, no conversion) and a CRD
without it is refused; only Kueue's own webhooks are installed, pointed at
loopback with the devcluster CA; the manager's configuration (feature gates,
no leader election, no internal certs, loopback webhook, metrics off) and
argv; the queue manifests (covered resources are exactly the quota's keys, an
empty quota is refused); API paths; `up --with-kueue` and its environment
switch; the build is pinned and versioned like etcd/Kubernetes. Bad input:
`kueue.up` without a running API server, and a busy webhook port, each stop
with one line saying what to do, before anything is started. `devcluster
down` stops a process recorded as Kueue by its PID (a stand-in process, in a
state dir of the test's own).
"""

import base64
import pathlib
import socket
from typing import Any

import pytest

from cairn.devcluster import build, cli, cluster, controlplane, errors, kueue, paths, processes


def _crd(*versions: str, conversion: bool = True) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "workloads.kueue.x-k8s.io"},
        "spec": {
            "group": "kueue.x-k8s.io",
            "versions": [{"name": v, "served": True, "storage": v == "v1beta1"} for v in versions],
        },
    }
    if conversion:
        doc["spec"]["conversion"] = {"strategy": "None"}
    return doc


def test_crd_keeps_only_v1beta2_as_storage_without_conversion() -> None:
    original = _crd("v1beta1", "v1beta2")
    out = kueue.served_v1beta2(original)
    assert out["spec"]["versions"] == [{"name": "v1beta2", "served": True, "storage": True}]
    assert "conversion" not in out["spec"]
    assert len(original["spec"]["versions"]) == 2  # the input is not modified


def test_crd_without_v1beta2_is_refused() -> None:
    with pytest.raises(errors.DevclusterError, match="no v1beta2"):
        kueue.served_v1beta2(_crd("v1beta1", conversion=False))


def _hook(name: str, group: str, path: str) -> dict[str, Any]:
    return {
        "name": name,
        "clientConfig": {
            "service": {"name": "webhook-service", "namespace": "system", "path": path}
        },
        "failurePolicy": "Fail",
        "rules": [{"apiGroups": [group], "resources": ["x"], "apiVersions": ["v1"]}],
    }


def test_only_kueue_own_webhooks_are_installed_on_loopback() -> None:
    manifests = [
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": "mutating-webhook-configuration"},
            "webhooks": [
                _hook("mpod.kb.io", "", "/mutate--v1-pod"),
                _hook("mjob.kb.io", "batch", "/mutate-batch-v1-job"),
                _hook("mworkload.kb.io", "kueue.x-k8s.io", "/mutate-workload"),
            ],
        }
    ]
    (out,) = kueue.webhook_configurations(
        manifests, url_base="https://127.0.0.1:19443", ca_bundle=b"CA PEM"
    )
    assert out["metadata"] == {"name": "kueue-mutating-webhook-configuration"}
    assert [h["name"] for h in out["webhooks"]] == ["mworkload.kb.io"]
    hook = out["webhooks"][0]
    assert hook["clientConfig"] == {
        "url": "https://127.0.0.1:19443/mutate-workload",
        "caBundle": base64.b64encode(b"CA PEM").decode(),
    }
    assert hook["sideEffects"] == "None"
    assert hook["failurePolicy"] == "Fail"


def test_webhook_spanning_kueue_and_another_group_is_dropped() -> None:
    mixed = _hook("mixed", "kueue.x-k8s.io", "/m")
    mixed["rules"].append({"apiGroups": ["apps"], "resources": ["deployments"]})
    manifests: list[dict[str, Any]] = [
        {"kind": "ValidatingWebhookConfiguration", "metadata": {"name": "v"}, "webhooks": [mixed]}
    ]
    (out,) = kueue.webhook_configurations(manifests, url_base="https://x", ca_bundle=b"")
    assert out["webhooks"] == []


def test_manager_config_turns_priority_boost_on_and_visibility_off() -> None:
    config = kueue.manager_config(cert_dir=pathlib.Path("/c"), ports=kueue.KueuePorts())
    assert config["featureGates"] == {"PriorityBoost": True, "VisibilityOnDemand": False}
    assert config["leaderElection"] == {"leaderElect": False}
    assert config["internalCertManagement"] == {"enable": False}
    assert config["webhook"] == {"host": "127.0.0.1", "port": 19443, "certDir": "/c"}
    assert config["health"] == {"healthProbeBindAddress": "127.0.0.1:19444"}
    assert config["metrics"] == {"bindAddress": "0"}
    assert config["manageJobsWithoutQueueName"] is False


def test_manager_command_runs_the_pinned_binary_with_config_and_kubeconfig() -> None:
    argv = kueue.manager_command(
        config_path=pathlib.Path("/s/kueue/config.yaml"), kubeconfig=pathlib.Path("/s/admin")
    )
    assert argv[0] == str(build.KUEUE.binary("kueue"))
    assert "--config=/s/kueue/config.yaml" in argv
    assert "--kubeconfig=/s/admin" in argv


def test_kueue_bundle_is_pinned_and_cached_by_version() -> None:
    assert build.KUEUE in build.BUNDLES
    assert build.KUEUE.bin_dir.name == "kueue-v0.19.2"
    assert build.KUEUE.commands == ("kueue",)
    go_mod = (build.KUEUE.module_dir / "go.mod").read_text()
    assert "require sigs.k8s.io/kueue v0.19.2" in go_mod
    assert "replace" not in go_mod
    # The checksum database lacks this module: go.sum must carry it (seeded from Kueue's).
    assert (
        "sigs.k8s.io/scheduler-library v0.1.0-alpha1 h1:"
        in (build.KUEUE.module_dir / "go.sum").read_text()
    )


def test_cluster_queue_covers_exactly_the_quota() -> None:
    cq = kueue.cluster_queue(name="q", quota={"memory": "4Gi", "cpu": "2"})
    (group,) = cq["spec"]["resourceGroups"]
    assert group["coveredResources"] == ["cpu", "memory"]
    (flavor,) = group["flavors"]
    assert flavor["name"] == kueue.DEFAULT_FLAVOR
    assert flavor["resources"] == [
        {"name": "cpu", "nominalQuota": "2"},
        {"name": "memory", "nominalQuota": "4Gi"},
    ]
    assert cq["spec"]["preemption"]["withinClusterQueue"] == "LowerPriority"
    assert cq["spec"]["namespaceSelector"] == {}


def test_cluster_queue_without_quota_is_refused() -> None:
    with pytest.raises(errors.DevclusterError, match="at least one"):
        kueue.cluster_queue(quota={})


def test_default_names_and_local_queue() -> None:
    lq = kueue.local_queue(namespace="ns")
    assert lq["metadata"] == {"name": "cairn-lq", "namespace": "ns"}
    assert lq["spec"] == {"clusterQueue": "cairn-cq"}
    assert kueue.resource_flavor()["metadata"]["name"] == "default-flavor"


@pytest.mark.parametrize(
    ("obj", "path"),
    [
        (
            kueue.local_queue(namespace="ns"),
            "/apis/kueue.x-k8s.io/v1beta2/namespaces/ns/localqueues/cairn-lq",
        ),
        (kueue.cluster_queue(), "/apis/kueue.x-k8s.io/v1beta2/clusterqueues/cairn-cq"),
        (
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "k"}},
            "/api/v1/namespaces/k",
        ),
    ],
)
def test_object_path(obj: dict[str, Any], path: str) -> None:
    assert kueue.object_path(obj) == path


@pytest.mark.parametrize(
    ("flag", "env", "expected"),
    [
        (True, {}, True),
        (False, {}, False),
        (False, {"CAIRN_DEVCLUSTER_KUEUE": "1"}, True),
        (False, {"CAIRN_DEVCLUSTER_KUEUE": "0"}, False),
        (False, {"CAIRN_DEVCLUSTER_KUEUE": " True "}, True),
    ],
)
def test_with_kueue_from_flag_or_environment(
    flag: bool, env: dict[str, str], expected: bool
) -> None:
    assert cli.with_kueue(flag=flag, environ=env) is expected


def _unreachable_cluster(tmp_path: pathlib.Path) -> cluster.Cluster:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    return cluster.Cluster(
        state=paths.StatePaths(root=tmp_path / "state"),
        ports=controlplane.Ports(apiserver=free),
    )


def test_up_without_a_running_api_server_says_run_devcluster_up(tmp_path: pathlib.Path) -> None:
    target = _unreachable_cluster(tmp_path)
    with pytest.raises(errors.DevclusterError, match="not ready: run `devcluster up`"):
        kueue.up(target, timeout=5.0)
    assert not kueue.running(target)


def test_busy_webhook_port_is_named_before_anything_starts(tmp_path: pathlib.Path) -> None:
    target = _unreachable_cluster(tmp_path)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(errors.DevclusterError, match=rf"port\(s\) {port}(, \d+)? on 127.0.0.1"):
            kueue._start(target, kueue.KueuePorts(webhook=port, health=port + 1))
    assert not target.state.pidfile(kueue.COMPONENT).exists()
    assert not (kueue.state_dir(target) / "config.yaml").exists()


def test_devcluster_down_stops_kueue_by_pid(tmp_path: pathlib.Path) -> None:
    target = _unreachable_cluster(tmp_path)
    tracked = processes.spawn(
        name=kueue.COMPONENT,
        argv=["sleep", "60"],
        log_path=target.state.log(kueue.COMPONENT),
        pidfile=target.state.pidfile(kueue.COMPONENT),
    )
    assert cluster.optional_components(target)[kueue.COMPONENT]
    cluster.down(target)
    assert not processes.is_alive(tracked)
    assert not target.state.pidfile(kueue.COMPONENT).exists()
    assert not kueue.running(target)
