"""Pure: folds the writer's progress events into the job's `status.checkpoints`.

Rank 0's `CheckpointManager` subscribes this fold (`status_feed`); the result goes to
the status reporter. `committed` and `uploaded` events of rank 0 describe the
step as a whole (rank 0 commits last and uploads the manifest last), so
their time and bytes are the step's. History is bounded and newest first.
"""

import dataclasses
import datetime
import typing

from cairn.api import jobstatus, manifest
from cairn.checkpoint import events, upload_backlog

HISTORY_LIMIT = jobstatus.HISTORY_LIMIT


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Tracker:
    """Immutable fold state: the status plus the stall of the step in flight."""

    status: jobstatus.CheckpointsStatus = dataclasses.field(
        default_factory=jobstatus.CheckpointsStatus
    )
    stall_seconds: dict[int, float] = dataclasses.field(default_factory=dict)
    upload_uri: str | None = None
    ended: tuple[int, ...] = ()
    """Steps whose flight is over (uploaded, or committed without S3, or
    failed), newest last and bounded: the training thread's `blocked` event
    can arrive after the writer thread's later events of the same step."""


ENDED_LIMIT = 16


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


def resumed(tracker: Tracker, resumed_from: jobstatus.ResumedFrom) -> Tracker:
    """Pure: the attempt restored `resumed_from`; that step is a committed
    checkpoint even if the previous attempt died before reporting it. An
    imported checkpoint is not one of this job's: it gets no history record."""
    status = tracker.status
    update: dict[str, object] = {"resumed_from": resumed_from}
    if not resumed_from.imported and not any(
        r.step == resumed_from.step for r in status.history or []
    ):
        state: jobstatus.CheckpointState = (
            "uploaded" if resumed_from.source == "remote" else "committed"
        )
        record = jobstatus.CheckpointRecord(
            step=resumed_from.step, state=state, uri=resumed_from.uri
        )
        update["history"] = _record(status.history, record)
    return dataclasses.replace(tracker, status=status.model_copy(update=update))


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
    tracker: Tracker, step: int, stage: jobstatus.InFlightStage, *, now: datetime.datetime
) -> list[jobstatus.InFlightCheckpoint] | None:
    """The in-flight list with `step` at `stage` (added if not there yet),
    unless the step's flight is already over."""
    current = tracker.status.in_flight or []
    if step in tracker.ended:
        return current or None
    if not any(f.step == step for f in current):
        added = jobstatus.InFlightCheckpoint(step=step, stage=stage, since=now)
        return [*current, added][-8:]
    return [f.model_copy(update={"stage": stage}) if f.step == step else f for f in current]


def _ended(tracker: Tracker, step: int) -> tuple[int, ...]:
    return (*(s for s in tracker.ended if s != step), step)[-ENDED_LIMIT:]


def _blocked(tracker: Tracker, event: events.ProgressEvent, *, now: datetime.datetime) -> Tracker:
    """The training loop's wait for a save: its stall, and the step enters the
    flight at `staging` unless the writer thread already moved it on."""
    status = tracker.status
    step = event.step
    committed = status.last_committed
    update: dict[str, object] = {}
    if committed is not None and committed.step == step and committed.stall_seconds is None:
        update["last_committed"] = committed.model_copy(update={"stall_seconds": event.seconds})
    if not any(f.step == step for f in status.in_flight or []):  # never a step back
        update["in_flight"] = _advanced(tracker, step, "staging", now=now)
    return dataclasses.replace(
        tracker,
        status=status.model_copy(update=update),
        stall_seconds={step: event.seconds},
    )


def _upload_failed(
    tracker: Tracker, event: events.ProgressEvent, *, now: datetime.datetime
) -> Tracker:
    """A failed upload round: the error and the backlog; the step's flight is
    over (it is committed and waits in the backlog)."""
    status = tracker.status
    backlog, error = upload_backlog.parse_failure_message(event.message)
    previous = status.upload_error
    upload_error = jobstatus.UploadError(
        message=error[:1024],
        time=now,
        step=event.step,
        backlog=sorted(backlog)[-64:] or None,
        retention=previous.retention if previous else None,
    )
    return dataclasses.replace(
        tracker,
        status=status.model_copy(
            update={
                "upload_error": upload_error,
                "in_flight": _without_in_flight(status, event.step),
            }
        ),
        ended=_ended(tracker, event.step),
    )


def _backlog_without(
    error: jobstatus.UploadError | None, step: int
) -> jobstatus.UploadError | None:
    """The upload error once `step` made it: cleared when nothing is left."""
    if error is None:
        return None
    left = [s for s in error.backlog or [] if s != step]
    if not left:
        return None
    return error.model_copy(update={"backlog": left})


