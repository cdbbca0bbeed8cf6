"""The status reporter throttles, keeps the latest state, and never loses the last.

Covers: a burst of updates yields at most one patch per interval plus the
final one, and the last body sent is the newest state; close() flushes the
final state; an API that fails keeps the newest state and delivers it once
the API is back; the patch body holds only the writer's fields, camelCased.
The budget (`send_at`, and the reporter with an injected clock): checkpoint
facts go out after the short interval, a step-only or in-flight-only change
waits `status_interval_seconds`, a state equal to the one delivered is never
sent again, close() flushes a step-only change at once; a trainer stepping
every 0.1 s for ten minutes makes at most 2 writes a minute by default.
"""

import datetime
import math
import threading
import time
from typing import Any

from cairn.api import jobstatus
from cairn.checkpoint import status_reporter


class RecordingPatch:
    def __init__(self, *, fail_first: int = 0) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.fail_first = fail_first
        self.lock = threading.Lock()

    def __call__(self, body: dict[str, Any]) -> None:
        with self.lock:
            if self.fail_first > 0:
                self.fail_first -= 1
                raise ConnectionError("apiserver unreachable")
            self.bodies.append(body)


def _checkpoints(step: int) -> jobstatus.CheckpointsStatus:
    return jobstatus.CheckpointsStatus(
        last_committed=jobstatus.CommittedCheckpoint(
            step=step,
            time=datetime.datetime(2026, 11, 22, tzinfo=datetime.UTC),
            bytes=1024,
            write_seconds=0.5,
            stall_seconds=0.01,
        )
    )


def test_burst_is_throttled_and_last_state_wins() -> None:
    patch = RecordingPatch()
    interval = 0.2
    reporter = status_reporter.StatusReporter(patch=patch, min_interval_seconds=interval)
    started = time.monotonic()
    for step in range(1, 201):
        reporter.update(step=step, checkpoints=_checkpoints(step))
        time.sleep(0.005)
    assert reporter.close()
    elapsed = time.monotonic() - started
    assert reporter.stats.updates == 200
    # One patch per started interval, plus the flush at close.
    assert len(patch.bodies) <= math.ceil(elapsed / interval) + 1
    assert len(patch.bodies) < 200
    assert patch.bodies[-1]["status"]["step"] == 200
    assert patch.bodies[-1]["status"]["checkpoints"]["lastCommitted"]["step"] == 200


def test_failures_keep_newest_state_until_delivered() -> None:
    patch = RecordingPatch(fail_first=2)
    reporter = status_reporter.StatusReporter(
        patch=patch, min_interval_seconds=0.05, status_interval_seconds=0.05
    )
    reporter.update(step=1, checkpoints=None)
    reporter.update(step=2, checkpoints=None)
    deadline = time.monotonic() + 20
    while not patch.bodies and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reporter.close()
    assert reporter.stats.patch_failures == 2
    assert patch.bodies[-1] == {"status": {"step": 2}}


def test_body_has_only_writer_fields() -> None:
    body = status_reporter.status_body(step=7, checkpoints=_checkpoints(5))
    assert set(body["status"]) == {"step", "checkpoints"}
    committed = body["status"]["checkpoints"]["lastCommitted"]
    assert committed == {
        "step": 5,
        "time": "2026-11-22T00:00:00Z",
        "bytes": 1024,
        "writeSeconds": 0.5,
        "stallSeconds": 0.01,
    }


def test_body_clears_what_the_writer_no_longer_has() -> None:
    done = jobstatus.CheckpointsStatus(
        last_committed=jobstatus.CommittedCheckpoint(
            step=10, time=datetime.datetime(2026, 11, 22, tzinfo=datetime.UTC)
        ),
        history=[jobstatus.CheckpointRecord(step=10, state="committed")],
    )
    checkpoints = status_reporter.status_body(step=10, checkpoints=done)["status"]["checkpoints"]
    # No save in flight: sent as null so the server drops the last one.
    assert checkpoints["inFlight"] is None
    # A record sent whole: unset fields null (merge patch deletes them) ...
    assert checkpoints["lastCommitted"]["stallSeconds"] is None
    # ... list items without nulls (a list is replaced whole), and records not
    # made yet (lastUploaded) left to stand.
    assert checkpoints["history"] == [{"step": 10, "state": "committed"}]
    assert "lastUploaded" not in checkpoints and "resumedFrom" not in checkpoints


