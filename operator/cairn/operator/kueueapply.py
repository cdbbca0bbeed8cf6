"""The Workload protocol's side effects: read a queued job's Workload, keep it in step.

``reconcile.reconcile_once`` calls :func:`read` before it plans (the plan holds
the job until Kueue admits it, and places its pods where the admission says)
and :func:`sync` after it applied the plan. Every decision is ``kueueplan``'s
(pure); this module only reads and writes the API:

- no Workload yet: create it (owner: the job, controller=true), with the
  WorkloadPriorityClass value when the job names one;
- ``spec.suspend`` follows into the Workload's ``spec.active`` (a suspended
  job gives its quota back through Kueue's own deactivation);
- evicted, the job recorded Suspended and every pod of its own (``podowner``)
  gone (also in a fresh list, not only the watch cache): release the quota on ``workloads/status``
  and post ``KueueQuotaReleased``;
- ``PodsReady`` follows the phase (Kueue's ``waitForPodsReady`` reads it);
- the job ended: ``Finished=True``;
- running: the ``kueue.x-k8s.io/priority-boost`` annotation follows the
  uncommitted work (``kueue.boost``), re-checked when its bucket turns.

Workload writes carry the resourceVersion they were decided on; a 409 means
Kueue wrote in between and the next reconcile (``RETRY_SECONDS``) decides again.
"""

import dataclasses
import datetime
import json
import logging
from typing import Any

from kubernetes.client import exceptions as k8s_exceptions

from cairn.api import jobstatus, podenv, trainingjob
from cairn.operator import jobapply, kubeapi
from cairn.operator.core import (
    builders,
    jobobserve,
    k8stypes,
    kueueboost,
    kueueplan,
    names,
    podowner,
)

LOG = logging.getLogger(__name__)
RETRY_SECONDS = 2.0
"""Next look after a write that lost a race or a Workload not created yet."""
WARNING_RETRY_SECONDS = 15.0
_RUNNING_PHASES: frozenset[str] = frozenset({"Starting", "Running", "Restarting"})
_warned: dict[tuple[str, str], str] = {}
"""The last Warning posted per job, so a retry loop does not repeat it."""


