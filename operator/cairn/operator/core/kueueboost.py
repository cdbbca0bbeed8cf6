"""Kueue priority boost: uncommitted work raises the Workload's priority.

Pure. A job that took steps since its last commit would lose them if Kueue
preempted it now; ``boost`` turns that work (time since the later of the
last commit and the attempt's start) into ``kueue.x-k8s.io/priority-boost``
in buckets (``BoostPolicy``), so a Workload is rewritten at most once per
bucket. ``kueueapply.sync`` writes ``boost_patch``.
"""

import dataclasses
import datetime
from typing import Any

from cairn.api import trainingjob
from cairn.operator.core import kueueplan


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class BoostPolicy:
    """How uncommitted work turns into ``kueue.x-k8s.io/priority-boost``.

    ``boost = min(max_boost, per_bucket * floor(age / bucket_seconds))`` while
    steps were taken since the last commit, else 0; ``age`` is the time since
    the later of the last commit and the attempt's start."""

    bucket_seconds: int = 60
    """The boost changes at most once per bucket (no churn of Workload writes)."""
    per_bucket: int = 1
    max_boost: int = 100
    """Keep it below the gap between priority classes that must still preempt:
    Kueue compares base priority + boost, also when deciding who may preempt whom."""

    def __post_init__(self) -> None:
        for name in ("bucket_seconds", "per_bucket", "max_boost"):
            if getattr(self, name) <= 0:
                raise ValueError(f"BoostPolicy.{name} must be > 0")


DEFAULT_BOOST = BoostPolicy()


def uncommitted(
    job: trainingjob.TrainingJob, *, now: datetime.datetime
) -> tuple[float, int] | None:
    """(seconds, steps) of work the job would lose if stopped now without a final
    checkpoint; None before the attempt started. Seconds count from the later of
    the last commit and the attempt's start (a resumed attempt starts at its
    checkpoint); steps from the committed step (0 when status.step is unknown)."""
    started = job.status.attempt_start_time
    if started is None:
        return None
    ckpts = job.status.checkpoints
    committed = ckpts.last_committed if ckpts is not None else None
    since = started
    base_step = 0
    if committed is not None:
        base_step = committed.step
        if committed.time is not None and committed.time > since:
            since = committed.time
    step = job.status.step
    steps = max(step - base_step, 0) if step is not None else 0
    return max((now - since).total_seconds(), 0.0), steps


def boost(
    job: trainingjob.TrainingJob, *, now: datetime.datetime, policy: BoostPolicy = DEFAULT_BOOST
) -> int:
    """The priority boost for the job's uncommitted work (pure; see BoostPolicy).
    0 when nothing would be lost: not started, or no step since the last commit."""
    work = uncommitted(job, now=now)
    if work is None:
        return 0
    seconds, steps = work
    if steps <= 0:
        return 0
    buckets = int(seconds // policy.bucket_seconds)
    return min(policy.max_boost, buckets * policy.per_bucket)


def next_boost_change(
    job: trainingjob.TrainingJob, *, now: datetime.datetime, policy: BoostPolicy = DEFAULT_BOOST
) -> float | None:
    """Seconds until :func:`boost` can change by time alone (None: it cannot)."""
    work = uncommitted(job, now=now)
    if work is None or boost(job, now=now, policy=policy) >= policy.max_boost:
        return None
    seconds, _ = work
    return policy.bucket_seconds - (seconds % policy.bucket_seconds)


def boost_patch(current: str | None, desired: int) -> dict[str, Any] | None:
    """The Workload metadata merge patch for the boost (None: already so). A
    boost of 0 removes the annotation (Kueue reads a missing one as 0)."""
    wanted = str(desired) if desired else None
    if current == wanted:
        return None
    return {"metadata": {"annotations": {kueueplan.BOOST_ANNOTATION: wanted}}}
