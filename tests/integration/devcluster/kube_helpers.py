"""Helpers for tests against the devcluster: namespaces, bounded waits, the S3 Secret."""

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException


def wait_for(predicate: Callable[[], Any], *, timeout: float, what: str) -> Any:
    """Poll until `predicate()` is truthy; fail naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def wait_for_default_service_account(core: client.CoreV1Api, namespace: str) -> None:
    """The ServiceAccount admission plugin rejects pods in a new namespace until
    the controller-manager has created its `default` ServiceAccount."""

    def exists() -> bool:
        try:
            core.read_namespaced_service_account("default", namespace)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    wait_for(exists, timeout=30, what=f"ServiceAccount {namespace}/default")


def temp_namespace(core: client.CoreV1Api, prefix: str = "t") -> Iterator[str]:
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    wait_for_default_service_account(core, name)
    try:
        yield name
    finally:
        try:
            core.delete_namespace(name)
        except ApiException as exc:
            if exc.status != 404:
                raise


def pod_phase(core: client.CoreV1Api, name: str, namespace: str) -> str | None:
    try:
        return str(core.read_namespaced_pod(name, namespace).status.phase)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def python_pod(
    name: str,
    code: str,
    *,
    restart_policy: str = "Never",
    **spec: Any,
) -> dict[str, Any]:
    """A pod whose single container runs `python -c code`."""
    container = {"name": "main", "image": "python:3.11", "command": ["python", "-c", code]}
    container.update(spec.pop("container", {}))
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": restart_policy,
            "terminationGracePeriodSeconds": spec.pop("grace", 30),
            "containers": [container],
            **spec,
        },
    }


def pod_log(core: client.CoreV1Api, name: str, namespace: str, **kwargs: Any) -> str:
    """The raw log text (the client would otherwise parse JSON-looking logs)."""
    response = core.read_namespaced_pod_log(name, namespace, _preload_content=False, **kwargs)
    return str(response.data.decode())


def s3_secret(name: str, *, access_key: str, secret_key: str) -> client.V1Secret:
    """The Secret a TrainingJob's ``upload.credentialsSecret`` names (the S3 key pair)."""
    return client.V1Secret(
        metadata=client.V1ObjectMeta(name=name),
        string_data={"AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": secret_key},
    )
