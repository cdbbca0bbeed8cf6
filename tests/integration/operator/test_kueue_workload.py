"""Kueue's Workload protocol on a real API server with real Kueue v0.19.2.

The shared operator, the devcluster's Kueue (its CRDs, webhooks and manager,
PriorityBoost on) and tiny ``python -c`` pods. Covers:

- a queued job gets one Workload (owner: the job, controller; one pod set of
  ``nodes`` pods with the pods' real requests), waits Suspended with the
  reason ``QueuedByKueue`` and Kueue's own message while over quota, and no
  pod exists before ``Admitted=True``; raising the quota admits it, and the
  finished job marks its Workload ``Finished=True``;
- ``spec.suspend`` mirrors into the Workload's ``spec.active`` (created
  inactive, reactivated and admitted on resume, deactivated and its quota
  released on a new suspend);
- a higher-priority job preempts a running one (its Workload showed
  ``PodsReady=True``, reason Started): the victim's pods are
  deleted (the Cairn suspend), it shows ``PreemptedByKueue``, and its quota
  is released on ``workloads/status`` only after every one of its pods is
  gone (ordered by etcd revision, not by time); re-admitted, it starts
  attempt 2 without a restart charged;
- admitted to a flavor with node labels and a toleration, every pod carries
  them and runs on that node; a priority class that does not exist is a
  Warning Event ``WorkloadNotCreated`` and the job waits, without pods;
- the ``kueue.x-k8s.io/priority-boost`` annotation follows the job's
  checkpoint age (the writer's status, written here by the test) and is
  removed when a commit leaves nothing uncommitted.
"""

import datetime
from collections.abc import Iterator
from typing import Any

import pytest

from cairn.devcluster import kueue
from cairn.operator.core import kueueplan as protocol
from tests.integration.devcluster import kube_helpers as kh
from tests.integration.operator import kueue_helpers as kq
from tests.integration.operator.conftest import (
    GROUP,
    PLURAL,
    SLEEP_FOREVER,
    VERSION,
    WAIT,
    Kube,
    Recorder,
    job_body,
)

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]

REQUESTS = {"requests": {"cpu": "500m", "memory": "64Mi"}}
"""Per pod: a 2-node job needs 1 cpu, 128Mi."""
ONE_JOB = {"cpu": "1", "memory": "1Gi"}
TOO_SMALL = {"cpu": "500m", "memory": "1Gi"}
EXIT_SOON = "import time; time.sleep(3)"


@pytest.fixture
def qkube(kube: Kube) -> Iterator[Kube]:
    kq.kueue_ready(kube.handle.target)
    kq.ensure_priority_classes(kube.api_client)
    kueue.ensure_queues(kube.handle.target, namespace=kube.namespace, quota=ONE_JOB)
    yield kube
    kq.drain(kube.api_client, kube.namespace)


def _rv(obj: dict[str, Any]) -> int:
    return int(obj["metadata"]["resourceVersion"])


def _recorders(kube: Kube, job: str) -> tuple[Recorder, Recorder]:
    """Every version of the job's pods and of its Workload from now on."""
    selector = f"cairn.dev/job-name={job}"
    listed = kube.core.list_namespaced_pod(kube.namespace)
    pods = Recorder(
        kube,
        kube.core.list_namespaced_pod,
        kube.namespace,
        label_selector=selector,
        resource_version=listed.metadata.resource_version,
    )
    seen = kube.custom.list_namespaced_custom_object(
        protocol.GROUP, protocol.VERSION, kube.namespace, protocol.PLURAL
    )
    workloads = Recorder(
        kube,
        kube.custom.list_namespaced_custom_object,
        protocol.GROUP,
        protocol.VERSION,
        kube.namespace,
        protocol.PLURAL,
        label_selector=selector,
        resource_version=seen["metadata"]["resourceVersion"],
    )
    return pods, workloads


def _suspended(status: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in status.get("conditions") or () if c["type"] == "Suspended")


