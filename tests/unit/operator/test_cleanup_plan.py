"""``core.cleanup``: what a failed ``onDelete: Delete`` attempt decides.

Covers: attempts before the last retry after a doubling delay within the
jitter bounds, never past the cap, with ``CleanupFailed``/``CleanupRetrying``
naming the prefix, what failed, the attempt and the limit; the last attempt
gives up (no delay) with ``CleanupAttemptsExhausted`` saying the objects stay
and the finalizer goes; a cap below the base delay is refused naming the
field; ``with_condition`` keeps every other condition as stored, replaces an
older ``CleanupFailed`` (keeping its transition time while it stays True),
and reads a missing or malformed stored list as empty.
"""

import datetime

import pytest

from cairn.api import jobstatus
from cairn.operator.core import cleanup, conditions, tunables

URI = "s3://bucket/runs/a"
FAILURE = "reading Secret ml/creds failed: 404 Not Found"
SETTINGS = tunables.StorageLoop(
    cleanup_attempts=5, cleanup_backoff_seconds=2.0, cleanup_backoff_cap_seconds=6.0
)
NOW = datetime.datetime(2026, 11, 27, 10, 0, tzinfo=datetime.UTC)


def _after(attempt: int, draw: float = 0.0) -> cleanup.Verdict:
    return cleanup.after_failure(
        attempt=attempt, uri=URI, failure=FAILURE, settings=SETTINGS, draw=draw
    )


@pytest.mark.parametrize(("attempt", "full"), [(1, 2.0), (2, 4.0), (3, 6.0), (4, 6.0)])
@pytest.mark.parametrize("draw", [0.0, 0.5, 0.99])
def test_attempts_before_the_last_retry_within_jitter_and_cap(
    attempt: int, full: float, draw: float
) -> None:
    verdict = _after(attempt, draw)
    assert verdict.delay is not None and full * 0.5 <= verdict.delay <= full
    assert verdict.condition.type == conditions.CLEANUP_FAILED and verdict.condition.status
    assert verdict.condition.reason == conditions.REASON_CLEANUP_RETRYING
    message = verdict.condition.message
    assert URI in message and FAILURE in message and f"attempt {attempt} of 5" in message


def test_the_last_attempt_gives_up_and_says_what_stays() -> None:
    verdict = _after(5)
    assert verdict.delay is None
    assert verdict.condition.reason == conditions.REASON_CLEANUP_EXHAUSTED
    assert verdict.condition.message.startswith(f"{URI} not emptied after 5 attempts: {FAILURE}")
    assert "left in place" in verdict.condition.message


def test_an_attempt_past_the_limit_also_gives_up() -> None:
    assert _after(9).delay is None


def test_cap_below_base_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="cleanup_backoff_cap_seconds"):
        tunables.StorageLoop(cleanup_backoff_seconds=10.0, cleanup_backoff_cap_seconds=5.0)


def _stored(kind: str, status: str, reason: str, when: str) -> dict[str, object]:
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": "",
        "lastTransitionTime": when,
        "observedGeneration": 1,
    }


def test_with_condition_keeps_the_others_and_replaces_its_own() -> None:
    ready = _stored("Ready", "False", "Suspended", "2026-11-27T09:00:00Z")
    older = _stored(conditions.CLEANUP_FAILED, "True", "CleanupRetrying", "2026-11-27T09:30:00Z")
    parsed = [jobstatus.Condition.model_validate(c) for c in (ready, older)]
    listed = cleanup.with_condition(
        raw=[ready, older], parsed=parsed, desired=_after(2).condition, generation=3, now=NOW
    )
    assert listed[0] == ready
    (mine,) = [c for c in listed if c["type"] == conditions.CLEANUP_FAILED]
    assert mine["reason"] == conditions.REASON_CLEANUP_RETRYING
    assert mine["lastTransitionTime"] == "2026-11-27T09:30:00Z"  # still True: not a transition
    assert mine["observedGeneration"] == 3 and len(listed) == 2


@pytest.mark.parametrize("raw", [None, "junk", [1, "x", None]])
def test_with_condition_reads_a_malformed_list_as_empty(raw: object) -> None:
    listed = cleanup.with_condition(
        raw=raw, parsed=None, desired=_after(5).condition, generation=1, now=NOW
    )
    assert [c["type"] for c in listed] == [conditions.CLEANUP_FAILED]
    assert listed[0]["lastTransitionTime"] == "2026-11-27T10:00:00Z"
