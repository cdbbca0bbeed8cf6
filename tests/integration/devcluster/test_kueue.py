"""The devcluster's Kueue: the real v0.19.2 manager, CRDs and webhooks.

Covers, with hand-made Workloads (as an external owner such as Cairn's
operator writes them) in a ClusterQueue of the test's own:
- a Workload within quota is admitted with the default flavor;
- one over quota stays pending with Kueue's reason, and is admitted once
  `set_quota` makes room;
- a higher-priority Workload preempts a lower one (Evicted, reason
  Preempted); after the owner releases the quota as the protocol says
  (status.admission cleared, QuotaReserved False) the preemptor is admitted;
- Kueue's own webhooks run: an invalid `priority-boost` annotation is refused
  (the PriorityBoost gate is on);
- only v1beta2 is served; `kueue.up` on a running Kueue is a no-op, and the
  devcluster lists Kueue as an on-demand component.
"""

import datetime
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from cairn.devcluster import cluster, kueue
from tests.integration.devcluster import kube_helpers

pytestmark = pytest.mark.cluster

GROUP, VERSION = kueue.API_GROUP, "v1beta2"
WAIT_SECONDS = 60.0


@pytest.fixture
def namespace(devcluster: Any) -> Iterator[str]:
    yield from kube_helpers.temp_namespace(devcluster.core, prefix="kq")


@pytest.fixture
def queue(
    kueue_cluster: cluster.Cluster, namespace: str, devcluster: Any
) -> Iterator[tuple[str, str]]:
    """A ClusterQueue of this test's own (1 cpu, 1Gi) and `cairn-lq` in `namespace`."""
    name = f"cq-{uuid.uuid4().hex[:8]}"
    kueue.ensure_queues(
        kueue_cluster,
        namespace=namespace,
        quota={"cpu": "1", "memory": "1Gi"},
        cluster_queue_name=name,
    )
    yield name, namespace
    objects = client.CustomObjectsApi(devcluster.api_client)
    for wl in objects.list_namespaced_custom_object(GROUP, VERSION, namespace, "workloads")[
        "items"
    ]:
        objects.delete_namespaced_custom_object(
            GROUP, VERSION, namespace, "workloads", wl["metadata"]["name"]
        )
    objects.delete_cluster_custom_object(GROUP, VERSION, "clusterqueues", name)


def _workload(name: str, *, cpu: str, priority: int = 0) -> dict[str, Any]:
    requests = {"cpu": cpu, "memory": "100Mi"}
    return kueue.workload(name, queue=kueue.LOCAL_QUEUE, priority=priority, requests=requests)


class Workloads:
    """The Workload API of one namespace, through the real API server."""

    def __init__(self, api_client: client.ApiClient, namespace: str) -> None:
        self.api = client.CustomObjectsApi(api_client)
        self.namespace = namespace

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        created: dict[str, Any] = self.api.create_namespaced_custom_object(
            GROUP, VERSION, self.namespace, "workloads", body
        )
        return created

    def get(self, name: str) -> dict[str, Any]:
        got: dict[str, Any] = self.api.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, "workloads", name
        )
        return got

    def condition(self, name: str, kind: str) -> dict[str, Any] | None:
        for cond in self.get(name).get("status", {}).get("conditions", []):
            if cond["type"] == kind:
                return dict(cond)
        return None

    def wait_condition(self, name: str, kind: str, status: str) -> dict[str, Any]:
        def matches() -> dict[str, Any] | None:
            cond = self.condition(name, kind)
            return cond if cond is not None and cond["status"] == status else None

        found: dict[str, Any] = kube_helpers.wait_for(
            matches, timeout=WAIT_SECONDS, what=f"Workload {name} {kind}={status}"
        )
        return found

    def release_quota(self, name: str) -> None:
        """What an owner Kueue does not integrate does after eviction (pods stopped)."""
        wl = self.get(name)
        conditions = [
            c for c in wl["status"]["conditions"] if c["type"] not in ("QuotaReserved", "Admitted")
        ]
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        for kind in ("QuotaReserved", "Admitted"):
            conditions.append(
                {
                    "type": kind,
                    "status": "False",
                    "reason": "Pending",
                    "message": "released by the owner after eviction",
                    "lastTransitionTime": now,
                }
            )
        self.api.patch_namespaced_custom_object_status(
            GROUP,
            VERSION,
            self.namespace,
            "workloads",
            name,
            {"status": {"admission": None, "conditions": conditions}},
        )


