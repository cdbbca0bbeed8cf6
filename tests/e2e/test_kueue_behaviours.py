"""End to end: three documented Kueue behaviours, on the real operator and Kueue v0.19.2.

One namespace, one ClusterQueue and LocalQueue of this module's own (unique
names; the shared ``cairn-cq`` is never touched), room for two tiny 1-node jobs
(each pod asks 500m/512Mi). Each case is one named test:

- the priority boost decides Kueue's victim: two running jobs of the same
  priority, the later-admitted one (Kueue's own choice of victim on a tie)
  carries ``priority-boost: 1`` for its uncommitted minute; a high-priority job
  arrives and Kueue evicts the *other* one;
- a Workload deleted by hand: the job is held (Suspending: reason ``Suspending``
  or ``QueuedByKueue``, whichever a poll catches), a new
  Workload is created and admitted, and the job resumes from its checkpoint;
- a shrunk quota: Kueue v0.19.2 evicts nothing when ``nominalQuota`` drops under
  a running job (the job keeps committing); the way to take the quota back now
  is to stop the ClusterQueue (``stopPolicy: HoldAndDrain``): Kueue evicts, the
  job takes its final checkpoint and shows ``Suspended``/``PreemptedByKueue``,
  and resumes from that step when the queue runs again.

Prints each case's numbers on a line starting with ``E2E-NUMBERS``.
"""

import json
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from cairn.devcluster import kueue
from cairn.operator.core import conditions
from cairn.operator.core import kueueplan as protocol
from tests import demo
from tests.integration.operator import kueue_helpers as kq

pytestmark = [pytest.mark.e2e, pytest.mark.cluster, pytest.mark.timeout(900)]

TWO_JOBS = {"cpu": "1", "memory": "1Gi"}
NO_QUOTA = {"cpu": "0", "memory": "0"}
STEP_DELAY = 0.2
LONG = 100_000
"""Steps (or an interval) no test reaches: the job is deleted or the case ends first."""
WAIT = 300.0
POLL = 0.5


class Space:
    """The module's namespace, bucket and queues."""

    def __init__(self, devcluster: Any) -> None:
        suffix = uuid.uuid4().hex[:8]
        self.devcluster = devcluster
        self.namespace = f"e2e-kb-{suffix}"
        self.bucket = f"e2e-kb-{suffix}"
        self.cluster_queue = f"cairn-kb-{suffix}"
        self.custom = client.CustomObjectsApi(devcluster.api_client)

    def body(
        self, name: str, *, interval: int, steps: int = LONG, priority: str = kq.LOW
    ) -> dict[str, Any]:
        """A 1-node, dim-16 job in this module's queue (rank 0 reports its step every 2 s)."""
        body = demo.quickstart_manifest(self.devcluster.target, name=name)
        spec = body["spec"]
        spec["nodes"] = 1
        spec["args"] = ["--steps", str(steps), "--dim", "16", "--layers", "1"]
        spec["args"] += ["--batch-per-rank", "2", "--step-delay", str(STEP_DELAY)]
        spec["checkpoint"]["intervalSteps"] = interval
        spec["checkpoint"]["statusIntervalSeconds"] = 2
        spec["checkpoint"]["upload"]["uri"] = f"s3://{self.bucket}/{name}"
        labels = body["metadata"].setdefault("labels", {})
        labels[protocol.QUEUE_LABEL] = kueue.LOCAL_QUEUE
        labels[protocol.PRIORITY_LABEL] = priority
        return body

    def create(self, body: dict[str, Any]) -> None:
        self.custom.create_namespaced_custom_object(
            demo.GROUP, demo.VERSION, self.namespace, demo.PLURAL, body
        )

    def job(self, name: str) -> dict[str, Any]:
        return demo.get_job(self.custom, self.namespace, name)

    def wait_job(
        self, name: str, predicate: Callable[[dict[str, Any]], bool], *, what: str
    ) -> dict[str, Any]:
        deadline = time.monotonic() + WAIT
        last: dict[str, Any] = {}
        while time.monotonic() < deadline:
            last = self.job(name)
            if predicate(last):
                return last
            if _phase(last) == "Failed":
                break
            time.sleep(POLL)
        raise AssertionError(
            f"job {name}: {what} not within {WAIT:.0f}s; status {last.get('status')}"
        )

    def workload(self, job: str) -> dict[str, Any] | None:
        return demo.retrying(lambda: kq.workload(self.devcluster.api_client, self.namespace, job))

    def wait_workload(
        self, job: str, predicate: Callable[[dict[str, Any]], bool], *, what: str
    ) -> dict[str, Any]:
        return kq.wait_workload(
            self.devcluster.api_client, self.namespace, job, predicate, what=what, timeout=WAIT
        )

    def stop_policy(self, policy: str) -> None:
        self.custom.patch_cluster_custom_object(
            protocol.GROUP,
            protocol.VERSION,
            "clusterqueues",
            self.cluster_queue,
            {"spec": {"stopPolicy": policy}},
        )


