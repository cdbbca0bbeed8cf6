"""Kueue test helpers shared by the integration and e2e tests (test code, not tests).

The devcluster's Kueue (``cairn.devcluster.kueue``: v0.19.2, PriorityBoost on)
is started by :func:`kueue_ready` (idempotent, bounded); these helpers read a
job's Workload and create the WorkloadPriorityClasses the tests name.
"""

import time
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from cairn.devcluster import cluster, kueue
from cairn.operator.core import kueueplan as protocol

KUEUE_START_SECONDS = 900.0
"""Bound of the first start: it may build Kueue from the Go module proxy (~7 min)."""
LOW, HIGH = "cairn-test-low", "cairn-test-high"
PRIORITIES = {LOW: 100, HIGH: 1000}


def kueue_ready(target: cluster.Cluster) -> None:
    target.kueue_up(timeout=KUEUE_START_SECONDS)


def drain(api_client: client.ApiClient, namespace: str, *, timeout: float = 120.0) -> None:
    """Delete the namespace's TrainingJobs and wait until their Workloads are gone:
    the ClusterQueue is shared, so quota held here would starve the next test."""
    custom = client.CustomObjectsApi(api_client)
    jobs = custom.list_namespaced_custom_object("cairn.dev", "v1alpha1", namespace, "trainingjobs")
    for job in jobs.get("items", []):
        try:
            custom.delete_namespaced_custom_object(
                "cairn.dev", "v1alpha1", namespace, "trainingjobs", job["metadata"]["name"]
            )
        except ApiException as error:
            if error.status != 404:
                raise
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = custom.list_namespaced_custom_object(
            protocol.GROUP, protocol.VERSION, namespace, protocol.PLURAL
        ).get("items", [])
        if not left:
            return
        time.sleep(0.5)
    raise AssertionError(f"Workloads left in {namespace} after {timeout:.0f}s: {left}")


def ensure_priority_classes(api_client: client.ApiClient) -> None:
    custom = client.CustomObjectsApi(api_client)
    for name, value in PRIORITIES.items():
        body = {
            "apiVersion": protocol.API_VERSION,
            "kind": "WorkloadPriorityClass",
            "metadata": {"name": name},
            "value": value,
        }
        try:
            custom.create_cluster_custom_object(
                protocol.GROUP, protocol.VERSION, protocol.PRIORITY_CLASSES, body
            )
        except ApiException as error:
            if error.status != 409:
                raise


def queued(body: dict[str, Any], *, priority: str | None = None) -> dict[str, Any]:
    """``body`` labelled for the devcluster's LocalQueue (and a priority class)."""
    labels = body["metadata"].setdefault("labels", {})
    labels[protocol.QUEUE_LABEL] = kueue.LOCAL_QUEUE
    if priority is not None:
        labels[protocol.PRIORITY_LABEL] = priority
    return body


def workloads(api_client: client.ApiClient, namespace: str, job: str) -> list[dict[str, Any]]:
    """The Workloads Cairn made for ``job`` (its job-name label)."""
    found = client.CustomObjectsApi(api_client).list_namespaced_custom_object(
        protocol.GROUP,
        protocol.VERSION,
        namespace,
        protocol.PLURAL,
        label_selector=f"cairn.dev/job-name={job}",
    )
    items: list[dict[str, Any]] = found.get("items", [])
    return items


def workload(api_client: client.ApiClient, namespace: str, job: str) -> dict[str, Any] | None:
    found = workloads(api_client, namespace, job)
    return found[0] if found else None


def condition(raw: dict[str, Any] | None, kind: str) -> dict[str, Any] | None:
    for cond in ((raw or {}).get("status") or {}).get("conditions") or ():
        if cond.get("type") == kind:
            return dict(cond)
    return None


def is_true(raw: dict[str, Any] | None, kind: str) -> bool:
    found = condition(raw, kind)
    return found is not None and found.get("status") == "True"


def wait_workload(
    api_client: client.ApiClient,
    namespace: str,
    job: str,
    predicate: Any,
    *,
    what: str,
    timeout: float = 60.0,
    poll: float = 0.2,
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    last: dict[str, Any] | None = None
    while time.monotonic() < deadline:
        last = workload(api_client, namespace, job)
        if last is not None and predicate(last):
            return last
        time.sleep(poll)
    raise AssertionError(f"Workload of {job}: {what} not within {timeout:.0f}s; last: {last}")
