"""Suspend and Kueue hold: the Cairn suspend, and resuming from it.

Pure. ``spec.suspend``, or Kueue holding the job (not admitted, or evicted:
``kueueplan.hold``), stops the job's pods (each writes its final checkpoint
in its grace period) without counting against any restart budget; a job
never started stays Suspended with no pod. ``resume`` starts the next
attempt once no pod of the job is left.
"""

import datetime

from cairn.api import trainingjob
from cairn.operator.core import conditions as cond
from cairn.operator.core import decisions, jobobserve, kueueplan, tunables

SUSPEND_REQUEUE_SECONDS = tunables.DEFAULT.lifecycle.suspend_requeue_seconds


def suspend(
    job: trainingjob.TrainingJob,
    observed: jobobserve.Observed,
    base: decisions.Base,
    held: kueueplan.Hold | None = None,
) -> decisions.Decision:
    """`spec.suspend`, or Kueue holding the job (not admitted, or evicted: `held`
    gives the reason and message): the Cairn suspend (final checkpoint, then no
    pods), not counted against any restart budget. A job never started stays
    Suspended with no pod ever created."""
    live = decisions.live_pods(observed.pods)
    if live:
        return base.decision(
            phase="Suspending",
            reason=held.reason if held else cond.REASON_SUSPENDING,
            message=held.message if held else cond.MSG_SUSPENDING.format(count=len(live)),
            delete=decisions.deletable(live),
            requeue_after=SUSPEND_REQUEUE_SECONDS,
        )
    # Like batch/v1 Job: the activeDeadlineSeconds clock restarts on resume.
    return base.decision(
        phase="Suspended",
        reason=held.reason if held else cond.REASON_SUSPENDED,
        message=held.message if held else cond.MSG_SUSPENDED,
        start_time=None,
        delete=decisions.finished_pods(job, observed.pods, keep_attempt=base.attempt),
    )


def resume(
    job: trainingjob.TrainingJob,
    observed: jobobserve.Observed,
    base: decisions.Base,
    *,
    now: datetime.datetime,
) -> decisions.Decision:
    """Suspending/Suspended (or never started) and no longer held: once the
    job's pods are gone, start the next attempt (the first one: Pending)."""
    live = decisions.live_pods(observed.pods)
    if live:
        return base.decision(
            phase=base.phase,
            reason=cond.REASON_SUSPENDING,
            message=cond.MSG_SUSPENDING.format(count=len(live)),
            delete=decisions.deletable(live),
            requeue_after=SUSPEND_REQUEUE_SECONDS,
        )
    reason = cond.REASON_RESUMED if base.attempt else cond.REASON_ATTEMPT_STARTED
    return decisions.start(job, observed, base, now=now, reason=reason)
