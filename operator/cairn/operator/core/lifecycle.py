"""The lifecycle decision table: from (job, observed pods, now) to one Decision.

Pure. This is where the phase is computed, in one place (``decide``):

    Pending -> Starting -> Running -> (Restarting -> Starting -> Running)*
            -> Succeeded | Failed
    any live phase -> Suspending -> Suspended -> Starting (resume)

``decide`` reads as a table, first match wins: not ours or being deleted
(noop); terminal (``_terminal``: cleanup only); our own status patch not
seen yet (noop, requeue); suspended or held by Kueue (``suspension``); past
``activeDeadlineSeconds`` (``deadlines``: Failed); not started or resuming
(``suspension.resume``); restarting (``restartpolicy.restarting``); else the
attempt is active (``_active``): a lost pod replaced in place
(``replaceplan``: runtime torchrun or ray with in-place restarts), else its
root cause if it failed (``diagnosis.judge`` -> ``restartpolicy.after_failure``), Succeeded,
Running (``_running``: progress deadline, staleness) or Starting
(``_starting``: creates, ``PodsNotStarting``, ``NameConflict``, the startup
deadline). Each policy lives in its own module; ``decisions`` holds the value
and the builders they share.

Gang semantics: a failed or lost rank fails the whole attempt (except a lost
pod ``replaceplan`` replaces in place); the operator
records the failure in status *before* it deletes the other ranks (so a crash
between the two cannot lose or double-count it), waits for the attempt's pods
to stop and for the backoff, then starts attempt N+1, which resumes from the
last committed step.

Every rule reads only the job's own pods: ``jobplan.plan`` hands over
``observed`` after ``podowner.attach``, so a pod that merely carries the
job's labels neither steers nor blocks a decision and is never deleted.
"""

import dataclasses
import datetime

from cairn.api import jobstatus, trainingjob
from cairn.operator.core import conditions as cond
from cairn.operator.core import (
    deadlines,
    decisions,
    diagnosis,
    jobobserve,
    kueueplan,
    replaceplan,
    restartpolicy,
    resumeplan,
    suspension,
    tunables,
)

# The delays live in ``tunables.Settings.lifecycle``; these names read them.
CREATE_ERROR_REQUEUE_SECONDS = tunables.DEFAULT.lifecycle.create_error_requeue_seconds
STALE_STATUS_REQUEUE_SECONDS = tunables.DEFAULT.lifecycle.stale_status_requeue_seconds


def _terminal(
    job: trainingjob.TrainingJob, observed: jobobserve.Observed, base: decisions.Base
) -> decisions.Decision:
    kind = cond.COMPLETE if base.phase == "Succeeded" else cond.FAILED
    previous = cond.find(job.status.conditions, kind)
    reason = previous.reason if previous else base.phase
    message = previous.message if previous else ""
    doomed = decisions.deletable(decisions.live_pods(observed.pods))
    if job.spec.cleanup.finished_pods == "Delete":
        doomed = decisions.deletable(observed.pods)
    else:
        doomed += decisions.finished_pods(job, observed.pods, keep_attempt=base.attempt)
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


def _active(
    job: trainingjob.TrainingJob,
    observed: jobobserve.Observed,
    base: decisions.Base,
    *,
    now: datetime.datetime,
) -> decisions.Decision:
    pods = observed.pods_of(base.attempt)
    old = tuple(p for p in observed.pods if p.attempt != base.attempt)
    cleanup = decisions.deletable(decisions.live_pods(old)) + decisions.finished_pods(
        job, old, keep_attempt=base.attempt
    )
    seen = replaceplan.settle(job, pods)
    replaced = replaceplan.replacing(job, observed, base, settled=seen, cleanup=cleanup, now=now)
    if replaced is not None:
        return replaced
    decision = _attempt(job, observed, base, cleanup=cleanup, now=now)
    if seen is not None and decision.attempt == base.attempt:
        decision = dataclasses.replace(decision, pod_replacements=seen)
    return decision