def test_queued_job_waits_without_pods_and_runs_when_admitted(qkube: Kube) -> None:
    kueue.set_quota(qkube.handle.target, TOO_SMALL)
    pods, workloads = _recorders(qkube, "waits")
    try:
        job = qkube.create(kq.queued(job_body("waits", script=EXIT_SOON, resources=REQUESTS)))
        status = qkube.wait_status(
            "waits",
            "held with Kueue's reason",
            lambda s: (
                s.get("phase") == "Suspended" and "insufficient quota" in _suspended(s)["message"]
            ),
        )
        held = _suspended(status)
        assert held["reason"] == protocol.REASON_QUEUED
        assert held["message"].startswith(f"waiting for admission in queue {kueue.LOCAL_QUEUE}: ")
        qkube.wait_event("waits", protocol.REASON_QUEUED, contains=kueue.LOCAL_QUEUE)

        raw = kq.workload(qkube.api_client, qkube.namespace, "waits")
        assert raw is not None and not kq.is_true(raw, protocol.ADMITTED)
        [owner] = raw["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
            "TrainingJob",
            "waits",
            job["metadata"]["uid"],
            True,
        )
        [pod_set] = raw["spec"]["podSets"]
        assert (pod_set["name"], pod_set["count"], raw["spec"]["queueName"]) == (
            protocol.POD_SET,
            2,
            kueue.LOCAL_QUEUE,
        )
        container = pod_set["template"]["spec"]["containers"][0]
        assert container["resources"]["requests"] == REQUESTS["requests"]
        assert qkube.pods("waits") == []

        kueue.set_quota(qkube.handle.target, ONE_JOB)
        qkube.wait_phase("waits", "Succeeded", attempt=1)
        admitted_rv = next(
            _rv(obj) for _, obj in workloads.recorded() if kq.is_true(obj, protocol.ADMITTED)
        )
        created = [_rv(obj) for kind, obj in pods.recorded() if kind == "ADDED"]
        # No pod before admission (by etcd revision): both came after Admitted=True.
        assert len(created) == 2 and min(created) > admitted_rv
        kq.wait_workload(
            qkube.api_client,
            qkube.namespace,
            "waits",
            lambda w: kq.is_true(w, protocol.FINISHED),
            what="Finished",
        )
    finally:
        pods.stop()
        workloads.stop()


def test_preemption_suspends_then_releases_quota_after_the_pods_are_gone(qkube: Kube) -> None:
    ns = qkube.namespace
    low = kq.queued(job_body("low", script=SLEEP_FOREVER, resources=REQUESTS), priority=kq.LOW)
    qkube.create(low)
    qkube.wait_phase("low", "Running", attempt=1, timeout=WAIT)
    started = kq.wait_workload(
        qkube.api_client,
        ns,
        "low",
        lambda w: kq.is_true(w, protocol.PODS_READY),
        what="PodsReady",
    )
    assert (kq.condition(started, protocol.PODS_READY) or {}).get("reason") == "Started"
    pods, workloads = _recorders(qkube, "low")
    try:
        high = kq.queued(
            job_body("high", script=SLEEP_FOREVER, resources=REQUESTS), priority=kq.HIGH
        )
        qkube.create(high)
        status = qkube.wait_status(
            "low",
            "Suspended after preemption",
            lambda s: (
                s.get("phase") == "Suspended"
                and _suspended(s)["reason"] == protocol.REASON_PREEMPTED
            ),
        )
        assert "preempted by Kueue" in _suspended(status)["message"]
        assert (status.get("restarts") or 0) == 0
        qkube.wait_phase("high", "Running", attempt=1)
        released = kq.wait_workload(
            qkube.api_client,
            ns,
            "low",
            lambda w: "admission" not in (w.get("status") or {}),
            what="quota released",
        )
        assert kq.is_true(released, protocol.REQUEUED)
        assert not kq.is_true(released, protocol.QUOTA_RESERVED)
        qkube.wait_event("low", protocol.REASON_QUOTA_RELEASED)
        qkube.wait_event("low", protocol.REASON_PREEMPTED)

        # Order by etcd revision: every pod of attempt 1 was gone before the release.
        history = workloads.recorded()
        release_rv = next(
            _rv(obj)
            for kind, obj in history
            if kind == "MODIFIED"
            and kq.is_true(obj, protocol.EVICTED)
            and "admission" not in (obj.get("status") or {})
        )
        deleted = [_rv(obj) for kind, obj in pods.recorded() if kind == "DELETED"]
        assert len(deleted) == 2 and max(deleted) < release_rv

        # The high job leaves: the low one is admitted again and starts attempt 2, uncharged.
        qkube.custom.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "high")
        again = qkube.wait_phase("low", "Running", attempt=2, timeout=2 * WAIT)
        assert (again.get("restarts") or 0) == 0
        assert (again.get("restartsCountTowardsMax") or 0) == 0
    finally:
        pods.stop()
        workloads.stop()


