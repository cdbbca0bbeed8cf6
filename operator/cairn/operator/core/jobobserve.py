"""What one reconcile observed: the job, the pods of the job, failed creates.

Pure: turns the raw dicts kopf hands to ``handlers`` into frozen values that
``jobplan.plan()`` decides on. Nothing here talks to the API server; the
handler passes in what its watches and indexes hold, a fresh pod list on
resync, and the children ``jobapply`` failed to create last time.

Pods reach a job by its label ``cairn.dev/job-name`` (anyone who may create
a pod can set it); each ``ObservedPod`` keeps its controller ownerReference
so that ``podowner.attach`` can tell the job's own pods from strangers.

A job whose spec passed the schema but not the models (a semantic error, or
an object stored before a CRD upgrade) parses into :class:`InvalidJob`, so
the plan can mark it Failed instead of crash-looping.
"""

import dataclasses
import datetime
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import pydantic

from cairn.api import jobstatus, podidentity, trainingjob
from cairn.operator.core import kueueplan, names

PodPhase = Literal["Pending", "Running", "Succeeded", "Failed", "Unknown"]
_POD_PHASES: frozenset[str] = frozenset({"Pending", "Running", "Succeeded", "Failed", "Unknown"})


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ObservedPod:
    """One rank's pod, reduced to what the lifecycle rules need."""

    name: str
    uid: str
    attempt: int
    rank: int
    phase: PodPhase
    deleting: bool = False
    """deletionTimestamp is set: someone (maybe us) is deleting it."""
    exit_code: int | None = None
    """The trainer container's exit code once it terminated."""
    termination_reason: str | None = None
    """e.g. OOMKilled, Error."""
    finished_at: datetime.datetime | None = None
    disruption_reason: str | None = None
    """Reason of a True DisruptionTarget condition (eviction, preemption, taint)."""
    node_name: str | None = None
    ready: bool = False
    waiting_reason: str | None = None
    """Why a container of the pod does not run yet (a reason the kubelet reports
    that is not plain progress: CreateContainerConfigError, ImagePullBackOff…)."""
    waiting_message: str = ""
    unschedulable: str | None = None
    """The scheduler's message while PodScheduled is False (Unschedulable)."""
    termination_message: str = ""
    """The trainer container's termination message (its exit reason in words)."""
    pod_reason: str | None = None
    """status.reason of the pod, e.g. Evicted (with ``pod_message``)."""
    pod_message: str = ""
    controller_uid: str | None = None
    """UID of the pod's controller ownerReference (None: it has none). Labels
    anyone can copy; ``podowner`` decides from this and the name whose pod it is."""

    @property
    def terminated(self) -> bool:
        return self.phase in ("Succeeded", "Failed")

    @property
    def not_starting(self) -> tuple[str, str] | None:
        """(reason, message) if the pod is stuck before its trainer runs."""
        if self.phase != "Pending":
            return None
        if self.waiting_reason is not None:
            return self.waiting_reason, self.waiting_message
        if self.unschedulable is not None:
            return UNSCHEDULABLE, self.unschedulable
        return None