@pytest.fixture(scope="module")
def space(devcluster: Any, operator_process: Any) -> Iterator[Space]:
    here = Space(devcluster)
    demo.prepare_namespace(
        api_client=devcluster.api_client,
        target=devcluster.target,
        namespace=here.namespace,
        bucket=here.bucket,
    )
    kq.kueue_ready(devcluster.target)
    kq.ensure_priority_classes(devcluster.api_client)
    kueue.ensure_queues(
        devcluster.target,
        namespace=here.namespace,
        quota=TWO_JOBS,
        cluster_queue_name=here.cluster_queue,
    )
    try:
        yield here
    finally:
        kq.drain(devcluster.api_client, here.namespace)
        _ignore_missing(
            lambda: here.custom.delete_cluster_custom_object(
                protocol.GROUP, protocol.VERSION, "clusterqueues", here.cluster_queue
            )
        )
        _ignore_missing(
            lambda: client.CoreV1Api(devcluster.api_client).delete_namespace(here.namespace)
        )


def _ignore_missing(delete: Callable[[], object]) -> None:
    try:
        delete()
    except ApiException as exc:
        if exc.status != 404:
            raise


@pytest.fixture
def fresh_queue(space: Space, operator_process: Any) -> Iterator[Space]:
    """Each case starts with the module's queue empty and running, and leaves it so."""
    operator_process.ensure_running()
    try:
        yield space
    finally:
        kq.drain(space.devcluster.api_client, space.namespace)
        kueue.set_quota(space.devcluster.target, TWO_JOBS, cluster_queue_name=space.cluster_queue)
        space.stop_policy("None")


def _phase(job: dict[str, Any]) -> str:
    return str((job.get("status") or {}).get("phase", ""))


def _step(job: dict[str, Any], key: str) -> int:
    found = (((job.get("status") or {}).get("checkpoints") or {}).get(key) or {}).get("step")
    return int(found) if found is not None else 0


def _reason(job: dict[str, Any]) -> str:
    """Why the job is Suspending or Suspended (its ``Suspended`` condition's reason)."""
    if _phase(job) not in ("Suspending", "Suspended"):
        return ""
    for cond in (job.get("status") or {}).get("conditions") or ():
        if cond.get("type") == "Suspended":
            return str(cond.get("reason", ""))
    return ""


def _running_with_commit(step: int) -> Callable[[dict[str, Any]], bool]:
    return lambda job: _phase(job) == "Running" and _step(job, "lastCommitted") >= step


def _boost(raw: dict[str, Any] | None) -> str | None:
    return ((raw or {}).get("metadata", {}).get("annotations") or {}).get(protocol.BOOST_ANNOTATION)


def _reserved_at(raw: dict[str, Any] | None) -> str:
    return str((kq.condition(raw, protocol.QUOTA_RESERVED) or {}).get("lastTransitionTime", ""))


def _numbers(**values: object) -> None:
    print(f"E2E-NUMBERS {json.dumps(values, sort_keys=True)}", flush=True)


def test_priority_boost_changes_kueues_victim(fresh_queue: Space) -> None:
    space = fresh_queue
    started = time.monotonic()
    # "fresh" commits every 2 steps (boost 0); "stale" never commits (boost 1 after a minute).
    space.create(space.body("fresh", interval=2))
    space.wait_job("fresh", _running_with_commit(2), what="Running with a commit")
    space.create(space.body("stale", interval=LONG))
    space.wait_job("stale", lambda j: _phase(j) == "Running", what="Running")
    stale_wl = space.wait_workload("stale", lambda w: _boost(w) == "1", what="boost 1")
    fresh_wl = space.workload("fresh")
    # On equal priority Kueue evicts the later-admitted Workload first: without the
    # boost, "stale" would be the victim.
    assert _reserved_at(stale_wl) > _reserved_at(fresh_wl), (stale_wl, fresh_wl)
    assert _boost(fresh_wl) is None, fresh_wl
    assert _step(space.job("stale"), "lastCommitted") == 0

    space.create(space.body("urgent", interval=LONG, priority=kq.HIGH))
    evicted = space.wait_workload(
        "fresh", lambda w: kq.is_true(w, protocol.EVICTED), what="evicted"
    )
    space.wait_job("urgent", lambda j: _phase(j) == "Running", what="Running")
    stale_after = space.workload("stale")
    stale_job = space.job("stale")
    fresh_job = space.wait_job(
        "fresh", lambda j: _reason(j) == protocol.REASON_PREEMPTED, what="PreemptedByKueue"
    )
    _numbers(
        test="kueue_boost_victim",
        stale_boost=_boost(stale_wl),
        eviction=kq.condition(evicted, protocol.EVICTED),
        wall_seconds=round(time.monotonic() - started, 1),
    )
    assert (kq.condition(evicted, protocol.EVICTED) or {}).get("reason") == "Preempted"
    assert not kq.is_true(stale_after, protocol.EVICTED), stale_after
    assert _phase(stale_job) == "Running", stale_job.get("status")
    assert _phase(fresh_job) in ("Suspending", "Suspended"), fresh_job.get("status")


