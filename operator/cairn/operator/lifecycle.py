"""The lifecycle rules: from (job, observed pods, now) to one Decision.

Pure. This is where the phase is computed, in one place:

    Pending -> Starting -> Running -> (Restarting -> Starting -> Running)*
            -> Succeeded | Failed
    any live phase -> Suspending -> Suspended -> Starting (resume)

Gang semantics: a failed or lost rank fails the whole attempt; the operator
records the failure in status *before* it deletes the other ranks (so a crash
between the two cannot lose or double-count it), waits for the attempt's pods
to stop and for the backoff, then starts attempt N+1, which resumes from the
last committed step. Evictions, DisruptionTarget, lost nodes and pods deleted
by someone else are preemptions: they restart the gang without counting
against ``maxRestarts``, up to ``maxPreemptions``; an eviction the pod caused
itself (its emptyDir, ephemeral storage or memory over what it asked for) is
counted. A non-retryable exit code fails the job at once, and so does exit
code 78 (``exitcodes.CONFIG_ERROR``: ``ConfigurationError``, not counted).

Nothing waits silently: a child the API server refuses (``observe.CreateError``)
or a pod stuck before its trainer runs shows in the ``PodsNotStarting``
condition; a 422 fails the job (``InvalidPodSpec``); a name taken by an object
this job does not own is a ``NameConflict``; ``startupDeadlineSeconds`` and
``progressDeadlineSeconds`` end an attempt that does not start or does not
advance (counted). The backoff doubles per restart and starts over after an
attempt that ran ``backoffResetSeconds``.

Every rule reads only the job's own pods: ``plan.plan`` hands over
``observed`` after ``podowner.attach``, so a pod that merely carries the
job's labels neither steers nor blocks a decision and is never deleted.
"""

import dataclasses
import datetime
from typing import Any

from cairn.api import checkpointspec, exitcodes, jobstatus, podenv, trainingjob
from cairn.operator import conditions as cond
from cairn.operator import diagnosis, kueue, observe, resumeplan, tunables

# The delays live in ``tunables.Settings.lifecycle``; these names read them.
_DELAYS = tunables.DEFAULT.lifecycle
SUSPEND_REQUEUE_SECONDS = _DELAYS.suspend_requeue_seconds
CREATE_ERROR_REQUEUE_SECONDS = _DELAYS.create_error_requeue_seconds
STALE_STATUS_REQUEUE_SECONDS = _DELAYS.stale_status_requeue_seconds
DEFAULT_STALE_SECONDS = _DELAYS.default_stale_seconds
STALE_SLACK_SECONDS = _DELAYS.stale_slack_seconds
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
    delete: tuple[observe.ObservedPod, ...] = ()
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


def _failure_of(status: jobstatus.TrainingJobStatus) -> Failure | None:
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


def backoff_seconds(policy: trainingjob.RestartPolicy, *, restarts: int) -> int:
    """Exponential in the number of restarts so far (>= 1), capped."""
    exponent = max(restarts - 1, 0)
    return int(min(policy.backoff_seconds * 2 ** min(exponent, 30), policy.max_backoff_seconds))


def next_backoff(
    policy: trainingjob.RestartPolicy,
    *,
    previous: Failure | None,
    restarts: int,
    ran_seconds: float | None,
) -> int:
    """The wait before restart number ``restarts``: doubling from the previous
    wait, back to ``backoffSeconds`` after an attempt that ran at least
    ``backoffResetSeconds`` (a job that trains for hours and is preempted once
    a day never waits the cap)."""
    if ran_seconds is not None and ran_seconds >= policy.backoff_reset_seconds:
        return policy.backoff_seconds
    if previous is None or previous.backoff_seconds is None:
        return backoff_seconds(policy, restarts=restarts)
    doubled = max(previous.backoff_seconds * 2, policy.backoff_seconds)
    return min(doubled, policy.max_backoff_seconds)


