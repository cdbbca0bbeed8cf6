"""A lost pod replaced in place: runtimes torchrun and ray with in-place restarts.

Pure. Without this, a rank whose pod is lost (deleted, evicted, its node
gone) ends the attempt: every pod is stopped and the next attempt starts new
ones, which resume from the volume or S3 (``diagnosis.judge`` ->
``restartpolicy``). With an in-place budget (``budget``: runtime torchrun's
``spec.torchrun.maxInPlaceRestarts``, runtime ray's
``spec.ray.maxInPlaceRestarts``) above 0 the other pods need not go:

- torchrun: their agents see the worker group fail, restart their workers
  and wait in the c10d rendezvous for the missing node;
- ray: rank 0's pod is the Ray head and runs the driver; the driver sees the
  lost Ray node's rank actors die, waits for the replacement Ray node to join,
  re-places the rank actors and starts a new rank-actor group in the same
  pods (docs/ray-driver.md);

so the operator only has to give that node back. ``replacing`` does: it
records the loss in ``status.podReplacements`` (before anything is deleted or
created, like every transition), deletes the lost pod if nobody is deleting
it yet, and, once its name is free, creates a pod of the same name in the
same attempt, with the same spec as the one it replaces (the attempt's resume
target, ``resumeplan.recreate_target``). The new pod joins the rendezvous or
the Ray cluster, and its ranks restore the newest committed step like their
peers, from their peer's memory replica when the memory tier holds one
(docs/checkpointing.md). The phase stays Running (the ``Ready`` condition
says ``ReplacingPod``); one Warning Event per loss.

Not replaced (the attempt ends as before): rank 0's pod (torchrun: its agent
hosts the rendezvous, so the survivors would lose it too; ray: it is the head
and runs the driver), a pod the kubelet evicted for its own usage (it would
be evicted again), any failed rank (the judge names it), a loss once a rank
succeeded (the group is ending), a loss past the budget (``maxInPlaceRestarts``
losses per attempt, each also one of the survivors' in-place restarts: the
torchrun agents' or the Ray driver's), and a replacement that is not running
within ``REPLACEMENT_DEADLINE_SECONDS`` (then the attempt ends, not counted
against maxRestarts, like a preemption).

Idempotent across reconciles and operator restarts: a lost pod present is
known by its UID; a rank whose pod is missing is covered by its newest record
while that record's replacement has not been seen (``settle`` records the
replacement's UID as soon as it is), so a replacement that is itself lost
later is a new loss.
"""

import datetime

from cairn.api import jobstatus, trainingjob
from cairn.operator.core import conditions as cond
from cairn.operator.core import (
    decisions,
    diagnosis,
    jobobserve,
    k8stypes,
    restartpolicy,
    resumeplan,
)

REPLACEMENT_DEADLINE_SECONDS = 180.0
"""How long a replacement may take to run (create, schedule, start). The
survivors wait meanwhile (torchrun's agents in the rendezvous, torch's join
timeout is 600 s; the Ray driver for the replacement Ray node), so past this
the attempt ends rather than waiting on."""

EVENT_REASON = cond.REASON_REPLACING_POD
REASON_MAX = 1024
UID_MAX = 64
"""The record's limits (``jobstatus.PodReplacement``, the CRD): a kubelet's
eviction message is clipped, never a refused status patch."""


def budget(job: trainingjob.TrainingJob) -> int:
    """The runtime's in-place budget per attempt: ``spec.torchrun.maxInPlaceRestarts``
    or ``spec.ray.maxInPlaceRestarts``."""
    spec = job.spec
    if spec.runtime == "ray":
        return spec.ray_settings.max_in_place_restarts
    return spec.torchrun_settings.max_in_place_restarts


def enabled(job: trainingjob.TrainingJob) -> bool:
    """Whether the job's lost pods are replaced in place."""
    return job.spec.nodes > 1 and budget(job) > 0


def _newest(
    records: tuple[jobstatus.PodReplacement, ...],
) -> dict[int, jobstatus.PodReplacement]:
    """Each rank's newest record (records are appended in order)."""
    return {r.rank: r for r in records}


def _lost(
    job: trainingjob.TrainingJob, pods: tuple[jobobserve.ObservedPod, ...]
) -> dict[int, tuple[jobobserve.ObservedPod | None, str]] | None:
    """rank -> (its lost pod, None when missing; why); None: not for us (a
    failed rank or an eviction the pod caused itself is the judge's, and a
    rank that succeeded means the job is ending: nothing to rejoin)."""
    by_rank = {p.rank: p for p in pods}
    if any(p.phase == "Succeeded" for p in pods):
        return None
    lost: dict[int, tuple[jobobserve.ObservedPod | None, str]] = {}
    for rank in range(job.spec.nodes):
        pod = by_rank.get(rank)
        if pod is None:
            lost[rank] = (None, "pod disappeared")
            continue
        if diagnosis.own_eviction(pod):
            return None
        why = diagnosis.lost(pod) or ("pod deleted" if pod.deleting else None)
        if why is not None:
            lost[rank] = (pod, why)
        elif pod.phase == "Failed":
            return None
    return lost


def _covered(
    records: tuple[jobstatus.PodReplacement, ...], rank: int, pod: jobobserve.ObservedPod | None
) -> bool:
    """Whether this loss is recorded already."""
    if pod is not None:
        return any(r.lost_pod_uid == pod.uid for r in records)
    newest = _newest(records).get(rank)
    return newest is not None and not newest.replacement_uid