def test_workload_deleted_by_hand_requeues_the_job(fresh_queue: Space) -> None:
    space = fresh_queue
    started = time.monotonic()
    space.create(space.body("orphan", interval=5, steps=60))
    space.wait_job("orphan", _running_with_commit(5), what="Running with a commit")
    old = space.workload("orphan")
    assert old is not None
    old_uid = old["metadata"]["uid"]
    committed = _step(space.job("orphan"), "lastCommitted")
    client.CustomObjectsApi(space.devcluster.api_client).delete_namespaced_custom_object(
        protocol.GROUP, protocol.VERSION, space.namespace, protocol.PLURAL, old["metadata"]["name"]
    )
    seen: list[tuple[str, str]] = []

    def record(job: dict[str, Any]) -> bool:
        now = (_phase(job), _reason(job))
        if not seen or seen[-1] != now:
            seen.append(now)
        return _phase(job) in ("Succeeded", "Failed")

    final = space.wait_job("orphan", record, what="finished")
    new = space.workload("orphan")
    status = final["status"]
    resumed = (status.get("checkpoints") or {}).get("resumedFrom") or {}
    _numbers(
        test="kueue_workload_deleted",
        committed_at_delete=committed,
        phases=seen,
        resumed_from=resumed.get("step"),
        wall_seconds=round(time.monotonic() - started, 1),
    )
    assert new is not None and new["metadata"]["uid"] != old_uid
    # Stopped by the suspend path (not a failure restart: restarts 0 below). Which
    # reason a poll catches while Suspending is timing: the generic "Suspending"
    # before the hold is planned, QueuedByKueue after; a new Workload admitted
    # before the old pods are gone goes Suspending -> Starting, never Suspended.
    stopped = [
        (phase, why)
        for phase, why in seen
        if phase in ("Suspending", "Suspended")
        and why in (protocol.REASON_QUEUED, conditions.REASON_SUSPENDING)
    ]
    assert stopped, seen
    assert status["phase"] == "Succeeded", status
    assert status["attempt"] == 2 and (status.get("restarts") or 0) == 0, status
    assert int(resumed.get("step", 0)) >= committed, status
    assert _step(final, "lastCommitted") == 60


def test_shrunk_quota_keeps_the_job_and_a_drained_queue_evicts_it(fresh_queue: Space) -> None:
    space = fresh_queue
    target = space.devcluster.target
    started = time.monotonic()
    space.create(space.body("steady", interval=5, steps=120))
    before = space.wait_job("steady", _running_with_commit(5), what="Running with a commit")

    # nominalQuota under the running job: Kueue v0.19.2 evicts nothing; the job trains on.
    kueue.set_quota(target, NO_QUOTA, cluster_queue_name=space.cluster_queue)
    shrunk_at = _step(before, "lastCommitted")
    kept = space.wait_job(
        "steady", _running_with_commit(shrunk_at + 10), what="two more commits on no quota"
    )
    workload = space.workload("steady")
    assert not kq.is_true(workload, protocol.EVICTED), workload
    assert "admission" in ((workload or {}).get("status") or {}), workload

    # Stopping the ClusterQueue does evict: final checkpoint, Suspended, quota released.
    space.stop_policy("HoldAndDrain")
    evicted = space.wait_workload(
        "steady", lambda w: kq.is_true(w, protocol.EVICTED), what="evicted"
    )
    held = space.wait_job(
        "steady",
        lambda j: _phase(j) == "Suspended" and _reason(j) == protocol.REASON_PREEMPTED,
        what="Suspended by the eviction",
    )
    space.wait_workload(
        "steady", lambda w: "admission" not in (w.get("status") or {}), what="quota released"
    )
    saved = _step(held, "lastCommitted")
    kueue.set_quota(target, TWO_JOBS, cluster_queue_name=space.cluster_queue)
    space.stop_policy("None")
    final = space.wait_job("steady", lambda j: _phase(j) in ("Succeeded", "Failed"), what="end")
    status = final["status"]
    resumed = status["checkpoints"]["resumedFrom"]
    _numbers(
        test="kueue_quota_shrunk_then_drained",
        committed_on_no_quota=_step(kept, "lastCommitted") - shrunk_at,
        eviction=kq.condition(evicted, protocol.EVICTED),
        final_checkpoint_step=saved,
        step_when_stopped=held["status"].get("step"),
        resumed_from=resumed,
        wall_seconds=round(time.monotonic() - started, 1),
    )
    assert (kq.condition(evicted, protocol.EVICTED) or {}).get("reason") == "ClusterQueueStopped"
    assert saved > shrunk_at and saved == held["status"].get("step"), held["status"]
    assert _step(held, "lastUploaded") == saved
    assert status["phase"] == "Succeeded", status
    assert resumed["step"] == saved
    assert status["attempt"] == 2 and (status.get("restarts") or 0) == 0, status