def stale_after_seconds(spec: checkpointspec.CheckpointSpec) -> int:
    if spec.stale_after_seconds is not None:
        return spec.stale_after_seconds
    if spec.interval_seconds is not None:
        return 2 * spec.interval_seconds + STALE_SLACK_SECONDS
    return DEFAULT_STALE_SECONDS


def stale_reference(job: trainingjob.TrainingJob) -> datetime.datetime | None:
    """The later of the last commit and the attempt's start."""
    times = [job.status.attempt_start_time]
    ckpts = job.status.checkpoints
    if ckpts is not None and ckpts.last_committed is not None:
        times.append(ckpts.last_committed.time)
    known = [t for t in times if t is not None]
    return max(known) if known else None


def _retryable(policy: trainingjob.RestartPolicy, code: int | None) -> bool:
    if policy.retryable_exit_codes is None or code is None:
        return True
    return code in policy.retryable_exit_codes


def _live(pods: tuple[observe.ObservedPod, ...]) -> tuple[observe.ObservedPod, ...]:
    return tuple(p for p in pods if not p.terminated)


def _deletable(pods: tuple[observe.ObservedPod, ...]) -> tuple[observe.ObservedPod, ...]:
    return tuple(p for p in pods if not p.deleting)


class _Base:
    """The counters carried from the previous status into a Decision."""

    def __init__(self, status: jobstatus.TrainingJobStatus) -> None:
        self.phase: jobstatus.Phase = status.phase or "Pending"
        self.attempt = status.attempt or 0
        self.restarts = status.restarts or 0
        self.counted = status.restarts_count_towards_max or 0
        self.start_time = status.start_time
        self.attempt_start_time = status.attempt_start_time
        self.completion_time = status.completion_time
        self.failure = _failure_of(status)
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


def _cleanup(
    job: trainingjob.TrainingJob, pods: tuple[observe.ObservedPod, ...], *, keep_attempt: int
) -> tuple[observe.ObservedPod, ...]:
    """Terminated pods to delete: with Keep, those older than the previous attempt."""
    finished = [p for p in pods if p.terminated and not p.deleting]
    if job.spec.cleanup.finished_pods == "Delete":
        return tuple(p for p in finished if p.attempt != keep_attempt)
    return tuple(p for p in finished if p.attempt < keep_attempt - 1)


def _terminal(job: trainingjob.TrainingJob, observed: observe.Observed, base: _Base) -> Decision:
    kind = cond.COMPLETE if base.phase == "Succeeded" else cond.FAILED
    previous = cond.find(job.status.conditions, kind)
    reason = previous.reason if previous else base.phase
    message = previous.message if previous else ""
    doomed = _deletable(_live(observed.pods))
    if job.spec.cleanup.finished_pods == "Delete":
        doomed = _deletable(observed.pods)
    else:
        doomed += _cleanup(job, observed.pods, keep_attempt=base.attempt)
    # Why the pods never started stays visible after the job ended.
    stuck = cond.find(job.status.conditions, cond.PODS_NOT_STARTING)
    conflict = cond.find(job.status.conditions, cond.NAME_CONFLICT)
    return base.decision(
        phase=base.phase,
        reason=reason,
        message=message,
        delete=doomed,
        not_starting=(stuck.reason, stuck.message) if stuck and stuck.status == "True" else None,
        name_conflict=conflict.message if conflict and conflict.status == "True" else None,
    )


def _fail(
    job: trainingjob.TrainingJob,
    observed: observe.Observed,
    base: _Base,
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
        delete=_deletable(_live(observed.pods)),
    )


def _start(
    job: trainingjob.TrainingJob,
    observed: observe.Observed,
    base: _Base,
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
        delete=_cleanup(job, observed.pods, keep_attempt=attempt),
        requeue_after=_deadline_in(job, start=base.start_time or now, now=now),
    )


