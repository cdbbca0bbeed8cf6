"""Kueue's Workload protocol for queued TrainingJobs: the pure decisions.

Pure (no kopf, no Kubernetes client): ``kueueapply`` reads the job's
``Workload`` (``kueue.x-k8s.io/v1beta2``) and the ResourceFlavors its admission
names, turns them into a :class:`Queue` with :func:`parse_workload` and
:func:`placement`, and ``lifecycle.decide`` asks :func:`hold` whether the job
may run. ``kueueapply`` applies what this module decides: the desired Workload
(:func:`desired_workload`), the quota release after an eviction
(:func:`release_patch`), ``PodsReady`` (:func:`pods_ready_patch`),
``Finished`` (:func:`finished_patch`) and the priority boost (:func:`boost`).

A job is queued when it carries the label ``kueue.x-k8s.io/queue-name``
(optionally ``kueue.x-k8s.io/priority-class``, a WorkloadPriorityClass). Kueue
does not integrate the TrainingJob kind, so the operator plays the part of
Kueue's job framework (measured against v0.19.2): one Workload per job, owned
by it (controller=true), one pod set (every rank runs the same pod, so the
Workload carries rank 0's pod as the template and ``count = nodes``); no pod
exists before ``Admitted=True``; ``Evicted=True`` is the Cairn suspend (final
checkpoint, pods gone), after which the operator itself clears
``status.admission`` and sets ``QuotaReserved``/``Admitted`` False and
``Requeued`` True, as Kueue's own reconciler does for the kinds it knows.

The priority boost (KEP-7990, ``kueue.x-k8s.io/priority-boost``, read by
v0.19.2 only with its alpha ``PriorityBoost`` gate) is added to the
Workload's priority wherever Kueue compares priorities, victim ordering
included. :func:`boost` makes it follow the job's uncommitted work so that,
among equals, Kueue preempts the job that loses least.
"""

import dataclasses
import datetime
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from cairn.api import trainingjob
from cairn.operator.core import clock, k8stypes, names

GROUP = "kueue.x-k8s.io"
VERSION = "v1beta2"
API_VERSION = f"{GROUP}/{VERSION}"
PLURAL = "workloads"
STATUS = f"{PLURAL}/status"
FLAVORS = "resourceflavors"
PRIORITY_CLASSES = "workloadpriorityclasses"

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
BOOST_ANNOTATION = "kueue.x-k8s.io/priority-boost"
POD_SET = "trainer"
"""The one pod set: every rank runs the same pod (rank 0 only adds status credentials)."""

# Workload condition types (v1beta2).
QUOTA_RESERVED = "QuotaReserved"
ADMITTED = "Admitted"
EVICTED = "Evicted"
REQUEUED = "Requeued"
FINISHED = "Finished"
PODS_READY = "PodsReady"

# Reasons on the TrainingJob (conditions and Events).
REASON_QUEUED = "QueuedByKueue"
REASON_PREEMPTED = "PreemptedByKueue"
REASON_QUOTA_RELEASED = "KueueQuotaReleased"
REASON_WORKLOAD_FAILED = "WorkloadNotCreated"
REASON_BOOST = "PriorityBoost"

# Reasons Cairn writes on the Workload (Kueue's own where one exists).
RELEASE_REASON = "Pending"
NO_RESERVATION = "NoReservation"

MSG_QUEUED = "waiting for admission in queue {queue}"
MSG_NO_WORKLOAD = "waiting for admission in queue {queue} (creating Workload {workload})"
MSG_PREEMPTING = (
    "preempted by Kueue ({why}); waiting for {count} pod(s) to write a final checkpoint and stop"
)
MSG_PREEMPTED = (
    "preempted by Kueue ({why}); stopped with step {step} committed; "
    "waiting for re-admission in queue {queue}"
)
MSG_RELEASED = (
    "preempted by Kueue: released the quota of Workload {workload} after the final checkpoint "
    "(committed step {committed}, uploaded step {uploaded}); requeued"
)
MSG_FINISHED = "TrainingJob {phase}"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """A Workload reduced to what the operator decides on."""

    name: str
    uid: str = ""
    resource_version: str = ""
    quota_reserved: bool = False
    admitted: bool = False
    evicted: tuple[str, str] | None = None
    """(reason, message) while Evicted=True."""
    finished: bool = False
    waiting: str = ""
    """Kueue's QuotaReserved=False message: why it is not admitted (e.g. insufficient quota)."""
    flavors: tuple[str, ...] = ()
    """ResourceFlavors the admission assigned to the pod set, sorted."""
    boost: str | None = None
    """The priority-boost annotation as stored."""
    active: bool = True
    conditions: tuple[Mapping[str, Any], ...] = ()
    """Raw conditions, for the release patch (a merge patch replaces the list)."""
    podset_updates: tuple[Mapping[str, Any], ...] = ()
    """Admission checks' podSetUpdates for our pod set."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """What the admission adds to every pod: the flavors' node labels and
    tolerations, and the admission checks' pod set updates."""

    node_selector: Mapping[str, str] = dataclasses.field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    annotations: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Queue:
    """What the handler saw of a queued job's Workload (None: not created yet)."""

    name: str
    """The LocalQueue."""
    workload: Workload | None = None
    placement: Placement = Placement()


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Hold:
    """Why a queued job must not have pods now."""

    reason: str
    message: str
    preempted: bool = False