def _attempt(
    job: trainingjob.TrainingJob,
    observed: jobobserve.Observed,
    base: decisions.Base,
    *,
    cleanup: tuple[jobobserve.ObservedPod, ...],
    now: datetime.datetime,
) -> decisions.Decision:
    """The active attempt, no pod being replaced: failed, Succeeded, Running or Starting."""
    pods = observed.pods_of(base.attempt)
    nodes = job.spec.nodes
    by_rank = {p.rank: p for p in pods}
    head_done = diagnosis.ray_head_succeeded(job, pods)
    failure = None if head_done else diagnosis.judge(job, observed, base, now=now)
    if failure is not None:
        return restartpolicy.after_failure(job, observed, base, failure, now=now)
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
            delete=cleanup
            + decisions.deletable(done)
            + decisions.deletable(decisions.live_pods(pods)),
        )
    deadline = deadlines.deadline_in(job, start=base.start_time, now=now)
    running = sum(
        1
        for p in by_rank.values()
        if p.phase in ("Running", "Succeeded") or diagnosis.ray_follower(job, p)
    )
    if running == nodes:
        return _running(job, observed, base, cleanup=cleanup, deadline=deadline, now=now)
    return _starting(job, observed, base, cleanup=cleanup, deadline=deadline, now=now)


