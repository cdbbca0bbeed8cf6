"""plan(): the operator's one decision per reconcile.

Pure: ``plan(job=…, observed=…, now=…)`` reads the TrainingJob, what the
handler observed (``jobobserve.Observed``) and the injected clock, and returns a
:class:`Plan` — the children to create, the children to delete, the status
merge patch, the events, and when to look again. ``jobapply.apply()`` carries it
out in this order: status, deletes, creates, events, so that a decision (a
failure counted, an attempt number bumped) is recorded before it acts, and an
operator killed between two steps converges on restart without duplicates.

Read top to bottom: podowner.attach (only the job's own pods count) ->
lifecycle.decide -> builders -> status.patch -> events.
"""

import dataclasses
import datetime
from typing import Any

from cairn.api import jobstatus, trainingjob
from cairn.operator.core import (
    builders,
    decisions,
    jobobserve,
    k8stypes,
    kueueplan,
    lifecycle,
    podowner,
    raystatus,
    replaceplan,
    status,
)
from cairn.operator.core import conditions as cond

_WARNING_PHASES: frozenset[str] = frozenset({"Failed", "Restarting"})


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Delete:
    """A child to delete; ``uid`` is a precondition so a same-named successor survives."""

    kind: k8stypes.ChildKind
    name: str
    namespace: str
    uid: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """Everything one reconcile should do, in the order effects applies it."""

    status: k8stypes.StatusPatch | None = None
    """None: the status is already as desired."""
    deletes: tuple[Delete, ...] = ()
    creates: tuple[k8stypes.Child, ...] = ()
    events: tuple[k8stypes.Event, ...] = ()
    requeue_after: float | None = None
    decision: decisions.Decision | None = None
    """Why: kept for logs and tests."""
    foreign_reported: frozenset[str] = frozenset()
    """UIDs of the foreign pods reported once this plan's events are posted
    (``podowner.reports``): the handler keeps them for the next plan."""

    @property
    def empty(self) -> bool:
        return self.status is None and not self.deletes and not self.creates and not self.events


def _status_changed(previous: jobstatus.TrainingJobStatus, patch: k8stypes.StatusPatch) -> bool:
    before = previous.model_dump(by_alias=True, exclude_none=True)
    after: dict[str, Any] = dict(before)
    for key, value in patch.items():
        if value is None:
            after.pop(key, None)
        elif key in ("ray", "torchrun") and isinstance(value, dict):
            # The operator writes only its keys of status.ray/torchrun (a merge patch
            # keeps the driver's), so compare the merged object.
            after[key] = {**after.get(key, {}), **value}
        else:
            after[key] = value
    return jobstatus.TrainingJobStatus.model_validate(after) != previous


def _events(
    previous: jobstatus.TrainingJobStatus, decision: decisions.Decision
) -> tuple[k8stypes.Event, ...]:
    """One event per transition: a phase change or a new attempt."""
    changed = (previous.phase or "Pending") != decision.phase
    new_attempt = (previous.attempt or 0) != decision.attempt
    new_failure = decision.failure is not None and (
        previous.last_failure is None or previous.last_failure.attempt != decision.failure.attempt
    )
    if not (changed or new_attempt or new_failure):
        return ()
    kind: k8stypes.EventType = "Warning" if decision.phase in _WARNING_PHASES else "Normal"
    return (k8stypes.Event(type=kind, reason=decision.reason, message=decision.message),)


def _problem_events(
    previous: jobstatus.TrainingJobStatus, patch: k8stypes.StatusPatch
) -> tuple[k8stypes.Event, ...]:
    """A Warning for each abnormal-true condition that turned True or now says
    something new (FailedCreate, NameConflict, ImagePullBackOff…); repeats of
    the same problem post nothing."""
    before = {c.type: c for c in previous.conditions or ()}
    out = []
    for now in patch.get("conditions", []):
        if now["type"] not in cond.WARNING_CONDITIONS or now["status"] != "True":
            continue
        old = before.get(now["type"])
        if old is not None and (old.status, old.reason, old.message) == (
            "True",
            now["reason"],
            now["message"],
        ):
            continue
        out.append(k8stypes.Event(type="Warning", reason=now["reason"], message=now["message"]))
    return tuple(out)


def _deletes(metadata: trainingjob.ObjectMeta, decision: decisions.Decision) -> tuple[Delete, ...]:
    return tuple(
        Delete(kind="Pod", name=p.name, namespace=metadata.namespace, uid=p.uid or None)
        for p in decision.delete
    )


def plan(
    *,
    job: trainingjob.TrainingJob | jobobserve.InvalidJob,
    observed: jobobserve.Observed,
    now: datetime.datetime,
) -> Plan:
    """Decide; pure. Only the job's own pods are decided on (``podowner``)."""
    owner = {"job_name": job.metadata.name, "job_uid": job.metadata.uid}
    observed = podowner.attach(observed, **owner)
    if isinstance(job, jobobserve.InvalidJob):
        decision = lifecycle.decide_invalid(job=job, observed=observed, now=now)
        valid = None
    else:
        decision = lifecycle.decide(job=job, observed=observed, now=now)
        valid = job
    if decision.noop:
        return Plan(
            requeue_after=decision.requeue_after,
            decision=decision,
            foreign_reported=observed.reported_foreign,
        )
    foreign_events, foreign_reported = podowner.reports(observed, **owner)
    creates: list[k8stypes.Child] = []
    if valid is not None and decision.start_attempt and decision.resume is not None:
        creates += builders.job_children(valid)
        present = {p.rank for p in observed.pods_of(decision.attempt)}
        where = observed.queue.placement if observed.queue is not None else None
        for rank in range(valid.spec.nodes):
            if rank in present:
                continue
            pod = builders.pod(valid, attempt=decision.attempt, rank=rank, resume=decision.resume)
            # Queued jobs run where Kueue admitted them (the flavors' node labels).
            creates.append(kueueplan.place(pod, where) if where is not None else pod)
    patch = status.patch(
        job=valid, metadata=job.metadata, previous=job.status, decision=decision, now=now
    )
    ray_events: tuple[k8stypes.Event, ...] = ()
    if valid is not None:
        new_attempt = decision.attempt != (job.status.attempt or 0)
        ray_patch = raystatus.patch(valid, attempt=decision.attempt, new_attempt=new_attempt)
        if ray_patch is not None:
            patch[raystatus.status_key(valid)] = ray_patch  # type: ignore[literal-required]
        ray_events = raystatus.events(valid) + replaceplan.events(valid, decision)
    return Plan(
        status=patch if _status_changed(job.status, patch) else None,
        deletes=_deletes(job.metadata, decision),
        creates=tuple(creates),
        events=_events(job.status, decision)
        + _problem_events(job.status, patch)
        + ray_events
        + foreign_events,
        requeue_after=decision.requeue_after,
        decision=decision,
        foreign_reported=foreign_reported,
    )