def queue_name(job: trainingjob.TrainingJob) -> str | None:
    """The LocalQueue the job asks for; None: not queued (Kueue not involved)."""
    value = (job.metadata.labels or {}).get(QUEUE_LABEL, "")
    return value or None


def priority_class(job: trainingjob.TrainingJob) -> str | None:
    value = (job.metadata.labels or {}).get(PRIORITY_LABEL, "")
    return value or None


def workload_name(job: trainingjob.TrainingJob) -> str:
    """Deterministic and unique per job object (a recreated job of the same name
    never picks up its predecessor's Workload); job names are at most 45
    characters, so this stays within 63 (usable as a label value too)."""
    digest = hashlib.sha256(job.metadata.uid.encode()).hexdigest()[:8]
    return f"tj-{job.metadata.name}-{digest}"


def _condition(conditions: Sequence[Mapping[str, Any]], kind: str) -> Mapping[str, Any] | None:
    return next((c for c in conditions if c.get("type") == kind), None)


def _true(conditions: Sequence[Mapping[str, Any]], kind: str) -> bool:
    found = _condition(conditions, kind)
    return found is not None and found.get("status") == "True"


def parse_workload(raw: Mapping[str, Any]) -> Workload:
    metadata = raw.get("metadata") or {}
    status = raw.get("status") or {}
    conditions = tuple(status.get("conditions") or ())
    evicted = _condition(conditions, EVICTED)
    reserved = _condition(conditions, QUOTA_RESERVED)
    flavors: set[str] = set()
    for assignment in (status.get("admission") or {}).get("podSetAssignments") or ():
        if assignment.get("name") == POD_SET:
            flavors.update(str(f) for f in (assignment.get("flavors") or {}).values())
    updates = tuple(
        update
        for check in status.get("admissionChecks") or ()
        for update in check.get("podSetUpdates") or ()
        if update.get("name") == POD_SET
    )
    return Workload(
        name=str(metadata.get("name", "")),
        uid=str(metadata.get("uid", "")),
        resource_version=str(metadata.get("resourceVersion", "")),
        quota_reserved=_true(conditions, QUOTA_RESERVED) or status.get("admission") is not None,
        admitted=_true(conditions, ADMITTED),
        evicted=(
            (str(evicted.get("reason", "")), str(evicted.get("message", "")))
            if evicted is not None and evicted.get("status") == "True"
            else None
        ),
        finished=_true(conditions, FINISHED),
        waiting=str(reserved.get("message", ""))
        if reserved and reserved.get("status") != "True"
        else "",
        flavors=tuple(sorted(flavors)),
        boost=(metadata.get("annotations") or {}).get(BOOST_ANNOTATION),
        active=(raw.get("spec") or {}).get("active", True) is not False,
        conditions=conditions,
        podset_updates=updates,
    )


def placement(workload: Workload, flavors: Mapping[str, Mapping[str, Any]]) -> Placement:
    """The node labels and tolerations of the admitted flavors (``flavors``: the
    ResourceFlavor objects by name), plus the admission checks' updates."""
    selector: dict[str, str] = {}
    tolerations: list[Mapping[str, Any]] = []
    for name in workload.flavors:
        spec = (flavors.get(name) or {}).get("spec") or {}
        selector.update(spec.get("nodeLabels") or {})
        tolerations += [t for t in spec.get("tolerations") or () if t not in tolerations]
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}
    for update in workload.podset_updates:
        selector.update(update.get("nodeSelector") or {})
        tolerations += [t for t in update.get("tolerations") or () if t not in tolerations]
        labels.update(update.get("labels") or {})
        annotations.update(update.get("annotations") or {})
    return Placement(
        node_selector=selector,
        tolerations=tuple(tolerations),
        labels=labels,
        annotations=annotations,
    )