def _deadline_in(
    job: trainingjob.TrainingJob, *, start: datetime.datetime | None, now: datetime.datetime
) -> float | None:
    seconds = job.spec.active_deadline_seconds
    if seconds is None or start is None:
        return None
    return max((start - now).total_seconds() + seconds, 0.0)


def _suspend(
    job: trainingjob.TrainingJob,
    observed: observe.Observed,
    base: _Base,
    held: kueue.Hold | None = None,
) -> Decision:
    """`spec.suspend`, or Kueue holding the job (not admitted, or evicted: `held`
    gives the reason and message): the Cairn suspend (final checkpoint, then no
    pods), not counted against any restart budget. A job never started stays
    Suspended with no pod ever created."""
    live = _live(observed.pods)
    if live:
        return base.decision(
            phase="Suspending",
            reason=held.reason if held else cond.REASON_SUSPENDING,
            message=held.message if held else cond.MSG_SUSPENDING.format(count=len(live)),
            delete=_deletable(live),
            requeue_after=SUSPEND_REQUEUE_SECONDS,
        )
    # Like batch/v1 Job: the activeDeadlineSeconds clock restarts on resume.
    return base.decision(
        phase="Suspended",
        reason=held.reason if held else cond.REASON_SUSPENDED,
        message=held.message if held else cond.MSG_SUSPENDED,
        start_time=None,
        delete=_cleanup(job, observed.pods, keep_attempt=base.attempt),
    )


def _judge(
    job: trainingjob.TrainingJob,
    observed: observe.Observed,
    base: _Base,
    *,
    now: datetime.datetime,
) -> Failure | None:
    """The root cause if the current attempt has failed; None while it is healthy."""
    pods = observed.pods_of(base.attempt)
    attempt = base.attempt
    for pod in pods:
        if diagnosis.own_eviction(pod):
            return Failure(
                attempt=attempt,
                time=now,
                reason=cond.REASON_EVICTED,
                message=cond.MSG_EVICTED.format(
                    attempt=attempt, rank=pod.rank, message=pod.pod_message
                ),
                rank=pod.rank,
                counted=True,
            )
    for pod in pods:
        why = diagnosis.lost(pod)
        if why is not None:
            return Failure(
                attempt=attempt,
                time=now,
                reason=cond.REASON_PREEMPTED,
                message=cond.MSG_PREEMPTED.format(attempt=attempt, rank=pod.rank, why=why),
                rank=pod.rank,
                counted=False,
            )
    if base.phase == "Running":
        present = {p.rank for p in pods}
        missing = sorted(set(range(job.spec.nodes)) - present)
        if missing:
            return Failure(
                attempt=attempt,
                time=now,
                reason=cond.REASON_PREEMPTED,
                message=cond.MSG_PREEMPTED.format(
                    attempt=attempt, rank=missing[0], why="pod disappeared"
                ),
                rank=missing[0],
                counted=False,
            )
    failed = [p for p in pods if p.phase == "Failed"]
    if job.spec.runtime == "ray":
        failed = ray_root_candidates(failed, pods)
    if not failed:
        return None
    config = next(
        (p for p in failed if exitcodes.is_config_error(p.exit_code, p.termination_message)),
        None,
    )
    if config is not None:
        # Deterministic: every rank would refuse the same configuration again.
        return Failure(
            attempt=attempt,
            time=now,
            reason=cond.REASON_CONFIG_ERROR,
            message=cond.MSG_CONFIG_ERROR.format(
                attempt=attempt,
                rank=config.rank,
                message=config.termination_message.strip() or cond.MSG_CONFIG_ERROR_DEFAULT,
            ),
            rank=config.rank,
            exit_code=config.exit_code,
            counted=False,
        )
    far = datetime.datetime.max.replace(tzinfo=UTC)
    root = min(failed, key=lambda p: (p.finished_at or far, p.rank))
    detail = f" ({root.termination_reason})" if root.termination_reason else ""
    if root.termination_message.strip():
        detail += f": {root.termination_message.strip()}"
    return Failure(
        attempt=attempt,
        time=now,
        reason=cond.REASON_RANK_FAILED,
        message=cond.MSG_RANK_FAILED.format(
            attempt=attempt, rank=root.rank, code=root.exit_code, detail=detail
        ),
        rank=root.rank,
        exit_code=root.exit_code,
        counted=True,
    )


