"""Time in the operator: the clock it injects and the one way it writes a time.

``Clock`` is what decision code receives instead of reading the time itself
(``reconcile.clock`` is the real one; tests pass their own), so time-based
logic is testable. ``rfc3339`` is the single format of every time the
operator writes to the API: status fields, condition transitions, Events.
Pure.
"""

import datetime
from collections.abc import Callable

Clock = Callable[[], datetime.datetime]


def rfc3339(value: datetime.datetime) -> str:
    """``2026-11-23T12:00:00Z``: UTC, whole seconds, as Kubernetes writes times."""
    return value.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def rfc3339_or_none(value: datetime.datetime | None) -> str | None:
    return None if value is None else rfc3339(value)