def place(pod: k8stypes.Pod, where: Placement) -> k8stypes.Pod:
    """``pod`` (a builders.pod payload) with the admission's placement merged in:
    the admission's node labels win over the overlay's for the same key, as in
    Kueue's job framework; the pod's own Cairn labels are never overwritten."""
    spec: Any = dict(pod["spec"])
    metadata: Any = dict(pod["metadata"])
    if where.node_selector:
        spec["nodeSelector"] = {**(spec.get("nodeSelector") or {}), **where.node_selector}
    if where.tolerations:
        existing = list(spec.get("tolerations") or ())
        spec["tolerations"] = existing + [dict(t) for t in where.tolerations if t not in existing]
    if where.labels:
        metadata["labels"] = {**where.labels, **(metadata.get("labels") or {})}
    if where.annotations:
        metadata["annotations"] = {**(metadata.get("annotations") or {}), **where.annotations}
    return {**pod, "metadata": metadata, "spec": spec}


def hold(*, job: trainingjob.TrainingJob, queue: Queue | None, live_pods: int) -> Hold | None:
    """Why the queued ``job`` must not run now; None when it may (admitted, or not
    queued). ``queue`` None for a queued job means nothing was observed yet: hold."""
    name = queue_name(job)
    if name is None:
        return None
    workload = queue.workload if queue is not None else None
    if workload is None:
        return Hold(
            reason=REASON_QUEUED,
            message=MSG_NO_WORKLOAD.format(queue=name, workload=workload_name(job)),
        )
    if workload.evicted is not None:
        why = f"{workload.evicted[0]}: {workload.evicted[1]}".rstrip(": ")
        if live_pods:
            message = MSG_PREEMPTING.format(why=why, count=live_pods)
        else:
            message = MSG_PREEMPTED.format(why=why, step=committed_step(job), queue=name)
        return Hold(reason=REASON_PREEMPTED, message=message, preempted=True)
    if workload.admitted and not workload.finished:
        return None
    waiting = f": {workload.waiting}" if workload.waiting else ""
    return Hold(reason=REASON_QUEUED, message=MSG_QUEUED.format(queue=name) + waiting)


def committed_step(job: trainingjob.TrainingJob) -> str:
    ckpts = job.status.checkpoints
    if ckpts is None or ckpts.last_committed is None:
        return "none"
    return str(ckpts.last_committed.step)


def uploaded_step(job: trainingjob.TrainingJob) -> str:
    ckpts = job.status.checkpoints
    if ckpts is None or ckpts.last_uploaded is None:
        return "none"
    return str(ckpts.last_uploaded.step)


def pod_template(pod: Mapping[str, Any]) -> dict[str, Any]:
    """A PodTemplateSpec from a builders.pod payload: labels, annotations, spec."""
    metadata = pod.get("metadata") or {}
    template_meta: dict[str, Any] = {"labels": dict(metadata.get("labels") or {})}
    if metadata.get("annotations"):
        template_meta["annotations"] = dict(metadata["annotations"])
    return {"metadata": template_meta, "spec": dict(pod["spec"])}


def desired_workload(
    *,
    job: trainingjob.TrainingJob,
    owner: Mapping[str, Any],
    template: Mapping[str, Any],
    priority: tuple[str, int] | None,
) -> dict[str, Any]:
    """The Workload for ``job``: one pod set of ``nodes`` pods like ``template``;
    ``priority``: (WorkloadPriorityClass name, its value), looked up by the caller
    (v1beta2 wants the value next to the reference)."""
    name = queue_name(job)
    if name is None:
        raise ValueError(f"TrainingJob {job.metadata.name} has no {QUEUE_LABEL} label")
    spec: dict[str, Any] = {
        "queueName": name,
        "podSets": [{"name": POD_SET, "count": job.spec.nodes, "template": dict(template)}],
        "active": not job.spec.suspend,
    }
    if priority is not None:
        spec["priorityClassRef"] = {
            "group": GROUP,
            "kind": "WorkloadPriorityClass",
            "name": priority[0],
        }
        spec["priority"] = priority[1]
    return {
        "apiVersion": API_VERSION,
        "kind": "Workload",
        "metadata": {
            "name": workload_name(job),
            "namespace": job.metadata.namespace,
            "labels": {names.LABEL_JOB: job.metadata.name},
            "ownerReferences": [dict(owner)],
        },
        "spec": spec,
    }