def _ago(minutes: float) -> str:
    moment = datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=minutes)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _boost(kube: Kube, job: str) -> str | None:
    raw = kq.workload(kube.api_client, kube.namespace, job)
    annotations = ((raw or {}).get("metadata") or {}).get("annotations") or {}
    value: str | None = annotations.get(protocol.BOOST_ANNOTATION)
    return value


def _writer_status(kube: Kube, job: str, status: dict[str, Any]) -> None:
    """What the writer on rank 0 would report (written here as the admin)."""
    kube.custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, kube.namespace, PLURAL, job, {"status": status}
    )


def test_priority_boost_follows_checkpoint_age(qkube: Kube) -> None:
    qkube.create(kq.queued(job_body("aging", script=SLEEP_FOREVER, resources=REQUESTS)))
    qkube.wait_phase("aging", "Running", attempt=1)
    assert _boost(qkube, "aging") is None
    # The attempt started 20 min ago; the last commit was 10 min ago, 50 steps back.
    _writer_status(
        qkube,
        "aging",
        {
            "attemptStartTime": _ago(20),
            "step": 100,
            "checkpoints": {"lastCommitted": {"step": 50, "time": _ago(10)}},
        },
    )
    kh.wait_for(lambda: _boost(qkube, "aging") == "10", timeout=WAIT, what="boost 10")
    # A commit at the current step: nothing uncommitted, the annotation goes.
    _writer_status(
        qkube, "aging", {"checkpoints": {"lastCommitted": {"step": 100, "time": _ago(0)}}}
    )
    kh.wait_for(lambda: _boost(qkube, "aging") is None, timeout=WAIT, what="boost removed")
    # Steps again, the commit 3 minutes old: boost 3.
    _writer_status(
        qkube,
        "aging",
        {"step": 130, "checkpoints": {"lastCommitted": {"step": 100, "time": _ago(3)}}},
    )
    kh.wait_for(lambda: _boost(qkube, "aging") == "3", timeout=WAIT, what="boost 3")


def test_suspend_deactivates_the_workload_and_resume_reactivates_it(qkube: Kube) -> None:
    body = kq.queued(job_body("paused", script=SLEEP_FOREVER, resources=REQUESTS, suspend=True))
    qkube.create(body)
    raw = kq.wait_workload(
        qkube.api_client,
        qkube.namespace,
        "paused",
        lambda w: w["spec"].get("active") is False,
        what="created inactive",
    )
    status = qkube.wait_phase("paused", "Suspended")
    assert _suspended(status)["reason"] == "Suspended"  # the user's suspend, not Kueue's
    assert not kq.is_true(raw, protocol.QUOTA_RESERVED) and qkube.pods("paused") == []
    qkube.patch_spec("paused", {"suspend": False})
    kq.wait_workload(
        qkube.api_client,
        qkube.namespace,
        "paused",
        lambda w: w["spec"].get("active") is True and kq.is_true(w, protocol.ADMITTED),
        what="reactivated and admitted",
    )
    qkube.wait_phase("paused", "Running", attempt=1)
    # Suspended again while admitted: Kueue deactivates and evicts; the quota comes back.
    qkube.patch_spec("paused", {"suspend": True})
    qkube.wait_phase("paused", "Suspended")
    kq.wait_workload(
        qkube.api_client,
        qkube.namespace,
        "paused",
        lambda w: w["spec"].get("active") is False and "admission" not in (w.get("status") or {}),
        what="inactive with its quota released",
    )


