"""The Decision (what one reconcile decides) and the builders every policy shares.

Pure. ``Base`` carries the counters of the previous status into a new
``Decision``; ``fail`` and ``start`` build the two decisions several
policies end in (``lifecycle``'s table, ``restartpolicy``, ``suspension``);
``live_pods``/``deletable``/``finished_pods`` pick the pods a decision stops.
"""

import dataclasses
import datetime
from typing import Any

from cairn.api import jobstatus, podenv, trainingjob
from cairn.operator.core import conditions as cond
from cairn.operator.core import deadlines, jobobserve, resumeplan

UTC = datetime.UTC


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Failure:
    """Why an attempt ended; becomes ``status.lastFailure``."""

    attempt: int
    time: datetime.datetime
    reason: str
    message: str
    rank: int | None = None
    exit_code: int | None = None
    counted: bool = True
    backoff_seconds: int | None = None
    """The wait before the next attempt (None: no restart decided yet)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Decision:
    """What the job should look like after this reconcile."""

    phase: jobstatus.Phase
    reason: str
    message: str
    attempt: int
    restarts: int
    counted_restarts: int
    start_time: datetime.datetime | None
    attempt_start_time: datetime.datetime | None
    completion_time: datetime.datetime | None
    failure: Failure | None
    start_attempt: bool = False
    """Create the per-job children and every pod of ``attempt``."""
    resume: podenv.ResumeTarget | None = None
    resume_applied: jobstatus.ResumeApplied | None = None
    """A new ``status.resumeApplied`` record (None: leave it as it is)."""
    delete: tuple[jobobserve.ObservedPod, ...] = ()
    requeue_after: float | None = None
    noop: bool = False
    """Leave the job alone (another controller's, or being deleted)."""
    not_starting: tuple[str, str] | None = None
    """(reason, message) for the PodsNotStarting condition."""
    name_conflict: str | None = None
    """Message for the NameConflict condition."""
    progress_step: int | None = None
    progress_time: datetime.datetime | None = None
    """When status.step last changed (or the attempt started): progressDeadlineSeconds."""
    staleness: deadlines.Staleness | None = None
    """Running only: how far from CheckpointStale (``status`` writes the condition)."""
    pod_replacements: tuple[jobstatus.PodReplacement, ...] | None = None
    """The new ``status.podReplacements`` (``replaceplan``; None: leave it as it is)."""


def failure_of(status: jobstatus.TrainingJobStatus) -> Failure | None:
    last = status.last_failure
    if last is None:
        return None
    return Failure(
        attempt=last.attempt,
        time=last.time,
        reason=last.reason,
        message=last.message,
        rank=last.rank,
        exit_code=last.exit_code,
        counted=last.counted,
        backoff_seconds=last.backoff_seconds,
    )


def resume_target(
    job: trainingjob.TrainingJob, *, now: datetime.datetime | None = None
) -> podenv.ResumeTarget:
    """What the job's next attempt resumes from (``resumeplan.choose``): the
    spec's explicit target once per request, else the newest committed step."""
    attempt = (job.status.attempt or 0) + 1
    return resumeplan.choose(job, attempt=attempt, now=now or datetime.datetime.now(UTC)).target


def live_pods(pods: tuple[jobobserve.ObservedPod, ...]) -> tuple[jobobserve.ObservedPod, ...]:
    """The pods that did not terminate."""
    return tuple(p for p in pods if not p.terminated)


def deletable(pods: tuple[jobobserve.ObservedPod, ...]) -> tuple[jobobserve.ObservedPod, ...]:
    """The pods not being deleted already."""
    return tuple(p for p in pods if not p.deleting)


class Base:
    """The counters carried from the previous status into a Decision."""

    def __init__(self, status: jobstatus.TrainingJobStatus) -> None:
        self.phase: jobstatus.Phase = status.phase or "Pending"
        self.attempt = status.attempt or 0
        self.restarts = status.restarts or 0
        self.counted = status.restarts_count_towards_max or 0
        self.start_time = status.start_time
        self.attempt_start_time = status.attempt_start_time
        self.completion_time = status.completion_time
        self.failure = failure_of(status)
        self.progress_step: int | None = None
        self.progress_time: datetime.datetime | None = None

    def decision(
        self, *, phase: jobstatus.Phase, reason: str, message: str, **changes: Any
    ) -> Decision:
        carried = Decision(
            phase=phase,
            reason=reason,
            message=message,
            attempt=self.attempt,
            restarts=self.restarts,
            counted_restarts=self.counted,
            start_time=self.start_time,
            attempt_start_time=self.attempt_start_time,
            completion_time=self.completion_time,
            failure=self.failure,
            progress_step=self.progress_step,
            progress_time=self.progress_time,
        )
        return dataclasses.replace(carried, **changes)

    def track_progress(self, job: trainingjob.TrainingJob, now: datetime.datetime) -> None:
        """A new status.step (or none recorded yet) restarts the progress clock.
        Only with progressDeadlineSeconds: otherwise every step the writer
        reports would cost an operator status patch too."""
        if job.spec.progress_deadline_seconds is None:
            return
        status = job.status
        seen = status.progress
        if seen is None or seen.step != status.step:
            self.progress_step, self.progress_time = status.step, now
        else:
            self.progress_step, self.progress_time = seen.step, seen.time


def finished_pods(
    job: trainingjob.TrainingJob, pods: tuple[jobobserve.ObservedPod, ...], *, keep_attempt: int
) -> tuple[jobobserve.ObservedPod, ...]:
    """Terminated pods to delete: with Keep, those older than the previous attempt."""
    finished = [p for p in pods if p.terminated and not p.deleting]
    if job.spec.cleanup.finished_pods == "Delete":
        return tuple(p for p in finished if p.attempt != keep_attempt)
    return tuple(p for p in finished if p.attempt < keep_attempt - 1)


def fail(
    job: trainingjob.TrainingJob,
    observed: jobobserve.Observed,
    base: Base,
    *,
    reason: str,
    message: str,
    now: datetime.datetime,
    failure: Failure | None = None,
    counted: int | None = None,
) -> Decision:
    return base.decision(
        phase="Failed",
        reason=reason,
        message=message,
        completion_time=now,
        failure=failure or base.failure,
        counted_restarts=base.counted if counted is None else counted,
        delete=deletable(live_pods(observed.pods)),
    )


def start(
    job: trainingjob.TrainingJob,
    observed: jobobserve.Observed,
    base: Base,
    *,
    now: datetime.datetime,
    reason: str,
) -> Decision:
    attempt = base.attempt + 1
    choice = resumeplan.choose(job, attempt=attempt, now=now)
    resume = choice.target
    message = cond.MSG_ATTEMPT_STARTED.format(
        attempt=attempt, nodes=job.spec.nodes, resume=podenv.format_resume(resume)
    )
    if choice.explicit:
        message += cond.MSG_RESUME_EXPLICIT.format(generation=job.metadata.generation)
    return base.decision(
        phase="Starting",
        reason=reason,
        message=message,
        attempt=attempt,
        start_time=base.start_time or now,
        attempt_start_time=now,
        progress_time=now if job.spec.progress_deadline_seconds is not None else None,
        start_attempt=True,
        resume=resume,
        resume_applied=choice.record,
        delete=finished_pods(job, observed.pods, keep_attempt=attempt),
        requeue_after=deadlines.deadline_in(job, start=base.start_time or now, now=now),
    )