def _get_workload(api: kubeapi.KubeApi, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        found: dict[str, Any] = api.custom.get_namespaced_custom_object(
            kueueplan.GROUP, kueueplan.VERSION, namespace, kueueplan.PLURAL, name
        )
    except k8s_exceptions.ApiException as error:
        if error.status == 404:
            return None
        raise
    return found


def _flavors(api: kubeapi.KubeApi, workload: kueueplan.Workload) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name in workload.flavors:
        try:
            out[name] = api.custom.get_cluster_custom_object(
                kueueplan.GROUP, kueueplan.VERSION, kueueplan.FLAVORS, name
            )
        except k8s_exceptions.ApiException as error:
            if error.status != 404:
                raise
            LOG.warning("ResourceFlavor %s of Workload %s not found", name, workload.name)
    return out


def read(
    api: kubeapi.KubeApi, job: trainingjob.TrainingJob | jobobserve.InvalidJob
) -> kueueplan.Queue | None:
    """The job's Workload as the plan needs it; None for a job that is not queued."""
    if isinstance(job, jobobserve.InvalidJob) or not job.spec.managed_by_cairn:
        return None
    queue = kueueplan.queue_name(job)
    if queue is None:
        return None
    raw = _get_workload(api, job.metadata.namespace, kueueplan.workload_name(job))
    if raw is None:
        return kueueplan.Queue(name=queue)
    workload = kueueplan.parse_workload(raw)
    where = kueueplan.Placement()
    if workload.admitted and workload.evicted is None:
        where = kueueplan.placement(workload, _flavors(api, workload))
    return kueueplan.Queue(name=queue, workload=workload, placement=where)


def _priority(api: kubeapi.KubeApi, name: str) -> int | None:
    try:
        found = api.custom.get_cluster_custom_object(
            kueueplan.GROUP, kueueplan.VERSION, kueueplan.PRIORITY_CLASSES, name
        )
    except k8s_exceptions.ApiException as error:
        if error.status == 404:
            return None
        raise
    return int(found.get("value", 0))


def _warn(
    api: kubeapi.KubeApi, raw: dict[str, Any], *, message: str, now: datetime.datetime
) -> None:
    ref = jobapply.JobRef.of(raw)
    key = (ref.namespace, ref.name)
    if _warned.get(key) == message:
        return
    _warned[key] = message
    event = k8stypes.Event(type="Warning", reason=kueueplan.REASON_WORKLOAD_FAILED, message=message)
    jobapply.post_event(api, ref, event, now=now)


def _create(
    api: kubeapi.KubeApi,
    raw: dict[str, Any],
    job: trainingjob.TrainingJob,
    *,
    now: datetime.datetime,
) -> float:
    wanted = kueueplan.priority_class(job)
    priority: tuple[str, int] | None = None
    if wanted is not None:
        value = _priority(api, wanted)
        if value is None:
            _warn(api, raw, message=f"WorkloadPriorityClass {wanted} not found", now=now)
            return WARNING_RETRY_SECONDS
        priority = (wanted, value)
    pod = builders.pod(job, attempt=1, rank=0, resume=podenv.ResumeTarget(kind="latest"))
    body = kueueplan.desired_workload(
        job=job,
        owner=builders.owner_reference(job),
        template=kueueplan.pod_template(pod),
        priority=priority,
    )
    try:
        api.custom.create_namespaced_custom_object(
            kueueplan.GROUP,
            kueueplan.VERSION,
            job.metadata.namespace,
            kueueplan.PLURAL,
            body,
            field_manager=names.FIELD_MANAGER,
        )
    except k8s_exceptions.ApiException as error:
        if error.status == 409:
            return RETRY_SECONDS
        reason, message = jobapply.api_message(error)
        _warn(
            api,
            raw,
            message=f"Workload {body['metadata']['name']} not created ({reason}): {message}",
            now=now,
        )
        return WARNING_RETRY_SECONDS
    _warned.pop((job.metadata.namespace, job.metadata.name), None)
    LOG.info("created Workload %s for %s", body["metadata"]["name"], job.metadata.name)
    return RETRY_SECONDS


def _patch(
    api: kubeapi.KubeApi, namespace: str, name: str, body: dict[str, Any], *, status: bool
) -> bool:
    """Merge-patch the Workload (or its /status); False when it lost a race (409/404)."""
    call = (
        api.custom.patch_namespaced_custom_object_status
        if status
        else api.custom.patch_namespaced_custom_object
    )
    try:
        call(
            kueueplan.GROUP,
            kueueplan.VERSION,
            namespace,
            kueueplan.PLURAL,
            name,
            body,
            field_manager=names.FIELD_MANAGER,
            _content_type=jobapply.MERGE_PATCH,
        )
    except k8s_exceptions.ApiException as error:
        if error.status in (404, 409):
            return False
        raise
    return True


def _live_pods(api: kubeapi.KubeApi, job: trainingjob.TrainingJob) -> int:
    """The job's own pods (``podowner``) whose containers may still run, from the
    API server itself: a pod that only carries the job's labels never holds the quota."""
    response = api.core.list_namespaced_pod(
        job.metadata.namespace,
        label_selector=f"{names.LABEL_JOB}={job.metadata.name}",
        _preload_content=False,
    )
    parsed = (jobobserve.parse_pod(item) for item in json.loads(response.data).get("items") or ())
    owner = {"job_name": job.metadata.name, "job_uid": job.metadata.uid}
    return sum(1 for p in parsed if p and podowner.owns(p, **owner) and not p.terminated)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Released:
    """What a quota release did (for the Event and the tests)."""

    workload: str
    committed: str
    uploaded: str


def _release(
    api: kubeapi.KubeApi,
    raw: dict[str, Any],
    job: trainingjob.TrainingJob,
    workload: kueueplan.Workload,
    *,
    now: datetime.datetime,
) -> bool:
    """Give the quota back once no pod of the job is live; False: not yet."""
    patch = kueueplan.release_patch(workload, now=now)
    if patch is None or _live_pods(api, job):
        return False
    if not _patch(api, job.metadata.namespace, workload.name, patch, status=True):
        return False
    done = Released(
        workload=workload.name,
        committed=kueueplan.committed_step(job),
        uploaded=kueueplan.uploaded_step(job),
    )
    message = kueueplan.MSG_RELEASED.format(
        workload=done.workload, committed=done.committed, uploaded=done.uploaded
    )
    LOG.info("%s/%s: %s", job.metadata.namespace, job.metadata.name, message)
    event = k8stypes.Event(type="Normal", reason=kueueplan.REASON_QUOTA_RELEASED, message=message)
    jobapply.post_event(api, jobapply.JobRef.of(raw), event, now=now)
    return True


def _phase(job: trainingjob.TrainingJob, decision: Any) -> jobstatus.Phase:
    if decision is not None:
        phase: jobstatus.Phase = decision.phase
        return phase
    return job.status.phase or "Pending"


def sync(
    api: kubeapi.KubeApi,
    *,
    raw: dict[str, Any],
    job: trainingjob.TrainingJob | jobobserve.InvalidJob,
    queue: kueueplan.Queue | None,
    decision: Any,
    now: datetime.datetime,
) -> float | None:
    """Bring the Workload in step with the job (``decision``: this reconcile's
    ``lifecycle.Decision``, None when nothing changed); seconds until it wants
    another look, None when only a change needs one."""
    if queue is None or isinstance(job, jobobserve.InvalidJob):
        return None
    if job.metadata.deletion_timestamp is not None:
        return None
    phase = _phase(job, decision)
    workload = queue.workload
    namespace = job.metadata.namespace
    if phase in jobstatus.TERMINAL_PHASES:
        if workload is not None:
            patch = kueueplan.finished_patch(
                workload,
                succeeded=phase == "Succeeded",
                message=kueueplan.MSG_FINISHED.format(phase=phase.lower()),
                now=now,
            )
            if patch is not None and not _patch(api, namespace, workload.name, patch, status=True):
                return RETRY_SECONDS
        return None
    if workload is None:
        return _create(api, raw, job, now=now)
    if workload.active == job.spec.suspend:
        _patch(
            api, namespace, workload.name, {"spec": {"active": not job.spec.suspend}}, status=False
        )
    if workload.evicted is not None:
        # Suspended: this reconcile's plan saw no live pod and recorded it (status
        # first); _release confirms from a fresh list before giving the quota back.
        stopped = phase == "Suspended"
        if workload.quota_reserved and not (stopped and _release(api, raw, job, workload, now=now)):
            return RETRY_SECONDS
        return None
    ready = kueueplan.pods_ready_patch(workload, phase=phase, now=now)
    if ready is not None and not _patch(api, namespace, workload.name, ready, status=True):
        return RETRY_SECONDS
    running = phase in _RUNNING_PHASES and workload.admitted
    desired = kueueboost.boost(job, now=now) if running else 0
    patch = kueueboost.boost_patch(workload.boost, desired)
    if patch is not None:
        _patch(api, namespace, workload.name, patch, status=False)
    return kueueboost.next_boost_change(job, now=now) if running else None