def _ray_follower(job: trainingjob.TrainingJob, pod: observe.ObservedPod) -> bool:
    """A Ray worker that ended only because the head's driver failed: the
    attempt stays Running until the head (which stops Ray first) ends too."""
    return (
        job.spec.runtime == "ray"
        and pod.rank != 0
        and pod.phase == "Failed"
        and exitcodes.follows_head(pod.termination_message)
    )


def ray_root_candidates(
    failed: list[observe.ObservedPod], pods: tuple[observe.ObservedPod, ...]
) -> list[observe.ObservedPod]:
    """Runtime ray: the failed pods that can be the root cause. A worker that
    only echoes the head's failed driver (``exitcodes.follows_head``) is not:
    while the head still runs (it stops Ray before it exits) the attempt has
    not failed yet, and once the head ended, the head is the cause."""
    own = [p for p in failed if not (p.rank != 0 and exitcodes.follows_head(p.termination_message))]
    if own or not failed:
        return own
    head_live = any(p.rank == 0 and not p.terminated for p in pods)
    return [] if head_live else failed


def _after_failure(
    job: trainingjob.TrainingJob,
    observed: observe.Observed,
    base: _Base,
    failure: Failure,
    *,
    now: datetime.datetime,
) -> Decision:
    policy = job.spec.restart_policy
    if failure.reason == cond.REASON_CONFIG_ERROR:
        return _fail(
            job,
            observed,
            base,
            reason=cond.REASON_CONFIG_ERROR,
            message=failure.message,
            now=now,
            failure=failure,
        )
    if failure.counted and not _retryable(policy, failure.exit_code):
        return _fail(
            job,
            observed,
            base,
            reason=cond.REASON_NON_RETRYABLE,
            message=cond.MSG_NON_RETRYABLE.format(failure=failure.message),
            now=now,
            failure=failure,
        )
    counted = base.counted + (1 if failure.counted else 0)
    if counted > policy.max_restarts:
        return _fail(
            job,
            observed,
            base,
            reason=cond.REASON_MAX_RESTARTS,
            message=cond.MSG_MAX_RESTARTS.format(
                failure=failure.message, counted=counted, limit=policy.max_restarts
            ),
            now=now,
            failure=failure,
            counted=counted,
        )
    preemptions = base.restarts - base.counted + (0 if failure.counted else 1)
    if preemptions > policy.max_preemptions:
        return _fail(
            job,
            observed,
            base,
            reason=cond.REASON_MAX_PREEMPTIONS,
            message=cond.MSG_MAX_PREEMPTIONS.format(
                failure=failure.message, count=preemptions, limit=policy.max_preemptions
            ),
            now=now,
            failure=failure,
        )
    restarts = base.restarts + 1
    started = base.attempt_start_time
    delay = next_backoff(
        policy,
        previous=base.failure,
        restarts=restarts,
        ran_seconds=(failure.time - started).total_seconds() if started else None,
    )
    failure = dataclasses.replace(failure, backoff_seconds=delay)
    return base.decision(
        phase="Restarting",
        reason=failure.reason,
        message=cond.MSG_BACKOFF.format(
            failure=failure.message, next=base.attempt + 1, seconds=delay
        ),
        restarts=restarts,
        counted_restarts=counted,
        failure=failure,
        delete=_deletable(_live(observed.pods)),
        requeue_after=float(delay),
    )


