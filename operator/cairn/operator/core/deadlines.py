"""Deadlines and staleness: how much time a job has left, by each clock it has.

Pure. ``activeDeadlineSeconds`` (the whole job), ``startupDeadlineSeconds``
(an attempt's pods to run), ``progressDeadlineSeconds`` (``status.step`` to
change) and checkpoint staleness (``CheckpointStale``: no commit for
``stale_after_seconds``). ``lifecycle`` turns a deadline that ran out into a
failure and the time left into ``requeue_after``; the Decision carries the
``Staleness`` so ``status`` writes the condition from the same comparison.
"""

import dataclasses
import datetime

from cairn.api import checkpointspec, trainingjob
from cairn.operator.core import tunables

DEFAULT_STALE_SECONDS = tunables.DEFAULT.lifecycle.default_stale_seconds
STALE_SLACK_SECONDS = tunables.DEFAULT.lifecycle.stale_slack_seconds


def stale_after_seconds(spec: checkpointspec.CheckpointSpec) -> int:
    """How long a Running job may go without a commit before it is stale."""
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


def deadline_in(
    job: trainingjob.TrainingJob, *, start: datetime.datetime | None, now: datetime.datetime
) -> float | None:
    """Seconds left of activeDeadlineSeconds (0: past it; None: no deadline)."""
    seconds = job.spec.active_deadline_seconds
    if seconds is None or start is None:
        return None
    return max((start - now).total_seconds() + seconds, 0.0)


def progress_left(
    job: trainingjob.TrainingJob,
    *,
    progress_time: datetime.datetime | None,
    attempt_start_time: datetime.datetime | None,
    now: datetime.datetime,
) -> float | None:
    """Seconds until progressDeadlineSeconds runs out (None: not checked). The
    clock starts at the later of the last step change and the attempt's start."""
    limit = job.spec.progress_deadline_seconds
    times = [t for t in (progress_time, attempt_start_time) if t is not None]
    if limit is None or not times:
        return None
    return (max(times) - now).total_seconds() + limit


def startup_left(
    job: trainingjob.TrainingJob,
    *,
    attempt_start_time: datetime.datetime | None,
    now: datetime.datetime,
) -> float | None:
    """Seconds until startupDeadlineSeconds runs out (None: no attempt started)."""
    started = attempt_start_time
    if started is None:
        return None
    return (started - now).total_seconds() + job.spec.startup_deadline_seconds


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Staleness:
    """How far a Running job is from ``CheckpointStale``: computed once per
    reconcile (``staleness``), carried by the Decision, read by ``status``."""

    reference: datetime.datetime
    """The later of the last commit and the attempt's start."""
    limit: int
    """``stale_after_seconds`` of the job's checkpoint spec."""
    left: float
    """Seconds until stale; <= 0: stale now."""

    @property
    def stale(self) -> bool:
        """The one comparison: stale once ``limit`` seconds passed since ``reference``."""
        return self.left <= 0


def staleness(job: trainingjob.TrainingJob, *, now: datetime.datetime) -> Staleness | None:
    """The job's staleness at ``now`` (None: nothing to measure from yet)."""
    reference = stale_reference(job)
    if reference is None:
        return None
    limit = stale_after_seconds(job.spec.checkpoint)
    return Staleness(
        reference=reference, limit=limit, left=(reference - now).total_seconds() + limit
    )