UNSCHEDULABLE = "Unschedulable"
PROGRESS_WAITING_REASONS: frozenset[str] = frozenset({"ContainerCreating", "PodInitializing"})
"""Waiting reasons that mean "on its way"; any other one is a problem to show."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CreateError:
    """A child ``jobapply`` could not create: what the API server said."""

    kind: str
    name: str
    code: int
    """HTTP status: 422 invalid, 403 forbidden (admission, quota), 409 name taken…"""
    reason: str
    message: str
    conflict: bool = False
    """409 for an object this job does not own (never adopted)."""

    @property
    def invalid(self) -> bool:
        """A deterministic refusal: the same object is refused again."""
        return self.code == 422


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class InvalidJob:
    """A job the models reject: enough to report it, nothing to run."""

    metadata: trainingjob.ObjectMeta
    status: jobstatus.TrainingJobStatus
    error: str


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Observed:
    """Everything the plan may look at besides the job and the clock."""

    pods: tuple[ObservedPod, ...] = ()
    create_errors: tuple[CreateError, ...] = ()
    """What the last apply failed to create (empty once a create works)."""
    queue: kueueplan.Queue | None = None
    """A queued job's Workload as the handler read it (``kueueplan``); None when the
    job is not queued or nothing was read yet (a queued job is then held)."""
    foreign: tuple[ObservedPod, ...] = ()
    """Pods with the job's labels that are not its own (``podowner.attach``
    moves them here from ``pods``): reported, never decided on or deleted."""
    reported_foreign: frozenset[str] = frozenset()
    """UIDs of foreign pods already reported in a ``ForeignPod`` Event (the
    handler's memory: reported once per job and pod)."""

    def pods_of(self, attempt: int) -> tuple[ObservedPod, ...]:
        return tuple(p for p in self.pods if p.attempt == attempt)


def parse_status(body: Mapping[str, Any]) -> jobstatus.TrainingJobStatus:
    """The job's status as the models see it; empty if it does not validate."""
    try:
        return jobstatus.TrainingJobStatus.model_validate(body.get("status") or {})
    except pydantic.ValidationError:
        return jobstatus.TrainingJobStatus()


def parse_job(body: Mapping[str, Any]) -> trainingjob.TrainingJob | InvalidJob:
    """The job as the models see it, or why they refuse it."""
    try:
        return trainingjob.TrainingJob.model_validate(body)
    except pydantic.ValidationError as error:
        metadata = trainingjob.ObjectMeta.model_validate(body.get("metadata", {}))
        return InvalidJob(metadata=metadata, status=parse_status(body), error=_summarize(error))


def _summarize(error: pydantic.ValidationError) -> str:
    parts = []
    for item in error.errors()[:3]:
        where = ".".join(str(p) for p in item["loc"])
        parts.append(f"{where}: {item['msg']}")
    return "; ".join(parts)


def _parse_time(value: object) -> datetime.datetime | None:
    if isinstance(value, datetime.datetime):
        return value
    if isinstance(value, str) and value:
        return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    return None


def parse_pod(body: Mapping[str, Any]) -> ObservedPod | None:
    """One pod of a job; None for a pod without Cairn's attempt/rank labels."""
    metadata = body.get("metadata") or {}
    labels = metadata.get("labels") or {}
    attempt = podidentity.int_label(labels, names.LABEL_ATTEMPT)
    rank = podidentity.int_label(labels, names.LABEL_RANK)
    if attempt is None or rank is None:
        return None
    status = body.get("status") or {}
    phase = status.get("phase", "Pending")
    exit_code: int | None = None
    reason: str | None = None
    finished: datetime.datetime | None = None
    message = ""
    for container in status.get("containerStatuses") or ():
        if container.get("name") != names.CONTAINER:
            continue
        terminated = (container.get("state") or {}).get("terminated")
        if terminated:
            exit_code = int(terminated.get("exitCode", 0))
            reason = terminated.get("reason")
            finished = _parse_time(terminated.get("finishedAt"))
            message = str(terminated.get("message") or "")
    waiting, waiting_message = _waiting(status)
    disruption: str | None = None
    ready = False
    unschedulable: str | None = None
    for condition in status.get("conditions") or ():
        kind = condition.get("type")
        if (kind, condition.get("status")) == ("PodScheduled", "False") and condition.get(
            "reason"
        ) == UNSCHEDULABLE:
            unschedulable = str(condition.get("message") or UNSCHEDULABLE)
        if condition.get("status") != "True":
            continue
        if kind == "DisruptionTarget":
            disruption = condition.get("reason") or "DisruptionTarget"
        elif kind == "Ready":
            ready = True
    return ObservedPod(
        name=str(metadata.get("name", "")),
        uid=str(metadata.get("uid", "")),
        attempt=attempt,
        rank=rank,
        phase=phase if phase in _POD_PHASES else "Unknown",
        deleting=metadata.get("deletionTimestamp") is not None,
        exit_code=exit_code,
        termination_reason=reason,
        finished_at=finished,
        disruption_reason=disruption,
        node_name=(body.get("spec") or {}).get("nodeName"),
        ready=ready,
        waiting_reason=waiting,
        waiting_message=waiting_message,
        unschedulable=unschedulable,
        termination_message=message,
        pod_reason=status.get("reason"),
        pod_message=str(status.get("message") or ""),
        controller_uid=podidentity.controller_uid(metadata),
    )


def _waiting(status: Mapping[str, Any]) -> tuple[str | None, str]:
    """The first container (init containers first) waiting for a reason that is
    a problem, not progress: (reason, "container: message")."""
    containers = [
        *(status.get("initContainerStatuses") or ()),
        *(status.get("containerStatuses") or ()),
    ]
    for container in containers:
        waiting = (container.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason")
        if reason and reason not in PROGRESS_WAITING_REASONS:
            detail = str(waiting.get("message") or "")
            # Condition and Event reasons are CamelCase words; be safe with odd kubelets.
            word = "".join(str(reason).split())
            return word, f"container {container.get('name')}: {detail}".rstrip(": ")
    return None, ""


def observe(
    *, pods: Iterable[Mapping[str, Any]], create_errors: Iterable[CreateError] = ()
) -> Observed:
    parsed = (parse_pod(p) for p in pods)
    return Observed(
        pods=tuple(sorted((p for p in parsed if p), key=lambda p: (p.attempt, p.rank))),
        create_errors=tuple(create_errors),
    )