def _retention_note(tracker: Tracker, message: str) -> Tracker:
    """Rotation's report that the backlog exceeds local retention (or not):
    `retentionOverBudget` always (a slow store fails nothing yet fills the
    volume), and the upload error's note while uploads fail."""
    status = tracker.status
    note = message[:1024] or None
    update: dict[str, object] = {}
    if status.retention_over_budget != note:
        update["retention_over_budget"] = note
    error = status.upload_error
    if error is not None and error.retention != note:
        update["upload_error"] = error.model_copy(update={"retention": note})
    if not update:
        return tracker
    return dataclasses.replace(tracker, status=status.model_copy(update=update))


def _stage_done(
    tracker: Tracker, event: events.ProgressEvent, *, now: datetime.datetime
) -> Tracker:
    """Rank 0 finished staging or writing: the step enters its next stage."""
    advanced = _advanced(tracker, event.step, NEXT_STAGE[event.phase], now=now)
    return dataclasses.replace(
        tracker, status=tracker.status.model_copy(update={"in_flight": advanced})
    )


def _committed(tracker: Tracker, event: events.ProgressEvent, *, now: datetime.datetime) -> Tracker:
    """The step is committed: the last commit, a history record; its flight
    goes on to the upload (or ends, without S3)."""
    status, step = tracker.status, event.step
    committed = jobstatus.CommittedCheckpoint(
        step=step,
        time=now,
        bytes=event.bytes or None,
        write_seconds=event.seconds,
        stall_seconds=tracker.stall_seconds.get(step),
    )
    record = jobstatus.CheckpointRecord(
        step=step, state="committed", time=now, bytes=event.bytes or None
    )
    update = {"last_committed": committed, "history": _record(status.history, record)}
    if tracker.upload_uri is None:
        update["in_flight"] = _without_in_flight(status, step)
        return dataclasses.replace(
            tracker, status=status.model_copy(update=update), ended=_ended(tracker, step)
        )
    update["in_flight"] = _advanced(tracker, step, "uploading", now=now)
    return dataclasses.replace(tracker, status=status.model_copy(update=update))


def _uploaded(tracker: Tracker, event: events.ProgressEvent, *, now: datetime.datetime) -> Tracker:
    """The step is in the store: the last upload (unless a newer one is), a
    history record, out of the flight and out of the upload error's backlog."""
    status, step = tracker.status, event.step
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
    newer = status.last_uploaded is None or status.last_uploaded.step <= step
    update = {
        # A backlog step uploaded late is older than the last one.
        "last_uploaded": uploaded if newer else status.last_uploaded,
        "history": _record(status.history, record),
        "in_flight": _without_in_flight(status, step),
        "upload_error": _backlog_without(status.upload_error, step),
    }
    return dataclasses.replace(
        tracker, status=status.model_copy(update=update), ended=_ended(tracker, step)
    )


def _deleted(tracker: Tracker, event: events.ProgressEvent, *, now: datetime.datetime) -> Tracker:
    """Rotation deleted the step: its history record says so."""
    status = tracker.status
    old = next((r for r in status.history or [] if r.step == event.step), None)
    if old is None:
        return tracker
    record = old.model_copy(update={"state": "rotated", "time": now})
    return dataclasses.replace(
        tracker, status=status.model_copy(update={"history": _record(status.history, record)})
    )


def _failed(tracker: Tracker, event: events.ProgressEvent, *, now: datetime.datetime) -> Tracker:
    """The step failed: a `corrupt` record with the reason; its flight is over."""
    status, step = tracker.status, event.step
    record = jobstatus.CheckpointRecord(
        step=step, state="corrupt", time=now, message=event.message[:1000] or None
    )
    update = {
        "history": _record(status.history, record),
        "in_flight": _without_in_flight(status, step),
    }
    return dataclasses.replace(
        tracker, status=status.model_copy(update=update), ended=_ended(tracker, step)
    )


def _rotated(tracker: Tracker, event: events.ProgressEvent, *, now: datetime.datetime) -> Tracker:
    return _retention_note(tracker, event.message)


_Fold = typing.Callable[..., Tracker]
FOLDS: dict[str, _Fold] = {
    "blocked": _blocked,
    "staged": _stage_done,
    "written": _stage_done,
    "committed": _committed,
    "upload_failed": _upload_failed,
    "rotated": _rotated,
    "uploaded": _uploaded,
    "deleted": _deleted,
    "failed": _failed,
}
"""The fold of each phase; other phases leave the tracker as it is."""


def apply(tracker: Tracker, event: events.ProgressEvent, *, now: datetime.datetime) -> Tracker:
    """Pure: the tracker after `event` (rank 0's events; others are ignored)."""
    fold = FOLDS.get(event.phase)
    if event.rank != 0 or fold is None:
        return tracker
    return fold(tracker, event, now=now)
