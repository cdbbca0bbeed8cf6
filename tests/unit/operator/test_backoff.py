"""``core.backoff``: the retry delay of a failed reconcile or cleanup.

Covers: the delay doubles per failure from the base; jitter keeps every draw
within ``[d * (1 - jitter), d]`` and two draws differ (no lockstep); the
delay never passes the cap, even after a huge failure count; Retry-After is a
floor (never shorter than the server asked), stretched by the jitter, and
capped at ``retry_after_cap_seconds``; a Retry-After shorter than the backoff
changes nothing; bad arguments and a bad policy are refused naming the field;
``parse_retry_after`` reads delay-seconds and an HTTP-date, and reads absent,
empty, negative, zero, past, non-ASCII-digit, huge and garbage values as "no
advice" (None) instead of failing.
"""

import datetime

import pytest

from cairn.operator.core import backoff

POLICY = backoff.Policy(
    base_seconds=2.0, cap_seconds=60.0, jitter=0.5, retry_after_cap_seconds=30.0
)
NOW = datetime.datetime(2026, 11, 27, 10, 0, 0, tzinfo=datetime.UTC)


def test_delay_doubles_per_failure_without_jitter_draw() -> None:
    waits = [backoff.delay(POLICY, failures=n, draw=0.0) for n in range(1, 6)]
    assert waits == [2.0, 4.0, 8.0, 16.0, 32.0]


@pytest.mark.parametrize("failures", [1, 2, 3, 6, 10])
@pytest.mark.parametrize("draw", [0.0, 0.25, 0.5, 0.999999])
def test_jitter_stays_within_its_bounds(failures: int, draw: float) -> None:
    full = min(POLICY.cap_seconds, POLICY.base_seconds * 2 ** (failures - 1))
    wait = backoff.delay(POLICY, failures=failures, draw=draw)
    assert full * (1 - POLICY.jitter) <= wait <= full


def test_two_draws_give_two_delays() -> None:
    assert backoff.delay(POLICY, failures=3, draw=0.1) != backoff.delay(
        POLICY, failures=3, draw=0.7
    )


@pytest.mark.parametrize("failures", [6, 7, 100, 5000])
def test_delay_never_passes_the_cap(failures: int) -> None:
    assert backoff.delay(POLICY, failures=failures, draw=0.0) == POLICY.cap_seconds


def test_retry_after_is_a_floor_stretched_by_jitter() -> None:
    assert backoff.delay(POLICY, failures=1, draw=0.0, retry_after=10.0) == 10.0
    stretched = backoff.delay(POLICY, failures=1, draw=0.5, retry_after=10.0)
    assert stretched == pytest.approx(12.5)


def test_retry_after_is_capped() -> None:
    wait = backoff.delay(POLICY, failures=1, draw=0.0, retry_after=86400.0)
    assert wait == POLICY.retry_after_cap_seconds


def test_retry_after_shorter_than_backoff_changes_nothing() -> None:
    alone = backoff.delay(POLICY, failures=4, draw=0.3)
    assert backoff.delay(POLICY, failures=4, draw=0.3, retry_after=1.0) == alone


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"failures": 0, "draw": 0.0}, "failures"),
        ({"failures": 1, "draw": 1.0}, "draw"),
        ({"failures": 1, "draw": -0.1}, "draw"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        backoff.delay(POLICY, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"base_seconds": 0.0, "cap_seconds": 1.0}, "base_seconds"),
        ({"base_seconds": 2.0, "cap_seconds": 1.0}, "cap_seconds"),
        ({"base_seconds": 1.0, "cap_seconds": 2.0, "jitter": 1.5}, "jitter"),
        ({"base_seconds": 1.0, "cap_seconds": 2.0, "retry_after_cap_seconds": 0.0}, "retry_after"),
    ],
)
def test_bad_policy_is_refused_naming_the_field(fields: dict[str, float], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        backoff.Policy(**fields)


@pytest.mark.parametrize(
    ("header", "seconds"),
    [
        ("1", 1.0),
        (" 7 ", 7.0),
        ("Fri, 27 Nov 2026 10:00:30 GMT", 30.0),
    ],
)
def test_parse_retry_after_reads_seconds_and_http_dates(header: str, seconds: float) -> None:
    assert backoff.parse_retry_after(header, now=NOW) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        "   ",
        "0",
        "-5",
        "1.5",
        "²",
        "soon",
        "Fri, 27 Nov 2026 09:59:00 GMT",
        "Fri, 99 Zzz",
    ],
)
def test_parse_retry_after_reads_odd_values_as_no_advice(header: str | None) -> None:
    assert backoff.parse_retry_after(header, now=NOW) is None


def test_parse_retry_after_huge_value_is_bounded_then_capped_by_delay() -> None:
    parsed = backoff.parse_retry_after("9" * 400, now=NOW)
    assert parsed is not None and parsed < 1e13
    assert backoff.delay(POLICY, failures=1, draw=0.0, retry_after=parsed) == 30.0