@pytest.fixture
def workloads(devcluster: Any, queue: tuple[str, str]) -> Workloads:
    return Workloads(devcluster.api_client, queue[1])


def test_workload_within_quota_is_admitted(workloads: Workloads, queue: tuple[str, str]) -> None:
    workloads.create(_workload("fits", cpu="500m"))
    workloads.wait_condition("fits", "Admitted", "True")
    admission = workloads.get("fits")["status"]["admission"]
    assert admission["clusterQueue"] == queue[0]
    (assignment,) = admission["podSetAssignments"]
    assert assignment["flavors"] == {"cpu": kueue.DEFAULT_FLAVOR, "memory": kueue.DEFAULT_FLAVOR}


def test_over_quota_stays_pending_until_the_quota_grows(
    workloads: Workloads, queue: tuple[str, str], kueue_cluster: cluster.Cluster
) -> None:
    workloads.create(_workload("too-big", cpu="2"))
    pending = workloads.wait_condition("too-big", "QuotaReserved", "False")
    assert pending["reason"] == "Pending"
    assert "cpu" in pending["message"]
    assert "admission" not in workloads.get("too-big").get("status", {})

    kueue.set_quota(kueue_cluster, {"cpu": "2", "memory": "1Gi"}, cluster_queue_name=queue[0])
    workloads.wait_condition("too-big", "Admitted", "True")


def test_higher_priority_preempts_and_is_admitted_after_release(workloads: Workloads) -> None:
    workloads.create(_workload("low", cpu="1", priority=0))
    workloads.wait_condition("low", "Admitted", "True")

    workloads.create(_workload("high", cpu="1", priority=100))
    evicted = workloads.wait_condition("low", "Evicted", "True")
    assert evicted["reason"] == "Preempted"
    # Kueue does not stop what it does not integrate: the quota stays held by
    # "low" (its admission is still recorded) until its owner releases it.
    assert workloads.get("low")["status"]["admission"]["clusterQueue"]
    high = workloads.condition("high", "Admitted")
    assert high is None or high["status"] == "False"

    workloads.release_quota("low")
    workloads.wait_condition("high", "Admitted", "True")
    assert "admission" not in workloads.get("low")["status"]


def test_kueue_webhook_refuses_invalid_priority_boost(workloads: Workloads) -> None:
    body = _workload("bad-boost", cpu="100m")
    body["metadata"]["annotations"] = {"kueue.x-k8s.io/priority-boost": "lots"}
    with pytest.raises(ApiException) as refused:
        workloads.create(body)
    assert refused.value.status in (403, 422)
    assert "must be a valid signed integer" in str(refused.value.body)


def test_only_v1beta2_is_served(kueue_cluster: cluster.Cluster) -> None:
    status, body = kueue.api_request(kueue_cluster, "GET", f"/apis/{GROUP}")
    assert status == 200
    assert [v["version"] for v in body["versions"]] == ["v1beta2"]


def test_up_again_is_a_noop_and_status_lists_kueue(kueue_cluster: cluster.Cluster) -> None:
    assert kueue.up(kueue_cluster).already_running
    assert cluster.optional_components(kueue_cluster)[kueue.COMPONENT]
    assert kueue.running(kueue_cluster)


def test_real_module_crds_all_have_v1beta2() -> None:
    names = {crd["metadata"]["name"] for crd in kueue.crds(kueue.module_dir())}
    assert {
        "workloads.kueue.x-k8s.io",
        "clusterqueues.kueue.x-k8s.io",
        "localqueues.kueue.x-k8s.io",
        "resourceflavors.kueue.x-k8s.io",
        "workloadpriorityclasses.kueue.x-k8s.io",
    } <= names