def _restarting(
    job: trainingjob.TrainingJob,
    observed: observe.Observed,
    base: _Base,
    *,
    now: datetime.datetime,
) -> Decision:
    failure = base.failure
    message = failure.message if failure else ""
    live = _live(observed.pods)
    if live:
        return base.decision(
            phase="Restarting",
            reason=cond.REASON_TEARING_DOWN,
            message=cond.MSG_TEARING_DOWN.format(
                failure=message, count=len(live), attempt=base.attempt
            ),
            delete=_deletable(live),
            requeue_after=SUSPEND_REQUEUE_SECONDS,
        )
    delay = (
        failure.backoff_seconds
        if failure is not None and failure.backoff_seconds is not None
        else backoff_seconds(job.spec.restart_policy, restarts=base.restarts)
    )
    since = failure.time if failure else now
    remaining = (since - now).total_seconds() + delay
    if remaining > 0:
        return base.decision(
            phase="Restarting",
            reason=cond.REASON_BACKOFF,
            message=cond.MSG_BACKOFF.format(
                failure=message, next=base.attempt + 1, seconds=round(remaining)
            ),
            requeue_after=remaining,
        )
    return _start(job, observed, base, now=now, reason=cond.REASON_ATTEMPT_STARTED)


def ray_head_succeeded(job: trainingjob.TrainingJob, pods: tuple[observe.ObservedPod, ...]) -> bool:
    """Runtime ray: the head (rank 0) ran the driver and exits with its code, so
    its success is the job's, whatever a worker did after it (a worker that
    lost the head before it read the success flag exits non-zero)."""
    if job.spec.runtime != "ray":
        return False
    return any(p.rank == 0 and p.phase == "Succeeded" for p in pods)


def _active(
    job: trainingjob.TrainingJob,
    observed: observe.Observed,
    base: _Base,
    *,
    now: datetime.datetime,
) -> Decision:
    pods = observed.pods_of(base.attempt)
    nodes = job.spec.nodes
    old = tuple(p for p in observed.pods if p.attempt != base.attempt)
    cleanup = _deletable(_live(old)) + _cleanup(job, old, keep_attempt=base.attempt)
    by_rank = {p.rank: p for p in pods}
    head_done = ray_head_succeeded(job, pods)
    failure = None if head_done else _judge(job, observed, base, now=now)
    if failure is not None:
        return _after_failure(job, observed, base, failure, now=now)
    if head_done or (
        len(by_rank) == nodes and all(p.phase == "Succeeded" for p in by_rank.values())
    ):
        done = tuple(pods) if job.spec.cleanup.finished_pods == "Delete" else ()
        return base.decision(
            phase="Succeeded",
            reason=cond.REASON_SUCCEEDED,
            message=cond.MSG_SUCCEEDED.format(attempt=base.attempt, nodes=nodes),
            completion_time=now,
            # Runtime ray: the workers still running when the driver finished
            # are stopped now (they would exit 0 on their own).
            delete=cleanup + _deletable(done) + _deletable(_live(pods)),
        )
    deadline = _deadline_in(job, start=base.start_time, now=now)
    running = sum(
        1 for p in by_rank.values() if p.phase in ("Running", "Succeeded") or _ray_follower(job, p)
    )
    if running == nodes:
        return _running(job, observed, base, cleanup=cleanup, deadline=deadline, now=now)
    return _starting(job, observed, base, cleanup=cleanup, deadline=deadline, now=now)