def _running(
    job: trainingjob.TrainingJob,
    observed: jobobserve.Observed,
    base: decisions.Base,
    *,
    cleanup: tuple[jobobserve.ObservedPod, ...],
    deadline: float | None,
    now: datetime.datetime,
) -> decisions.Decision:
    nodes = job.spec.nodes
    staleness = deadlines.staleness(job, now=now)
    stale_in = staleness.left if staleness is not None and not staleness.stale else None
    progress_in = deadlines.progress_left(
        job, progress_time=base.progress_time, attempt_start_time=base.attempt_start_time, now=now
    )
    if progress_in is not None and progress_in <= 0:
        seconds = job.spec.progress_deadline_seconds
        failure = decisions.Failure(
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
        return restartpolicy.after_failure(job, observed, base, failure, now=now)
    waits = [w for w in (deadline, stale_in, progress_in) if w is not None]
    return base.decision(
        phase="Running",
        reason=cond.REASON_RUNNING,
        message=cond.MSG_RUNNING.format(attempt=base.attempt, nodes=nodes),
        delete=cleanup,
        staleness=staleness,
        requeue_after=min(waits) if waits else None,
    )


def _starting(
    job: trainingjob.TrainingJob,
    observed: jobobserve.Observed,
    base: decisions.Base,
    *,
    cleanup: tuple[jobobserve.ObservedPod, ...],
    deadline: float | None,
    now: datetime.datetime,
) -> decisions.Decision:
    """Pods missing or not all running: (re)create, and say why they do not run."""
    nodes = job.spec.nodes
    pods = observed.pods_of(base.attempt)
    by_rank = {p.rank: p for p in pods}
    running = sum(1 for p in by_rank.values() if p.phase in ("Running", "Succeeded"))
    errors = observed.create_errors
    invalid = next((e for e in errors if e.invalid), None)
    not_starting, name_conflict = diagnosis.create_problem(errors)
    if invalid is not None:  # a 422: the same pod would be refused again
        message = cond.MSG_INVALID_POD_SPEC.format(
            kind=invalid.kind, name=invalid.name, message=invalid.message
        )
        failed = decisions.fail(
            job, observed, base, reason=cond.REASON_INVALID_POD_SPEC, message=message, now=now
        )
        return dataclasses.replace(failed, not_starting=not_starting)
    not_starting = not_starting or diagnosis.pod_problem(pods, attempt=base.attempt)
    startup_in = deadlines.startup_left(job, attempt_start_time=base.attempt_start_time, now=now)
    if startup_in is not None and startup_in <= 0:
        why = name_conflict or (not_starting[1] if not_starting else None)
        failure = decisions.Failure(
            attempt=base.attempt,
            time=now,
            reason=cond.REASON_STARTUP_DEADLINE,
            message=cond.MSG_STARTUP_DEADLINE.format(
                attempt=base.attempt,
                seconds=job.spec.startup_deadline_seconds,
                detail=f": {why}" if why else "",
            ),
            counted=True,
        )
        return restartpolicy.after_failure(job, observed, base, failure, now=now)
    progress = cond.MSG_PODS_STARTING.format(attempt=base.attempt, running=running, nodes=nodes)
    reason, message = _why_starting(progress, not_starting=not_starting, conflict=name_conflict)
    retry = CREATE_ERROR_REQUEUE_SECONDS if errors else None
    waits = [w for w in (deadline, startup_in, retry) if w is not None]
    missing = len(by_rank) < nodes
    return base.decision(
        phase="Starting",
        reason=reason,
        message=message,
        # Creates are idempotent; with a name conflict nothing is created until
        # the user resolves it (the retry finds out).
        start_attempt=missing,
        resume=resumeplan.recreate_target(job, attempt=base.attempt, now=now) if missing else None,
        delete=cleanup,
        requeue_after=min(waits) if waits else None,
        not_starting=not_starting,
        name_conflict=name_conflict,
    )


def _why_starting(
    progress: str, *, not_starting: tuple[str, str] | None, conflict: str | None
) -> tuple[str, str]:
    """The Starting reason and message: a name conflict first, then why pods do not start."""
    if conflict is not None:
        return cond.REASON_NAME_CONFLICT, f"{conflict}; {progress}"
    if not_starting is not None:
        return cond.REASON_PODS_NOT_STARTING, f"{not_starting[1]}; {progress}"
    return cond.REASON_PODS_STARTING, progress


def decide(
    *, job: trainingjob.TrainingJob, observed: jobobserve.Observed, now: datetime.datetime
) -> decisions.Decision:
    """The one function that computes the phase."""
    base = decisions.Base(job.status)
    base.track_progress(job, now)
    if not job.spec.managed_by_cairn or job.metadata.deletion_timestamp is not None:
        return base.decision(phase=base.phase, reason="", message="", noop=True)
    if base.phase in jobstatus.TERMINAL_PHASES:
        return _terminal(job, observed, base)
    # observed.pods are the job's own (jobplan.plan attached them with podowner):
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
        return suspension.suspend(job, observed, base)
    held = kueueplan.hold(
        job=job, queue=observed.queue, live_pods=len(decisions.live_pods(observed.pods))
    )
    if held is not None:
        return suspension.suspend(job, observed, base, held)
    deadline = deadlines.deadline_in(job, start=base.start_time, now=now)
    if deadline is not None and deadline <= 0:
        return decisions.fail(
            job,
            observed,
            base,
            reason=cond.REASON_DEADLINE,
            message=cond.MSG_DEADLINE.format(seconds=job.spec.active_deadline_seconds),
            now=now,
        )
    if base.phase in ("Suspending", "Suspended") or base.attempt == 0:
        return suspension.resume(job, observed, base, now=now)
    if base.phase == "Restarting":
        return restartpolicy.restarting(job, observed, base, now=now)
    return _active(job, observed, base, now=now)


def decide_invalid(
    *, job: jobobserve.InvalidJob, observed: jobobserve.Observed, now: datetime.datetime
) -> decisions.Decision:
    """A spec the models refuse: Failed with the reason, pods stopped, no crash loop."""
    base = decisions.Base(job.status)
    if job.metadata.deletion_timestamp is not None:
        return base.decision(phase=base.phase, reason="", message="", noop=True)
    message = cond.MSG_INVALID_SPEC.format(error=job.error)
    return base.decision(
        phase="Failed",
        reason=cond.REASON_INVALID_SPEC,
        message=message,
        completion_time=base.completion_time or now,
        delete=decisions.deletable(decisions.live_pods(observed.pods)),
    )