def _own_queue(kube: Kube, *, node: str) -> tuple[str, str]:
    """A ResourceFlavor pinned to ``node`` (with a toleration), a ClusterQueue with
    room for one job in it, and a LocalQueue in the test's namespace."""
    flavor, queue = f"pinned-{kube.namespace}", f"cq-{kube.namespace}"
    custom = kube.custom
    custom.create_cluster_custom_object(
        protocol.GROUP,
        protocol.VERSION,
        protocol.FLAVORS,
        {
            "apiVersion": protocol.API_VERSION,
            "kind": "ResourceFlavor",
            "metadata": {"name": flavor},
            "spec": {"nodeLabels": {"kubernetes.io/hostname": node}, "tolerations": [PINNED]},
        },
    )
    custom.create_cluster_custom_object(
        protocol.GROUP,
        protocol.VERSION,
        "clusterqueues",
        {
            "apiVersion": protocol.API_VERSION,
            "kind": "ClusterQueue",
            "metadata": {"name": queue},
            "spec": {
                "namespaceSelector": {},
                "resourceGroups": [
                    {
                        "coveredResources": ["cpu", "memory"],
                        "flavors": [
                            {
                                "name": flavor,
                                "resources": [
                                    {"name": "cpu", "nominalQuota": "1"},
                                    {"name": "memory", "nominalQuota": "1Gi"},
                                ],
                            }
                        ],
                    }
                ],
            },
        },
    )
    custom.create_namespaced_custom_object(
        protocol.GROUP,
        protocol.VERSION,
        kube.namespace,
        "localqueues",
        {
            "apiVersion": protocol.API_VERSION,
            "kind": "LocalQueue",
            "metadata": {"name": "pinned"},
            "spec": {"clusterQueue": queue},
        },
    )
    return flavor, queue


PINNED = {"key": "cairn.dev/pinned", "operator": "Exists", "effect": "NoSchedule"}


def test_pods_run_where_the_admitted_flavor_says(qkube: Kube) -> None:
    node = sorted(n.metadata.name for n in qkube.core.list_node().items)[-1]
    flavor, queue = _own_queue(qkube, node=node)
    try:
        body = job_body("pinned", script=SLEEP_FOREVER, resources=REQUESTS)
        body["metadata"]["labels"] = {protocol.QUEUE_LABEL: "pinned"}
        qkube.create(body)
        pods = qkube.wait_pods_running("pinned", attempt=1, count=2)
        for pod in pods:
            assert pod.spec.node_selector == {"kubernetes.io/hostname": node}
            # The flavor's toleration (the API server adds its default not-ready ones).
            tolerations = [(t.key, t.operator, t.effect) for t in pod.spec.tolerations or ()]
            assert (PINNED["key"], PINNED["operator"], PINNED["effect"]) in tolerations
            assert pod.spec.node_name == node
        raw = kq.workload(qkube.api_client, qkube.namespace, "pinned")
        assignment = (raw or {})["status"]["admission"]["podSetAssignments"][0]
        assert set(assignment["flavors"].values()) == {flavor}
    finally:
        kq.drain(qkube.api_client, qkube.namespace)
        qkube.custom.delete_cluster_custom_object(
            protocol.GROUP, protocol.VERSION, "clusterqueues", queue
        )
        qkube.custom.delete_cluster_custom_object(
            protocol.GROUP, protocol.VERSION, protocol.FLAVORS, flavor
        )


def test_missing_priority_class_is_a_warning_and_the_job_waits(qkube: Kube) -> None:
    qkube.create(
        kq.queued(job_body("nopri", script=SLEEP_FOREVER, resources=REQUESTS), priority="absent")
    )
    qkube.wait_event(
        "nopri", protocol.REASON_WORKLOAD_FAILED, contains="WorkloadPriorityClass absent not found"
    )
    status = qkube.wait_phase("nopri", "Suspended")
    assert _suspended(status)["reason"] == protocol.REASON_QUEUED
    assert kq.workload(qkube.api_client, qkube.namespace, "nopri") is None
    assert qkube.pods("nopri") == []
