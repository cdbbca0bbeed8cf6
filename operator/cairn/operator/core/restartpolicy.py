"""The restart policy: what a failed attempt leads to, and the backoff before the next.

Pure. ``after_failure``: a configuration error or a non-retryable exit code
fails the job; a counted failure past ``maxRestarts``, or a preemption past
``maxPreemptions``, fails it; anything else restarts the gang after a
backoff that doubles per restart and starts over after an attempt that ran
``backoffResetSeconds``. ``restarting``: stop the attempt's pods, wait out
the backoff, then start the next attempt (``decisions.start``).
"""

import dataclasses
import datetime

from cairn.api import trainingjob
from cairn.operator.core import conditions as cond
from cairn.operator.core import decisions, jobobserve, tunables

TEARDOWN_REQUEUE_SECONDS = tunables.DEFAULT.lifecycle.suspend_requeue_seconds


def backoff_seconds(policy: trainingjob.RestartPolicy, *, restarts: int) -> int:
    """Exponential in the number of restarts so far (>= 1), capped."""
    exponent = max(restarts - 1, 0)
    return int(min(policy.backoff_seconds * 2 ** min(exponent, 30), policy.max_backoff_seconds))


def next_backoff(
    policy: trainingjob.RestartPolicy,
    *,
    previous: decisions.Failure | None,
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


def retryable(policy: trainingjob.RestartPolicy, code: int | None) -> bool:
    """Whether the exit code may be retried (``retryableExitCodes``; unknown: yes)."""
    if policy.retryable_exit_codes is None or code is None:
        return True
    return code in policy.retryable_exit_codes


def after_failure(
    job: trainingjob.TrainingJob,
    observed: jobobserve.Observed,
    base: decisions.Base,
    failure: decisions.Failure,
    *,
    now: datetime.datetime,
) -> decisions.Decision:
    """Failed (``_final``) or Restarting after the backoff (``next_backoff``)."""
    policy = job.spec.restart_policy
    counted = base.counted + (1 if failure.counted else 0)
    final = _final(policy, base=base, failure=failure, counted=counted)
    if final is not None:
        reason, message, counted_restarts = final
        return decisions.fail(
            job,
            observed,
            base,
            reason=reason,
            message=message,
            now=now,
            failure=failure,
            counted=counted_restarts,
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
        delete=decisions.deletable(decisions.live_pods(observed.pods)),
        requeue_after=float(delay),
    )


def _final(
    policy: trainingjob.RestartPolicy,
    *,
    base: decisions.Base,
    failure: decisions.Failure,
    counted: int,
) -> tuple[str, str, int | None] | None:
    """Why this failure ends the job: (reason, message, counted restarts to
    record, None: unchanged); None: it restarts."""
    if failure.reason == cond.REASON_CONFIG_ERROR:
        return cond.REASON_CONFIG_ERROR, failure.message, None
    if failure.counted and not retryable(policy, failure.exit_code):
        return (
            cond.REASON_NON_RETRYABLE,
            cond.MSG_NON_RETRYABLE.format(failure=failure.message),
            None,
        )
    if counted > policy.max_restarts:
        message = cond.MSG_MAX_RESTARTS.format(
            failure=failure.message, counted=counted, limit=policy.max_restarts
        )
        return cond.REASON_MAX_RESTARTS, message, counted
    preemptions = base.restarts - base.counted + (0 if failure.counted else 1)
    if preemptions > policy.max_preemptions:
        message = cond.MSG_MAX_PREEMPTIONS.format(
            failure=failure.message, count=preemptions, limit=policy.max_preemptions
        )
        return cond.REASON_MAX_PREEMPTIONS, message, None
    return None


def restarting(
    job: trainingjob.TrainingJob,
    observed: jobobserve.Observed,
    base: decisions.Base,
    *,
    now: datetime.datetime,
) -> decisions.Decision:
    failure = base.failure
    message = failure.message if failure else ""
    live = decisions.live_pods(observed.pods)
    if live:
        return base.decision(
            phase="Restarting",
            reason=cond.REASON_TEARING_DOWN,
            message=cond.MSG_TEARING_DOWN.format(
                failure=message, count=len(live), attempt=base.attempt
            ),
            delete=decisions.deletable(live),
            requeue_after=TEARDOWN_REQUEUE_SECONDS,
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
    return decisions.start(job, observed, base, now=now, reason=cond.REASON_ATTEMPT_STARTED)