def settle(
    job: trainingjob.TrainingJob, pods: tuple[jobobserve.ObservedPod, ...]
) -> tuple[jobstatus.PodReplacement, ...] | None:
    """The records with each replacement's UID filled in once its pod is seen
    (None: nothing new). A pod is a rank's replacement when it is not the pod
    any record says was lost."""
    records = tuple(job.status.pod_replacements or ())
    if not records:
        return None
    lost_uids = {r.lost_pod_uid for r in records}
    newest = _newest(records)
    by_rank = {p.rank: p for p in pods}
    out = list(records)
    changed = False
    for index, record in enumerate(records):
        if record.replacement_uid or newest[record.rank] is not record:
            continue
        pod = by_rank.get(record.rank)
        if pod is not None and pod.uid and pod.uid not in lost_uids:
            out[index] = record.model_copy(update={"replacement_uid": pod.uid})
            changed = True
    return tuple(out) if changed else None


def _pending(
    records: tuple[jobstatus.PodReplacement, ...], pods: tuple[jobobserve.ObservedPod, ...]
) -> list[jobstatus.PodReplacement]:
    """The newest record of each rank whose replacement does not run yet."""
    by_uid = {p.uid: p for p in pods}
    out = []
    for _, newest in sorted(_newest(records).items()):
        pod = by_uid.get(newest.replacement_uid) if newest.replacement_uid else None
        if pod is None or pod.phase not in ("Running", "Succeeded"):
            out.append(newest)
    return out


def replacing(
    job: trainingjob.TrainingJob,
    observed: jobobserve.Observed,
    base: decisions.Base,
    *,
    settled: tuple[jobstatus.PodReplacement, ...] | None,
    cleanup: tuple[jobobserve.ObservedPod, ...],
    now: datetime.datetime,
) -> decisions.Decision | None:
    """The decision while a lost pod is replaced in place; None: not this case
    (the rest of the lifecycle table decides, which ends the attempt for a loss).
    `settled`: this reconcile's ``settle`` (None: the records are as in status)."""
    if not enabled(job) or base.phase != "Running":
        return None
    pods = observed.pods_of(base.attempt)
    lost = _lost(job, pods)
    if lost is None:
        return None
    records = settled or tuple(job.status.pod_replacements or ())
    pending = [r for r in _pending(records, pods) if r.rank not in lost]
    if not lost and not pending:
        return None
    if 0 in lost:
        return None  # rank 0 hosts the rendezvous or is the Ray head: the attempt ends
    new = [
        jobstatus.PodReplacement(
            rank=rank,
            lost_pod_uid=(pod.uid if pod is not None else "")[:UID_MAX],
            time=now,
            reason=why[:REASON_MAX],
        )
        for rank, (pod, why) in sorted(lost.items())
        if not _covered(records, rank, pod)
    ]
    allowed = budget(job)
    if len(records) + len(new) > allowed:
        return None  # past the budget: the attempt ends, as without it
    records += tuple(new)
    newest = _newest(records)  # every lost rank has one now: covered or new
    waiting = [*pending, *(newest[rank] for rank in sorted(lost))]
    late = [r for r in waiting if _age(r, now) > REPLACEMENT_DEADLINE_SECONDS]
    if late:
        return _late(job, observed, base, late[0], now=now)
    ranks = sorted({r.rank for r in waiting})
    message = cond.MSG_REPLACING_POD.format(
        attempt=base.attempt,
        ranks=", ".join(str(r) for r in ranks),
        why="; ".join(f"rank {r.rank}: {r.reason}" for r in waiting),
        used=len(records),
        budget=allowed,
    )
    left = min(REPLACEMENT_DEADLINE_SECONDS - _age(r, now) for r in waiting)
    gone = tuple(pod for pod, _ in lost.values() if pod is not None)
    return base.decision(
        phase="Running",
        reason=cond.REASON_REPLACING_POD,
        message=message,
        start_attempt=any(pod is None for pod, _ in lost.values()),
        resume=resumeplan.recreate_target(job, attempt=base.attempt, now=now),
        delete=cleanup + decisions.deletable(gone),
        pod_replacements=records,
        requeue_after=max(left, 1.0),
    )


def _age(record: jobstatus.PodReplacement, now: datetime.datetime) -> float:
    return (now - record.time).total_seconds()


def _late(
    job: trainingjob.TrainingJob,
    observed: jobobserve.Observed,
    base: decisions.Base,
    record: jobstatus.PodReplacement,
    *,
    now: datetime.datetime,
) -> decisions.Decision:
    """A replacement that did not run in time: the attempt ends like a preemption."""
    why = cond.MSG_REPLACEMENT_LATE.format(seconds=int(REPLACEMENT_DEADLINE_SECONDS))
    message = cond.MSG_PREEMPTED.format(
        attempt=base.attempt, rank=record.rank, why=f"{record.reason}; {why}"
    )
    failure = decisions.Failure(
        attempt=base.attempt,
        time=now,
        reason=cond.REASON_PREEMPTED,
        message=message,
        rank=record.rank,
        counted=False,
    )
    return restartpolicy.after_failure(job, observed, base, failure, now=now)


def events(
    job: trainingjob.TrainingJob, decision: decisions.Decision
) -> tuple[k8stypes.Event, ...]:
    """One Warning per loss this decision records for the first time."""
    previous = job.status
    if decision.pod_replacements is None or decision.attempt != (previous.attempt or 0):
        return ()
    known = {(r.rank, r.lost_pod_uid, r.time) for r in previous.pod_replacements or ()}
    records = decision.pod_replacements
    allowed = budget(job)
    return tuple(
        k8stypes.Event(
            type="Warning",
            reason=EVENT_REASON,
            message=cond.MSG_POD_LOST.format(
                attempt=decision.attempt,
                rank=r.rank,
                why=r.reason,
                used=index + 1,
                budget=allowed,
            ),
        )
        for index, r in enumerate(records)
        if (r.rank, r.lost_pod_uid, r.time) not in known
    )
