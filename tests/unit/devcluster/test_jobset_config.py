"""How the scale anchor bench configures JobSet's manager: pure mappings, no cluster.

Covers: the JobSet body (one replicated job, an Indexed Job of `replicas`
pods at once, the pod spec copied, not shared; zero pods refused); every
webhook of JobSet's manifests pointed at loopback with the cluster CA, the
pod webhooks restricted to pods of a JobSet (so no other pod create depends
on the manager), the input left as it was; the manager's configuration (no
leader election, no internal certs, loopback webhook, metrics off) and argv
(client limits as flags); the build is pinned, versioned, and not one of the
bundles `devcluster up` builds; `down` deletes the webhooks before the CRD.
"""

import base64
import pathlib
from typing import Any

import pytest

from cairn.devcluster import build, errors, jobset

POD_SPEC: dict[str, Any] = {
    "restartPolicy": "Never",
    "containers": [{"name": "trainer", "image": "img", "command": ["true"]}],
}


def test_jobset_is_one_replicated_indexed_job_of_the_given_pods() -> None:
    body = jobset.jobset("js-1", replicas=2, pod_spec=POD_SPEC, namespace="ns")
    assert body == {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": "js-1", "namespace": "ns"},
        "spec": {
            "replicatedJobs": [
                {
                    "name": "workers",
                    "replicas": 1,
                    "template": {
                        "spec": {
                            "completionMode": "Indexed",
                            "completions": 2,
                            "parallelism": 2,
                            "backoffLimit": 0,
                            "template": {"spec": POD_SPEC},
                        }
                    },
                }
            ]
        },
    }


def test_jobset_copies_the_pod_spec() -> None:
    body = jobset.jobset("js-1", replicas=1, pod_spec=POD_SPEC)
    template = body["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    template["containers"][0]["name"] = "changed"
    assert POD_SPEC["containers"][0]["name"] == "trainer"
    assert "namespace" not in body["metadata"]


def test_jobset_without_pods_is_refused() -> None:
    with pytest.raises(errors.DevclusterError, match="at least one pod"):
        jobset.jobset("js-1", replicas=0, pod_spec=POD_SPEC)


def _hook(name: str, group: str, path: str) -> dict[str, Any]:
    return {
        "name": name,
        "clientConfig": {
            "service": {"name": "webhook-service", "namespace": "system", "path": path}
        },
        "failurePolicy": "Fail",
        "rules": [{"apiGroups": [group], "resources": ["x"], "operations": ["CREATE"]}],
    }


MANIFESTS: list[dict[str, Any]] = [
    {
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": "mutating-webhook-configuration"},
        "webhooks": [
            _hook("mjobset.kb.io", "jobset.x-k8s.io", "/mutate-jobset"),
            _hook("mpod.kb.io", "", "/mutate--v1-pod"),
        ],
    },
    {
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": "validating-webhook-configuration"},
        "webhooks": [_hook("vpod.kb.io", "", "/validate--v1-pod")],
    },
]


def test_webhooks_point_at_loopback_with_the_cluster_ca() -> None:
    out = jobset.webhook_configurations(
        MANIFESTS, url_base="https://127.0.0.1:19543", ca_bundle=b"CA"
    )
    assert [d["metadata"]["name"] for d in out] == [
        "jobset-mutating-webhook-configuration",
        "jobset-validating-webhook-configuration",
    ]
    first = out[0]["webhooks"][0]
    assert first["clientConfig"] == {
        "url": "https://127.0.0.1:19543/mutate-jobset",
        "caBundle": base64.b64encode(b"CA").decode(),
    }
    assert first["timeoutSeconds"] == 10 and first["sideEffects"] == "None"
    assert "objectSelector" not in first  # JobSet's own resources: every one
    assert "service" in MANIFESTS[0]["webhooks"][0]["clientConfig"]  # input untouched


def test_pod_webhooks_only_see_pods_of_a_jobset() -> None:
    out = jobset.webhook_configurations(MANIFESTS, url_base="https://x", ca_bundle=b"")
    pod_hooks = [out[0]["webhooks"][1], out[1]["webhooks"][0]]
    for hook in pod_hooks:
        assert hook["objectSelector"] == {
            "matchExpressions": [{"key": "jobset.sigs.k8s.io/jobset-name", "operator": "Exists"}]
        }


def test_manager_config_is_loopback_without_leader_election_or_cert_rotation() -> None:
    ports = jobset.JobSetPorts(webhook=1, health=2)
    config = jobset.manager_config(cert_dir=pathlib.Path("/c"), ports=ports)
    assert config["webhook"] == {"host": "127.0.0.1", "port": 1, "certDir": "/c"}
    assert config["health"] == {"healthProbeBindAddress": "127.0.0.1:2"}
    assert config["metrics"] == {"bindAddress": "0"}
    assert config["leaderElection"] == {"leaderElect": False}
    assert config["internalCertManagement"] == {"enable": False}


def test_manager_command_sets_the_client_limits() -> None:
    argv = jobset.manager_command(
        config_path=pathlib.Path("/c.yaml"),
        kubeconfig=pathlib.Path("/k"),
        limits=jobset.ClientLimits(qps=1000, burst=2000),
    )
    assert argv[0] == str(jobset.BUNDLE.binary("jobset"))
    assert "--kube-api-qps=1000" in argv and "--kube-api-burst=2000" in argv
    assert "--config=/c.yaml" in argv and "--kubeconfig=/k" in argv


def test_build_is_pinned_and_not_built_by_devcluster_up() -> None:
    assert jobset.BUNDLE.version == jobset.JOBSET_VERSION
    assert jobset.BUNDLE.bin_dir.name == f"jobset-{jobset.JOBSET_VERSION}"
    assert jobset.BUNDLE.commands == ("jobset",)
    assert jobset.BUNDLE not in build.BUNDLES
    assert (jobset.BUNDLE.module_dir / "go.mod").read_text().count(jobset.JOBSET_VERSION) == 1


def test_down_deletes_the_webhooks_before_the_crd() -> None:
    paths = jobset.installed_paths()
    assert paths[-1].endswith("/customresourcedefinitions/jobsets.jobset.x-k8s.io")
    assert all("webhookconfigurations/jobset-" in p for p in paths[:-1])
