"""What a failed ``onDelete: Delete`` attempt decides: its retry delay and its condition. Pure.

``ondelete`` (IO) asks here after each failed attempt to empty a deleted
job's S3 prefix: how long until the next attempt (``core.backoff``: doubling,
capped, jittered, so the jobs of a deleted namespace do not retry in step),
and the ``CleanupFailed`` condition the job shows meanwhile (reason
``CleanupRetrying``), or, once ``cleanup_attempts`` failed, for the moment
before its finalizer goes (``CleanupAttemptsExhausted``: the objects stay
where they are, the deletion completes). The condition list is written whole
(a merge patch replaces a list), so ``with_condition`` keeps the others.
"""

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from cairn.api import jobstatus
from cairn.operator.core import backoff, conditions, tunables

MSG_RETRYING = "attempt {attempt} of {limit} to empty {uri} failed: {failure}; next in {delay:.0f}s"
MSG_EXHAUSTED = (
    "{uri} not emptied after {attempt} attempts: {failure}; its objects are left in place "
    "and the job's finalizer is released"
)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Verdict:
    """After a failed attempt: retry after ``delay`` seconds, or give up (None)."""

    delay: float | None
    condition: conditions.Desired


def after_failure(
    *, attempt: int, uri: str, failure: str, settings: tunables.StorageLoop, draw: float
) -> Verdict:
    """The ``attempt``-th (1-based) failure to empty ``uri``; ``failure`` names what
    failed (no credential: ``s3observe.StoreError`` texts never carry one). Pure."""
    limit = settings.cleanup_attempts
    if attempt >= limit:
        message = MSG_EXHAUSTED.format(uri=uri, attempt=attempt, failure=failure)
        return Verdict(
            delay=None,
            condition=conditions.Desired(
                type=conditions.CLEANUP_FAILED,
                status=True,
                reason=conditions.REASON_CLEANUP_EXHAUSTED,
                message=message,
            ),
        )
    policy = backoff.Policy(
        base_seconds=settings.cleanup_backoff_seconds,
        cap_seconds=settings.cleanup_backoff_cap_seconds,
    )
    delay = backoff.delay(policy, failures=attempt, draw=draw)
    message = MSG_RETRYING.format(
        attempt=attempt, limit=limit, uri=uri, failure=failure, delay=delay
    )
    return Verdict(
        delay=delay,
        condition=conditions.Desired(
            type=conditions.CLEANUP_FAILED,
            status=True,
            reason=conditions.REASON_CLEANUP_RETRYING,
            message=message,
        ),
    )


def with_condition(
    *,
    raw: object,
    parsed: Sequence[jobstatus.Condition] | None,
    desired: conditions.Desired,
    generation: int,
    now: datetime.datetime,
) -> list[dict[str, Any]]:
    """The job's whole condition list (``raw``: ``status.conditions`` as stored;
    ``parsed``: the same, validated) with ``desired`` set, every other condition
    as it was. Pure."""
    (new,) = conditions.merge(previous=parsed, desired=[desired], generation=generation, now=now)
    listed = raw if isinstance(raw, list) else []
    kept = [dict(c) for c in listed if isinstance(c, Mapping) and c.get("type") != desired.type]
    return [*kept, dict(new)]