def _running(
    job: trainingjob.TrainingJob,
    observed: observe.Observed,
    base: _Base,
    *,
    cleanup: tuple[observe.ObservedPod, ...],
    deadline: float | None,
    now: datetime.datetime,
) -> Decision:
    nodes = job.spec.nodes
    stale_in: float | None = None
    reference = stale_reference(job)
    if reference is not None:
        limit = stale_after_seconds(job.spec.checkpoint)
        left = (reference - now).total_seconds() + limit
        stale_in = left if left > 0 else None
    progress_in = _progress_left(job, base, now=now)
    if progress_in is not None and progress_in <= 0:
        seconds = job.spec.progress_deadline_seconds
        failure = Failure(
            attempt=base.attempt,
            time=now,
            reason=cond.REASON_PROGRESS_DEADLINE,
            message=cond.MSG_PROGRESS_DEADLINE.format(
                attempt=base.attempt,
                seconds=seconds,
                step="none" if job.status.step is None else job.status.step,
            ),
            counted=True,
        )
        return _after_failure(job, observed, base, failure, now=now)
    waits = [w for w in (deadline, stale_in, progress_in) if w is not None]
    return base.decision(
        phase="Running",
        reason=cond.REASON_RUNNING,
        message=cond.MSG_RUNNING.format(attempt=base.attempt, nodes=nodes),
        delete=cleanup,
        requeue_after=min(waits) if waits else None,
    )


def _progress_left(
    job: trainingjob.TrainingJob, base: _Base, *, now: datetime.datetime
) -> float | None:
    """Seconds until progressDeadlineSeconds runs out (None: not checked). The
    clock starts at the later of the last step change and the attempt's start."""
    limit = job.spec.progress_deadline_seconds
    times = [t for t in (base.progress_time, base.attempt_start_time) if t is not None]
    if limit is None or not times:
        return None
    return (max(times) - now).total_seconds() + limit


def _starting(
    job: trainingjob.TrainingJob,
    observed: observe.Observed,
    base: _Base,
    *,
    cleanup: tuple[observe.ObservedPod, ...],
    deadline: float | None,
    now: datetime.datetime,
) -> Decision:
    """Pods missing or not all running: (re)create, and say why they do not run."""
    nodes = job.spec.nodes
    pods = observed.pods_of(base.attempt)
    by_rank = {p.rank: p for p in pods}
    running = sum(1 for p in by_rank.values() if p.phase in ("Running", "Succeeded"))
    errors = observed.create_errors
    invalid = next((e for e in errors if e.invalid), None)
    not_starting, name_conflict = diagnosis.create_problem(errors)
    if invalid is not None:
        failed = _fail(
            job,
            observed,
            base,
            reason=cond.REASON_INVALID_POD_SPEC,
            message=cond.MSG_INVALID_POD_SPEC.format(
                kind=invalid.kind, name=invalid.name, message=invalid.message
            ),
            now=now,
        )
        return dataclasses.replace(failed, not_starting=not_starting)
    not_starting = not_starting or diagnosis.pod_problem(pods, attempt=base.attempt)
    startup_in = _startup_left(job, base, now=now)
    if startup_in is not None and startup_in <= 0:
        detail = f": {not_starting[1]}" if not_starting else ""
        if name_conflict:
            detail = f": {name_conflict}"
        failure = Failure(
            attempt=base.attempt,
            time=now,
            reason=cond.REASON_STARTUP_DEADLINE,
            message=cond.MSG_STARTUP_DEADLINE.format(
                attempt=base.attempt, seconds=job.spec.startup_deadline_seconds, detail=detail
            ),
            counted=True,
        )
        return _after_failure(job, observed, base, failure, now=now)
    progress = cond.MSG_PODS_STARTING.format(attempt=base.attempt, running=running, nodes=nodes)
    message = progress
    reason = cond.REASON_PODS_STARTING
    if name_conflict is not None:
        reason, message = cond.REASON_NAME_CONFLICT, f"{name_conflict}; {progress}"
    elif not_starting is not None:
        reason, message = cond.REASON_PODS_NOT_STARTING, f"{not_starting[1]}; {progress}"
    waits = [w for w in (deadline, startup_in) if w is not None]
    if errors:
        waits.append(CREATE_ERROR_REQUEUE_SECONDS)
    return base.decision(
        phase="Starting",
        reason=reason,
        message=message,
        # Creates are idempotent; with a name conflict nothing is created until
        # the user resolves it (the retry finds out).
        start_attempt=len(by_rank) < nodes,
        resume=_recreate_target(job, base, now=now) if len(by_rank) < nodes else None,
        delete=cleanup,
        requeue_after=min(waits) if waits else None,
        not_starting=not_starting,
        name_conflict=name_conflict,
    )