def test_body_clears_an_upload_error_and_a_retention_note_once_over() -> None:
    """Failing uploads and retention over budget end: their nulls are sent, so
    UploadFailing and RetentionOverBudget turn False (a left-out key would stay)."""
    failing = _checkpoints(5).model_copy(
        update={
            "upload_error": jobstatus.UploadError(message="no progress for 30 s", backlog=[5]),
            "retention_over_budget": "local retention over budget (keepLast 2)",
        }
    )
    sent = status_reporter.status_body(step=5, checkpoints=failing)["status"]["checkpoints"]
    assert sent["uploadError"]["backlog"] == [5]
    assert sent["retentionOverBudget"] == "local retention over budget (keepLast 2)"
    over = status_reporter.status_body(step=9, checkpoints=_checkpoints(8))["status"]["checkpoints"]
    assert over["uploadError"] is None and over["retentionOverBudget"] is None


def test_close_retries_the_final_state_after_earlier_failures() -> None:
    """Failures earlier in the run do not use up close()'s retries, and close() cuts a
    long backoff short: the final state still arrives within close()'s timeout."""
    patch = RecordingPatch(fail_first=6)
    reporter = status_reporter.StatusReporter(
        patch=patch, min_interval_seconds=0.05, status_interval_seconds=0.05
    )
    reporter.update(step=1, checkpoints=None)
    deadline = time.monotonic() + 20
    while reporter.stats.patch_failures < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    # Now in a backoff of 0.05·2^4 s or more, with 5 failures behind it.
    reporter.update(step=2, checkpoints=None)
    started = time.monotonic()
    assert reporter.close(timeout_seconds=10)
    assert time.monotonic() - started < 5
    assert patch.bodies[-1] == {"status": {"step": 2}}


# ----------------------------------------------------------------------------- budget


def _body(step: int, checkpoints: jobstatus.CheckpointsStatus | None = None) -> dict[str, Any]:
    return status_reporter.status_body(step=step, checkpoints=checkpoints)


def _in_flight(step: int, stage: jobstatus.InFlightStage) -> jobstatus.CheckpointsStatus:
    flight = jobstatus.InFlightCheckpoint(
        step=step, stage=stage, since=datetime.datetime(2026, 11, 22, tzinfo=datetime.UTC)
    )
    return _checkpoints(5).model_copy(update={"in_flight": [flight]})


def _send_at(
    pending: dict[str, Any], delivered: dict[str, Any] | None, *, closing: bool = False
) -> float | None:
    return status_reporter.send_at(
        pending=pending,
        delivered=delivered,
        last_sent_at=100.0,
        min_interval_seconds=2.0,
        status_interval_seconds=30.0,
        closing=closing,
    )


def test_budget_sends_the_first_state_at_once() -> None:
    due = status_reporter.send_at(
        pending=_body(1),
        delivered=None,
        last_sent_at=-math.inf,
        min_interval_seconds=2.0,
        status_interval_seconds=30.0,
    )
    assert due == -math.inf


def test_budget_step_only_waits_the_status_interval() -> None:
    assert _send_at(_body(2, _checkpoints(5)), _body(1, _checkpoints(5))) == 130.0


def test_budget_in_flight_only_waits_the_status_interval() -> None:
    assert _send_at(_body(7, _in_flight(10, "writing")), _body(7, _in_flight(10, "staging"))) == (
        130.0
    )


def test_budget_new_checkpoint_facts_wait_only_the_short_interval() -> None:
    assert _send_at(_body(10, _checkpoints(10)), _body(9, _checkpoints(5))) == 102.0
    assert _send_at(_body(1, _checkpoints(1)), _body(1)) == 102.0


