"""The writer's `status.checkpoints.uploadError` (pure fold of backlog events).

Covers: a failed upload round sets the error with its backlog and ends the
step's flight; rotation's over-budget note is attached (and reported on its
own, `retentionOverBudget`, while uploads only lag); a backlog step
uploaded late does not move `lastUploaded` back; the error clears when the
last backlog step is uploaded.
"""

from __future__ import annotations

import datetime

from cairn.checkpoint import checkpoint_status, events, upload_backlog

NOW = datetime.datetime(2026, 11, 23, 12, 0, tzinfo=datetime.UTC)


def ev(phase: events.Phase, step: int, message: str = "") -> events.ProgressEvent:
    return events.ProgressEvent(phase=phase, step=step, rank=0, message=message)


def fold(*evs: events.ProgressEvent) -> checkpoint_status.Tracker:
    tracker = checkpoint_status.Tracker(upload_uri="s3://bkt/p")
    for event in evs:
        tracker = checkpoint_status.apply(tracker, event, now=NOW)
    return tracker


FAILED = upload_backlog._failure_message("RemoteError: connection reset", [4, 6])


def test_failed_round_sets_the_error_and_ends_the_flight() -> None:
    tracker = fold(
        ev("uploaded", 2), ev("committed", 4), ev("committed", 6), ev("upload_failed", 6, FAILED)
    )
    error = tracker.status.upload_error
    assert error is not None
    assert (error.step, error.backlog, error.message) == (
        6,
        [4, 6],
        "RemoteError: connection reset",
    )
    assert error.time == NOW
    assert not any(f.step == 6 for f in tracker.status.in_flight or [])


def test_over_budget_note_is_attached_and_removed() -> None:
    note = "local retention over budget (keepLast 2): keeping steps [2, 4]"
    tracker = fold(ev("upload_failed", 6, FAILED), ev("rotated", 6, note))
    assert tracker.status.upload_error is not None
    assert tracker.status.upload_error.retention == note
    tracker = checkpoint_status.apply(tracker, ev("rotated", 8), now=NOW)
    assert tracker.status.upload_error is not None
    assert tracker.status.upload_error.retention is None


def test_late_uploads_clear_the_error_and_keep_the_newest_last_uploaded() -> None:
    tracker = fold(ev("uploaded", 2), ev("upload_failed", 6, FAILED), ev("uploaded", 8))
    assert tracker.status.last_uploaded is not None and tracker.status.last_uploaded.step == 8
    tracker = checkpoint_status.apply(tracker, ev("uploaded", 4), now=NOW)
    last = tracker.status.last_uploaded
    assert last is not None and last.step == 8  # a late backlog step is older
    assert tracker.status.upload_error is not None
    assert tracker.status.upload_error.backlog == [6]
    tracker = checkpoint_status.apply(tracker, ev("uploaded", 6), now=NOW)
    assert tracker.status.upload_error is None


def test_rotation_within_budget_changes_nothing() -> None:
    tracker = fold(ev("uploaded", 2))
    assert checkpoint_status.apply(tracker, ev("rotated", 2), now=NOW) == tracker


def test_over_budget_without_an_error_is_reported_on_its_own() -> None:
    """A slow store fails nothing, yet the backlog holds steps past keepLast:
    `retentionOverBudget` says so (the operator's RetentionOverBudget condition)."""
    note = "local retention over budget (keepLast 2): keeping steps [2, 4]"
    tracker = fold(ev("uploaded", 2), ev("rotated", 6, note))
    assert tracker.status.upload_error is None
    assert tracker.status.retention_over_budget == note
    tracker = checkpoint_status.apply(tracker, ev("rotated", 8), now=NOW)
    assert tracker.status.retention_over_budget is None
