"""``spec.ttlSecondsAfterFinished``: when a finished job is due for deletion.

Pure: the job's raw body in, the deletion time out. Read leniently from the
raw body (not the validated model), so that a job Failed for an invalid spec
is cleaned up as well. ``finishedjobs.FinishedJobs`` keeps one asyncio timer per
finished job whose ``due_at`` is not None (no task, no daemon) and deletes
the job when it fires; the
finalizer (``onDelete``) runs as for any deletion, and the job's pods,
Service and RBAC go with it through their ownerReferences.
"""

import datetime
from collections.abc import Mapping
from typing import Any

from cairn.api import jobstatus
from cairn.operator.core import jobobserve

FIELD = "ttlSecondsAfterFinished"
EVENT_REASON = "TTLExpired"


def ttl_seconds(body: Mapping[str, Any]) -> int | None:
    value = (body.get("spec") or {}).get(FIELD)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def due_at(body: Mapping[str, Any]) -> datetime.datetime | None:
    """When the job should be deleted; None: not finished, no TTL, or being deleted."""
    seconds = ttl_seconds(body)
    if seconds is None or (body.get("metadata") or {}).get("deletionTimestamp"):
        return None
    status = jobobserve.parse_status(body)
    if status.phase not in jobstatus.TERMINAL_PHASES or status.completion_time is None:
        return None
    return status.completion_time + datetime.timedelta(seconds=seconds)


def seconds_left(body: Mapping[str, Any], *, now: datetime.datetime) -> float | None:
    """Seconds until deletion (<= 0: now); None: never, as things stand."""
    due = due_at(body)
    return None if due is None else (due - now).total_seconds()


def message(body: Mapping[str, Any]) -> str:
    phase = jobobserve.parse_status(body).phase or "finished"
    return f"deleted {ttl_seconds(body)} s after it {phase} (spec.{FIELD})"
