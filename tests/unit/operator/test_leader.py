"""Leader election decisions (pure) and the timing rules.

Covers: no Lease: create; ours: renew; another holder: wait until its record
stayed unchanged for the lease duration (by the standby's own clock), then
acquire; an empty holder (released on shutdown): acquire at once; settings
refuse retry >= renew deadline >= lease duration. The election against the
API server (two processes, SIGKILL, takeover time) is in
tests/integration/operator/test_leader_election.py.
"""

import pytest

from cairn.operator import leader


def record(holder: str) -> leader.Record:
    return leader.Record(
        holder=holder, renew_time="2026-11-23T10:00:00.000000Z", resource_version="7"
    )


@pytest.mark.parametrize(
    ("found", "unchanged_for", "action"),
    [
        (None, 0.0, "create"),
        (record("me"), 0.0, "renew"),
        (record("me"), 99.0, "renew"),
        (record("other"), 14.9, "wait"),
        (record("other"), 15.0, "acquire"),
        (record(""), 0.0, "acquire"),
    ],
    ids=["absent", "ours", "ours-stale", "other-fresh", "other-expired", "released"],
)
def test_decide(found: leader.Record | None, unchanged_for: float, action: str) -> None:
    got = leader.decide(record=found, identity="me", unchanged_for=unchanged_for, lease_duration=15)
    assert got == action


@pytest.mark.parametrize(
    ("duration", "deadline", "retry"),
    [(15, 15, 2), (15, 10, 10), (10, 15, 2), (15, 10, 0)],
    ids=["deadline-not-below-duration", "retry-not-below-deadline", "inverted", "zero-retry"],
)
def test_settings_refuse_unsafe_timing(duration: float, deadline: float, retry: float) -> None:
    with pytest.raises(ValueError, match="retry_period < renew_deadline < lease_duration"):
        leader.Settings(lease_duration=duration, renew_deadline=deadline, retry_period=retry)