def test_budget_never_resends_what_was_delivered() -> None:
    assert _send_at(_body(3, _checkpoints(3)), _body(3, _checkpoints(3))) is None
    assert _send_at(_body(3), _body(3), closing=True) is None


def test_budget_close_flushes_a_step_only_change_after_the_short_interval() -> None:
    assert _send_at(_body(4), _body(3), closing=True) == 102.0


def test_budget_default_is_at_most_two_writes_a_minute_for_a_fast_trainer() -> None:
    """Ten simulated minutes of a step every 0.1 s, no checkpoint: the writes per minute."""
    delivered: dict[str, Any] | None = None
    last_sent_at = -math.inf
    writes = 0
    for tick in range(6000):
        now = tick * 0.1
        due = status_reporter.send_at(
            pending=_body(tick + 1),
            delivered=delivered,
            last_sent_at=last_sent_at,
            min_interval_seconds=status_reporter.DEFAULT_MIN_INTERVAL_SECONDS,
            status_interval_seconds=status_reporter.DEFAULT_STATUS_INTERVAL_SECONDS,
        )
        if due is not None and due <= now:
            delivered, last_sent_at, writes = _body(tick + 1), now, writes + 1
    assert writes <= 2 * 10
    assert writes >= 10  # the step still moves on the server


class FakeClock:
    """The reporter's clock, moved by the test only."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _wait_sent(reporter: status_reporter.StatusReporter, count: int) -> None:
    deadline = time.monotonic() + 10
    while reporter.stats.patches_sent < count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert reporter.stats.patches_sent == count


def _reporter(patch: RecordingPatch, clock: FakeClock) -> status_reporter.StatusReporter:
    return status_reporter.StatusReporter(
        patch=patch, min_interval_seconds=2.0, status_interval_seconds=30.0, clock=clock
    )


def test_reporter_holds_step_only_updates_until_close() -> None:
    patch, clock = RecordingPatch(), FakeClock()
    reporter = _reporter(patch, clock)
    reporter.update(step=1, checkpoints=None)
    _wait_sent(reporter, 1)
    clock.now = 29.0
    for step in range(2, 101):
        reporter.update(step=step, checkpoints=None)
    clock.now = 29.5
    assert reporter.close(timeout_seconds=10)
    assert [b["status"]["step"] for b in patch.bodies] == [1, 100]


def test_reporter_sends_a_step_only_update_after_the_status_interval() -> None:
    patch, clock = RecordingPatch(), FakeClock()
    reporter = _reporter(patch, clock)
    reporter.update(step=1, checkpoints=None)
    _wait_sent(reporter, 1)
    clock.now = 30.0
    reporter.update(step=2, checkpoints=None)
    _wait_sent(reporter, 2)
    assert reporter.close(timeout_seconds=10)
    assert [b["status"]["step"] for b in patch.bodies] == [1, 2]


def test_reporter_sends_checkpoint_facts_without_waiting_for_the_step_interval() -> None:
    patch, clock = RecordingPatch(), FakeClock()
    reporter = _reporter(patch, clock)
    reporter.update(step=1, checkpoints=None)
    _wait_sent(reporter, 1)
    clock.now = 5.0
    reporter.update(step=5, checkpoints=_checkpoints(5))
    _wait_sent(reporter, 2)
    for step in range(6, 20):
        reporter.update(step=step, checkpoints=_checkpoints(5))
    clock.now = 10.0
    assert reporter.close(timeout_seconds=10)
    assert [b["status"]["step"] for b in patch.bodies] == [1, 5, 19]
    assert patch.bodies[1]["status"]["checkpoints"]["lastCommitted"]["step"] == 5


def test_reporter_does_not_resend_an_unchanged_state() -> None:
    patch, clock = RecordingPatch(), FakeClock()
    reporter = _reporter(patch, clock)
    reporter.update(step=3, checkpoints=_checkpoints(3))
    _wait_sent(reporter, 1)
    clock.now = 100.0
    reporter.update(step=3, checkpoints=_checkpoints(3))
    assert reporter.close(timeout_seconds=10)
    assert reporter.stats.updates == 2
    assert len(patch.bodies) == 1
