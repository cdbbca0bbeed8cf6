"""Rank 0's fold of checkpoint events into `status.checkpoints`.

Covers: a step in flight moves staging → writing → committing → uploading
and leaves the list when uploaded (or when committed without S3); the commit
carries the stall the training loop measured; upload records the step's
URI; rotation marks history `rotated`; a failure records `corrupt`; other
ranks' events change nothing; a new attempt goes on from the previous
attempt's records without its in-flight saves.
"""

import datetime

from cairn.api import jobstatus
from cairn.checkpoint import checkpoint_status, events

T = datetime.datetime(2026, 11, 23, tzinfo=datetime.UTC)
URI = "s3://bucket/job"


def _fold(
    tracker: checkpoint_status.Tracker, *steps: tuple[str, int], rank: int = 0, **kw: float
) -> checkpoint_status.Tracker:
    for phase, step in steps:
        event = events.ProgressEvent(
            phase=phase,  # type: ignore[arg-type]
            step=step,
            rank=rank,
            seconds=kw.get("seconds", 0.25),
            bytes=int(kw.get("bytes", 4096)),
        )
        tracker = checkpoint_status.apply(tracker, event, now=T)
    return tracker


def _stages(tracker: checkpoint_status.Tracker) -> list[tuple[int, str]]:
    return [(f.step, f.stage) for f in tracker.status.in_flight or []]


def test_a_step_moves_through_its_stages_and_leaves_when_uploaded() -> None:
    tracker = checkpoint_status.Tracker(upload_uri=URI)
    tracker = _fold(tracker, ("blocked", 5), seconds=0.01)
    assert _stages(tracker) == [(5, "staging")]
    tracker = _fold(tracker, ("staged", 5))
    assert _stages(tracker) == [(5, "writing")]
    tracker = _fold(tracker, ("written", 5))
    assert _stages(tracker) == [(5, "committing")]
    tracker = _fold(tracker, ("committed", 5), seconds=0.5)
    assert _stages(tracker) == [(5, "uploading")]
    committed = tracker.status.last_committed
    assert committed is not None
    assert (committed.step, committed.stall_seconds, committed.write_seconds) == (5, 0.01, 0.5)
    tracker = _fold(tracker, ("uploaded", 5))
    assert tracker.status.in_flight is None
    uploaded = tracker.status.last_uploaded
    assert uploaded is not None
    assert (uploaded.step, uploaded.uri, uploaded.verified) == (5, f"{URI}/step-000000005/", False)
    assert [(r.step, r.state) for r in tracker.status.history or []] == [(5, "uploaded")]


def test_a_late_blocked_event_neither_revives_nor_loses_anything() -> None:
    """The training thread reports `blocked` after submitting the save; the
    writer thread may have staged, committed and even uploaded it by then."""
    tracker = _fold(checkpoint_status.Tracker(upload_uri=URI), ("staged", 5), ("written", 5))
    assert _stages(tracker) == [(5, "committing")]
    tracker = _fold(tracker, ("blocked", 5), seconds=0.02)
    assert _stages(tracker) == [(5, "committing")]  # not back to staging
    tracker = _fold(checkpoint_status.Tracker(upload_uri=URI), ("committed", 5), ("uploaded", 5))
    tracker = _fold(tracker, ("blocked", 5), seconds=0.02)
    assert tracker.status.in_flight is None  # over, not revived
    committed = tracker.status.last_committed
    assert committed is not None and committed.stall_seconds == 0.02  # stall still recorded


def test_without_upload_a_commit_ends_the_flight() -> None:
    tracker = _fold(checkpoint_status.Tracker(), ("blocked", 5), ("committed", 5))
    assert tracker.status.in_flight is None
    assert tracker.status.last_uploaded is None


def test_rotation_and_failure_show_in_history() -> None:
    tracker = _fold(
        checkpoint_status.Tracker(),
        ("blocked", 5),
        ("committed", 5),
        ("blocked", 10),
        ("committed", 10),
        ("deleted", 5),
        ("blocked", 15),
        ("failed", 15),
    )
    assert [(r.step, r.state) for r in tracker.status.history or []] == [
        (15, "corrupt"),
        (10, "committed"),
        (5, "rotated"),
    ]
    assert tracker.status.in_flight is None


def test_other_ranks_change_nothing() -> None:
    before = checkpoint_status.Tracker(upload_uri=URI)
    assert _fold(before, ("blocked", 5), ("committed", 5), rank=1) == before


def test_a_new_attempt_goes_on_from_the_previous_records() -> None:
    previous = _fold(
        checkpoint_status.Tracker(upload_uri=URI),
        ("blocked", 5),
        ("committed", 5),
        ("uploaded", 5),
        ("blocked", 10),
    ).status.model_copy(update={"resumed_from": jobstatus.ResumedFrom(step=0, attempt=1)})
    tracker = checkpoint_status.continued(previous, upload_uri=URI)
    assert tracker.status.in_flight is None  # died with the previous attempt
    assert tracker.status.resumed_from is None  # the new attempt sets its own
    assert tracker.status.last_uploaded == previous.last_uploaded
    assert tracker.status.history == previous.history
    assert checkpoint_status.continued(None, upload_uri=URI) == checkpoint_status.Tracker(
        upload_uri=URI
    )


def test_the_step_resumed_from_is_in_history() -> None:
    """The previous attempt may have died before reporting the step it committed."""
    before = _fold(checkpoint_status.Tracker(upload_uri=URI), ("committed", 5), ("uploaded", 5))
    tracker = checkpoint_status.resumed(
        before, jobstatus.ResumedFrom(step=10, attempt=2, source="remote")
    )
    assert tracker.status.resumed_from == jobstatus.ResumedFrom(step=10, attempt=2, source="remote")
    assert [(r.step, r.state) for r in tracker.status.history or []] == [
        (10, "uploaded"),
        (5, "uploaded"),
    ]
    again = checkpoint_status.resumed(before, jobstatus.ResumedFrom(step=5, source="local"))
    assert again.status.history == before.status.history  # already recorded: kept as is


def test_an_imported_checkpoint_is_reported_but_not_in_history() -> None:
    """A checkpoint this job did not write (resume.uri, plain DCP) is not one of its steps."""
    before = _fold(checkpoint_status.Tracker(upload_uri=URI), ("committed", 5))
    imported = jobstatus.ResumedFrom(
        step=7, source="remote", uri="s3://b/titan/step-7", imported=True
    )
    tracker = checkpoint_status.resumed(before, imported)
    assert tracker.status.resumed_from == imported
    assert tracker.status.history == before.status.history