def _set(
    conditions: Sequence[Mapping[str, Any]],
    *,
    kind: str,
    status: str,
    reason: str,
    message: str,
    now: str,
) -> list[dict[str, Any]]:
    """``conditions`` with one condition set (lastTransitionTime kept unless the status changes)."""
    out: list[dict[str, Any]] = []
    found = False
    for existing in conditions:
        if existing.get("type") != kind:
            out.append(dict(existing))
            continue
        found = True
        same = existing.get("status") == status
        out.append(
            {
                **existing,
                "status": status,
                "reason": reason,
                "message": message[:32768],
                "lastTransitionTime": existing.get("lastTransitionTime") if same else now,
            }
        )
    if not found:
        out.append(
            {
                "type": kind,
                "status": status,
                "reason": reason,
                "message": message[:32768],
                "lastTransitionTime": now,
            }
        )
    return out


def release_patch(workload: Workload, *, now: datetime.datetime) -> dict[str, Any] | None:
    """The status merge patch that gives an evicted Workload's quota back and
    requeues it, as Kueue's job framework does once the job's pods are gone
    (QuotaReserved and Admitted False with ``status.admission`` cleared in the
    same write: Kueue's webhook refuses one without the other). The
    resourceVersion makes it a compare-and-swap against Kueue's own writes.
    None when there is nothing to release."""
    if workload.evicted is None or not workload.quota_reserved:
        return None
    reason, message = workload.evicted
    stamp = clock.rfc3339(now)
    conditions = _set(
        workload.conditions,
        kind=QUOTA_RESERVED,
        status="False",
        reason=RELEASE_REASON,
        message=message,
        now=stamp,
    )
    conditions = _set(
        conditions,
        kind=ADMITTED,
        status="False",
        reason=NO_RESERVATION,
        message="The workload has no reservation",
        now=stamp,
    )
    conditions = _set(
        conditions, kind=REQUEUED, status="True", reason=reason, message=message, now=stamp
    )
    return {
        "metadata": {"resourceVersion": workload.resource_version},
        "status": {"admission": None, "conditions": conditions},
    }


def finished_patch(
    workload: Workload, *, succeeded: bool, message: str, now: datetime.datetime
) -> dict[str, Any] | None:
    """``Finished=True`` once the job ended (None: already finished)."""
    if workload.finished:
        return None
    conditions = _set(
        workload.conditions,
        kind=FINISHED,
        status="True",
        reason="Succeeded" if succeeded else "Failed",
        message=message,
        now=clock.rfc3339(now),
    )
    return {
        "metadata": {"resourceVersion": workload.resource_version},
        "status": {"conditions": conditions},
    }


_PODS_READY_WORDS = {
    "Started": "All pods of the TrainingJob are running",
    "Recovered": "All pods of the TrainingJob are running again",
    "WaitForStart": "Not all pods of the TrainingJob are running yet",
    "WaitForRecovery": "A rank failed; waiting for the next attempt's pods to run",
}


def pods_ready_patch(
    workload: Workload, *, phase: str, now: datetime.datetime
) -> dict[str, Any] | None:
    """``PodsReady`` as Kueue's job framework reports it (Kueue's
    ``waitForPodsReady`` reads it): True once every rank runs (Started, or
    Recovered after a failed attempt), False while an admitted job's pods start
    (WaitForStart) or restart (WaitForRecovery). None: nothing to change, or the
    Workload is not admitted."""
    if not workload.admitted or workload.evicted is not None:
        return None
    previous = _condition(workload.conditions, PODS_READY)
    was = previous.get("reason") if previous is not None else None
    if phase == "Running":
        status, reason = "True", "Recovered" if was == "WaitForRecovery" else "Started"
    elif phase in ("Starting", "Restarting"):
        ran = was in ("Started", "Recovered", "WaitForRecovery")
        status, reason = "False", "WaitForRecovery" if ran else "WaitForStart"
    else:
        return None
    if previous is not None and (previous.get("status"), was) == (status, reason):
        return None
    conditions = _set(
        workload.conditions,
        kind=PODS_READY,
        status=status,
        reason=reason,
        message=_PODS_READY_WORDS[reason],
        now=clock.rfc3339(now),
    )
    return {
        "metadata": {"resourceVersion": workload.resource_version},
        "status": {"conditions": conditions},
    }
