"""How long to wait before retrying a failed call: jittered exponential backoff. Pure.

Used where many loops may fail at the same moment (every job's reconcile
daemon when the API server is unreachable or throttles the operator with
429/503; ``onDelete`` cleanups of a namespace's jobs): each loop draws its
own delay, so they do not all come back at once (a lockstep retry is a second
outage). A server's ``Retry-After`` is honoured as a floor, itself capped, so
a hostile or broken header cannot park a loop for hours. The random draw
comes in as an argument (``draw`` in [0, 1)), so every decision is testable;
the IO edge passes ``random.random()``.
"""

import dataclasses
import datetime
import email.utils
import math


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Policy:
    """One retry schedule. The n-th consecutive failure waits about
    ``base_seconds * 2**(n-1)``, at most ``cap_seconds``, less a random part."""

    base_seconds: float
    """Delay after the first failure (before jitter)."""
    cap_seconds: float
    """No exponential delay grows past this."""
    jitter: float = 0.5
    """Fraction of the delay drawn at random: the delay lies in
    ``[d * (1 - jitter), d]``; a Retry-After floor is stretched by up to this."""
    retry_after_cap_seconds: float = 120.0
    """A server's Retry-After above this is read as this."""

    def __post_init__(self) -> None:
        for name in ("base_seconds", "cap_seconds", "retry_after_cap_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Policy.{name} must be > 0")
        if self.cap_seconds < self.base_seconds:
            raise ValueError("Policy.cap_seconds must be >= base_seconds")
        if not 0 <= self.jitter <= 1:
            raise ValueError("Policy.jitter must be in [0, 1]")


def delay(policy: Policy, *, failures: int, draw: float, retry_after: float | None = None) -> float:
    """Seconds to wait after ``failures`` consecutive failures (>= 1). Pure.

    ``draw`` in [0, 1) picks the jitter; ``retry_after`` (seconds, from
    ``parse_retry_after``) is a floor: the wait is never shorter than what the
    server asked (capped at ``policy.retry_after_cap_seconds``), and is spread
    over up to ``jitter`` more so throttled loops do not return together.
    """
    if failures < 1:
        raise ValueError("failures must be >= 1")
    if not 0 <= draw < 1:
        raise ValueError("draw must be in [0, 1)")
    # 2**1024 overflows a float: the cap is reached long before.
    exponent = min(failures - 1, 64)
    grown = min(policy.cap_seconds, policy.base_seconds * 2.0**exponent)
    wait = grown * (1 - policy.jitter * draw)
    if retry_after is not None and retry_after > 0:
        floor = min(retry_after, policy.retry_after_cap_seconds)
        wait = max(wait, floor * (1 + policy.jitter * draw))
    return wait


def parse_retry_after(value: str | None, *, now: datetime.datetime) -> float | None:
    """A ``Retry-After`` header (RFC 9110: delay-seconds or an HTTP-date) as seconds
    from ``now``; None when absent, unreadable, negative or already past. Pure.

    The header comes from whoever answers (a proxy, a throttling API server):
    untrusted, so anything odd means "no advice" rather than an error.
    """
    if value is None:
        return None
    text = value.strip()
    if not text:
        return None
    if text.isascii() and text.isdigit():
        seconds = float(int(text[:12]))  # 12 digits: far past any cap, never a huge int
        return seconds if seconds > 0 else None
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    seconds = (when - now).total_seconds()
    return seconds if math.isfinite(seconds) and seconds > 0 else None
