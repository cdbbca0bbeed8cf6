"""Pure: folds the writer's progress events into the job's `status.checkpoints`.

Rank 0 subscribes this fold to the `CheckpointManager`; the result goes to
the status reporter. `committed` and `uploaded` events of rank 0 describe the
step as a whole (rank 0 commits last and uploads the manifest last), so
their time and bytes are the step's. History is bounded and newest first.
"""

import dataclasses
import datetime

from cairn.api import jobstatus, manifest
from cairn.checkpoint import events

HISTORY_LIMIT = jobstatus.HISTORY_LIMIT


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Tracker:
    """Immutable fold state: the status plus the stall of the step in flight."""

    status: jobstatus.CheckpointsStatus = dataclasses.field(
        default_factory=jobstatus.CheckpointsStatus
    )
    stall_seconds: dict[int, float] = dataclasses.field(default_factory=dict)
    upload_uri: str | None = None


def continued(previous: jobstatus.CheckpointsStatus | None, *, upload_uri: str | None) -> Tracker:
    """Pure: the fold state a new attempt's writer starts from.

    The job's checkpoint records (last commit, last upload, history) go on
    across attempts; what was in flight died with the previous attempt, and
    `resumedFrom` is this attempt's to set.
    """
    if previous is None:
        return Tracker(upload_uri=upload_uri)
    kept = previous.model_copy(update={"in_flight": None, "resumed_from": None})
    return Tracker(status=kept, upload_uri=upload_uri)


def _record(
    history: list[jobstatus.CheckpointRecord] | None, record: jobstatus.CheckpointRecord
) -> list[jobstatus.CheckpointRecord]:
    kept = [r for r in history or [] if r.step != record.step]
    return sorted([record, *kept], key=lambda r: r.step, reverse=True)[:HISTORY_LIMIT]


def _without_in_flight(
    status: jobstatus.CheckpointsStatus, step: int
) -> list[jobstatus.InFlightCheckpoint] | None:
    left = [f for f in status.in_flight or [] if f.step != step]
    return left or None


NEXT_STAGE: dict[str, jobstatus.InFlightStage] = {"staged": "writing", "written": "committing"}
"""The stage a step in flight enters when rank 0 finishes the phase named."""


def _advanced(
    status: jobstatus.CheckpointsStatus, step: int, stage: jobstatus.InFlightStage
) -> list[jobstatus.InFlightCheckpoint] | None:
    return [
        f.model_copy(update={"stage": stage}) if f.step == step else f
        for f in status.in_flight or []
    ] or None


def apply(tracker: Tracker, event: events.ProgressEvent, *, now: datetime.datetime) -> Tracker:
    """Pure: the tracker after `event` (rank 0's events; others are ignored)."""
    if event.rank != 0:
        return tracker
    status = tracker.status
    step = event.step
    if event.phase == "blocked":
        in_flight = [
            *(_without_in_flight(status, step) or []),
            jobstatus.InFlightCheckpoint(step=step, stage="staging", since=now),
        ]
        return dataclasses.replace(
            tracker,
            status=status.model_copy(update={"in_flight": in_flight[-8:]}),
            stall_seconds={step: event.seconds},
        )
    if event.phase in NEXT_STAGE:
        advanced = _advanced(status, step, NEXT_STAGE[event.phase])
        return dataclasses.replace(
            tracker, status=status.model_copy(update={"in_flight": advanced})
        )
    if event.phase == "committed":
        committed = jobstatus.CommittedCheckpoint(
            step=step,
            time=now,
            bytes=event.bytes or None,
            write_seconds=event.seconds,
            stall_seconds=tracker.stall_seconds.get(step),
        )
        update = {
            "last_committed": committed,
            "history": _record(
                status.history,
                jobstatus.CheckpointRecord(
                    step=step, state="committed", time=now, bytes=event.bytes or None
                ),
            ),
        }
        update["in_flight"] = (
            _without_in_flight(status, step)
            if tracker.upload_uri is None
            else _advanced(status, step, "uploading")
        )
        return dataclasses.replace(tracker, status=status.model_copy(update=update))
    if event.phase == "uploaded":
        uri = (
            f"{tracker.upload_uri.rstrip('/')}/{manifest.step_dir_name(step)}/"
            if tracker.upload_uri
            else None
        )
        uploaded = jobstatus.UploadedCheckpoint(
            step=step, uri=uri, time=now, bytes=event.bytes or None, verified=False
        )
        record = jobstatus.CheckpointRecord(
            step=step, state="uploaded", time=now, bytes=event.bytes or None, uri=uri
        )
        return dataclasses.replace(
            tracker,
            status=status.model_copy(
                update={
                    "last_uploaded": uploaded,
                    "history": _record(status.history, record),
                    "in_flight": _without_in_flight(status, step),
                }
            ),
        )
    if event.phase == "deleted":
        old = next((r for r in status.history or [] if r.step == step), None)
        if old is None:
            return tracker
        record = old.model_copy(update={"state": "rotated", "time": now})
        return dataclasses.replace(
            tracker, status=status.model_copy(update={"history": _record(status.history, record)})
        )
    if event.phase == "failed":
        record = jobstatus.CheckpointRecord(
            step=step, state="corrupt", time=now, message=event.message[:1000] or None
        )
        return dataclasses.replace(
            tracker,
            status=status.model_copy(
                update={
                    "history": _record(status.history, record),
                    "in_flight": _without_in_flight(status, step),
                }
            ),
        )
    return tracker
