"""Fixtures for the kubectl plugin's tests: the CRD, a namespace, a job with a status.

The plugin lives in ``plugin/cairn/kubectl_plugin``. Until pyproject maps it
(package-dir ``cairn.kubectl_plugin``), the ``plugin`` source root is put on
``sys.path`` here so the ``cairn`` namespace finds it; with the mapping in place
this is a no-op.
"""

import importlib.util
import pathlib
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from cairn.devcluster import build
from tests.conftest import DevclusterHandle
from tests.integration.devcluster import kube_helpers

REPO = pathlib.Path(__file__).resolve().parents[3]
PLUGIN_ROOT = REPO / "plugin"
if importlib.util.find_spec("cairn.kubectl_plugin") is None:
    sys.path.insert(0, str(PLUGIN_ROOT))
    import cairn

    cairn.__path__.append(str(PLUGIN_ROOT / "cairn"))

KUBECTL = build.KUBERNETES.bin_dir / "kubectl"
NOT_CAIRN = "example.com/not-cairn"
"""spec.managedBy of test jobs: any Cairn operator running on the cluster leaves them alone."""


def kubectl(handle: DevclusterHandle, *args: str, stdin: str | None = None) -> str:
    result = subprocess.run(
        [str(KUBECTL), f"--kubeconfig={handle.kubeconfig}", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if result.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} failed: {result.stderr}")
    return result.stdout


@pytest.fixture(scope="session")
def crd(devcluster: DevclusterHandle) -> None:
    """The TrainingJob CRD from crds/ (idempotent; other tests apply the same file)."""
    kubectl(devcluster, "apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    kubectl(
        devcluster,
        "wait",
        "--for=condition=Established",
        "--timeout=30s",
        "crd/trainingjobs.cairn.dev",
    )


@pytest.fixture
def namespace(devcluster: DevclusterHandle, crd: None) -> Iterator[str]:
    yield from kube_helpers.temp_namespace(devcluster.core, prefix="plugin")


def custom(handle: DevclusterHandle) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(handle.api_client)


def create_job(handle: DevclusterHandle, namespace: str, name: str, **spec: Any) -> dict[str, Any]:
    body = {
        "apiVersion": "cairn.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "managedBy": NOT_CAIRN,
            "nodes": 2,
            "image": "cairn-trainer:dev",
            "command": ["python", "-c", "pass"],
            "checkpoint": {"upload": {"uri": f"s3://cairn-test/{name}"}},
            **spec,
        },
    }
    job: dict[str, Any] = custom(handle).create_namespaced_custom_object(
        "cairn.dev", "v1alpha1", namespace, "trainingjobs", body
    )
    return job


def patch_status(
    handle: DevclusterHandle, namespace: str, name: str, status: dict[str, Any]
) -> dict[str, Any]:
    """What the operator and the writer would write, through the status subresource."""
    job: dict[str, Any] = custom(handle).patch_namespaced_custom_object_status(
        "cairn.dev",
        "v1alpha1",
        namespace,
        "trainingjobs",
        name,
        {"status": status},
        _content_type="application/merge-patch+json",
    )
    return job