def _recreate_target(
    job: trainingjob.TrainingJob, base: _Base, *, now: datetime.datetime
) -> podenv.ResumeTarget:
    """A missing pod of the current attempt resumes like its peers; a request
    made during the attempt waits for the next attempt start."""
    choice = resumeplan.choose(job, attempt=max(base.attempt, 1), now=now)
    return resumeplan.LATEST if choice.record is not None else choice.target


def _startup_left(
    job: trainingjob.TrainingJob, base: _Base, *, now: datetime.datetime
) -> float | None:
    started = base.attempt_start_time
    if started is None:
        return None
    return (started - now).total_seconds() + job.spec.startup_deadline_seconds


def decide(
    *, job: trainingjob.TrainingJob, observed: observe.Observed, now: datetime.datetime
) -> Decision:
    """The one function that computes the phase."""
    base = _Base(job.status)
    base.track_progress(job, now)
    if not job.spec.managed_by_cairn or job.metadata.deletion_timestamp is not None:
        return base.decision(phase=base.phase, reason="", message="", noop=True)
    if base.phase in jobstatus.TERMINAL_PHASES:
        return _terminal(job, observed, base)
    # observed.pods are the job's own (plan.plan attached them with podowner):
    # a stranger labelled attempt 99 never freezes the job here.
    ahead = [p for p in observed.pods if p.attempt > base.attempt]
    if ahead:
        # Our own status patch has not reached this copy of the job yet.
        return base.decision(
            phase=base.phase,
            reason=cond.REASON_STALE_STATUS,
            message=cond.MSG_STALE_STATUS.format(attempt=ahead[0].attempt, known=base.attempt),
            requeue_after=STALE_STATUS_REQUEUE_SECONDS,
            noop=True,
        )
    if job.spec.suspend:
        return _suspend(job, observed, base)
    held = kueue.hold(job=job, queue=observed.queue, live_pods=len(_live(observed.pods)))
    if held is not None:
        return _suspend(job, observed, base, held)
    deadline = _deadline_in(job, start=base.start_time, now=now)
    if deadline is not None and deadline <= 0:
        return _fail(
            job,
            observed,
            base,
            reason=cond.REASON_DEADLINE,
            message=cond.MSG_DEADLINE.format(seconds=job.spec.active_deadline_seconds),
            now=now,
        )
    if base.phase in ("Suspending", "Suspended") or base.attempt == 0:
        live = _live(observed.pods)
        if live:
            return base.decision(
                phase=base.phase,
                reason=cond.REASON_SUSPENDING,
                message=cond.MSG_SUSPENDING.format(count=len(live)),
                delete=_deletable(live),
                requeue_after=SUSPEND_REQUEUE_SECONDS,
            )
        reason = cond.REASON_RESUMED if base.attempt else cond.REASON_ATTEMPT_STARTED
        return _start(job, observed, base, now=now, reason=reason)
    if base.phase == "Restarting":
        return _restarting(job, observed, base, now=now)
    return _active(job, observed, base, now=now)


def decide_invalid(
    *, job: observe.InvalidJob, observed: observe.Observed, now: datetime.datetime
) -> Decision:
    """A spec the models refuse: Failed with the reason, pods stopped, no crash loop."""
    base = _Base(job.status)
    if job.metadata.deletion_timestamp is not None:
        return base.decision(phase=base.phase, reason="", message="", noop=True)
    message = cond.MSG_INVALID_SPEC.format(error=job.error)
    return base.decision(
        phase="Failed",
        reason=cond.REASON_INVALID_SPEC,
        message=message,
        completion_time=base.completion_time or now,
        delete=_deletable(_live(observed.pods)),
    )
