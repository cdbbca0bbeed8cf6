"""The status reporter throttles, keeps the latest state, and never loses the last.

Covers: a burst of updates yields at most one patch per interval plus the
final one, and the last body sent is the newest state; close() flushes the
final state; an API that fails keeps the newest state and delivers it once
the API is back; the patch body holds only the writer's fields, camelCased.
"""

import datetime
import math
import threading
import time
from typing import Any

from cairn.api import jobstatus
from cairn.trainer import status_reporter


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
    reporter = status_reporter.StatusReporter(patch=patch, min_interval_seconds=0.05)
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


def test_close_retries_the_final_state_after_earlier_failures() -> None:
    """Failures earlier in the run do not use up close()'s retries, and close() cuts a
    long backoff short: the final state still arrives within close()'s timeout."""
    patch = RecordingPatch(fail_first=6)
    reporter = status_reporter.StatusReporter(patch=patch, min_interval_seconds=0.05)
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
