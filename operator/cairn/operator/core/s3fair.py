"""Which due S3 passes start now: one tenant's slow store never takes every S3 thread.

Pure. ``s3loop`` asks ``take`` each time it has free threads. Every job's
pass goes to its store's endpoint (``spec.checkpoint.upload.endpoint``, ""
for the default AWS one); each endpoint has a health (``Health``):

- ``healthy``: its last pass ended within ``slow_after_seconds`` and none of
  its passes runs longer now: it gets the free threads, but never every
  thread (a store that hangs after answering holds all but one until its
  passes show slow, and then no more);
- ``unproven`` (no pass ended yet) or ``slow`` (a pass ran, or runs now,
  ``slow_after_seconds`` or longer): one pass at a time, and all such
  endpoints together at most ``slow_slots`` of the threads, so the rest
  always serve healthy endpoints.

So a tenant naming a store that accepts connections and never answers holds
one thread (per such endpoint, up to ``slow_slots``), and 200 other jobs keep
their verification latency. Due passes that are held back keep their place
(``s3loop`` leaves them due). A store shared by every job starts unproven:
its first pass runs alone, then it is healthy (it costs one pass's time once).

A slow pass is the store's fault only if the store answered no other pass
meanwhile (``answered``: when a quick pass on it last ended). A tenant whose
own prefix makes its pass slow (100,000 objects listed up to the cap, on the
store every job shares) does not mark that store slow: ``store_is_slow``
charges it to the job, and ``s3loop`` gives such a job a unit of its own
(``job_unit``) that is slow, so it runs in the slow slots. Before this, such
a pass running ``slow_after`` made the shared store slow and, while it ran,
no other job's pass on it started at all.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Hashable, Mapping, Sequence
from typing import Literal, TypeVar

Health = Literal["healthy", "unproven", "slow"]
_K = TypeVar("_K", bound=Hashable)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Running:
    """A pass in flight: its endpoint and when it started (monotonic seconds)."""

    endpoint: str
    started: float


def slow_slots(threads: int, share: float) -> int:
    """Threads slow and unproven endpoints may hold together: at least one, and
    one fewer than all when there are two or more. Pure."""
    if threads <= 1:
        return 1
    return max(1, min(threads - 1, math.floor(threads * share)))


def job_unit(endpoint: str, job: str) -> str:
    """The fairness unit of a job whose own passes are slow (not its store's). Pure."""
    return f"{endpoint} job:{job}"


def store_is_slow(
    *, started: float, took: float, answered: Mapping[str, float], endpoint: str, slow_after: float
) -> bool:
    """Whether a pass that took ``took`` seconds shows its store slow: it was slow and
    no quick pass on the same store ended while it ran. Pure."""
    return took >= slow_after and answered.get(endpoint, -math.inf) <= started


def health(
    endpoint: str,
    *,
    ended: Mapping[str, float],
    running: Sequence[Running],
    now: float,
    slow_after: float,
    answered: Mapping[str, float] | None = None,
) -> Health:
    """The endpoint's health. ``ended``: how long its last finished pass took;
    ``answered``: when a quick pass on it last ended (a long pass that started
    before that is its job's, not the store's). Pure."""
    quick_end = (answered or {}).get(endpoint, -math.inf)
    if any(
        r.endpoint == endpoint and now - r.started >= slow_after and quick_end <= r.started
        for r in running
    ):
        return "slow"
    if endpoint not in ended:
        return "unproven"
    return "slow" if ended[endpoint] >= slow_after else "healthy"


def take(
    due: Sequence[tuple[_K, str]],
    *,
    ended: Mapping[str, float],
    running: Sequence[Running],
    now: float,
    threads: int,
    share: float,
    slow_after: float,
    answered: Mapping[str, float] | None = None,
) -> list[_K]:
    """The ids of ``due`` (id, endpoint), in order, that start now. Pure.

    ``running``: the passes in flight (they hold threads). A held-back pass
    is skipped, not a barrier: a healthy job behind it still starts.
    """
    free = threads - len(running)
    limited = slow_slots(threads, share)
    judge = functools.partial(
        health, ended=ended, running=running, now=now, slow_after=slow_after, answered=answered
    )
    states = {endpoint: judge(endpoint) for _, endpoint in due}
    busy: dict[str, int] = {}
    held_now = 0  # threads slow and unproven endpoints hold now
    for r in running:
        busy[r.endpoint] = busy.get(r.endpoint, 0) + 1
        held_now += judge(r.endpoint) != "healthy"
    taken: list[_K] = []
    for ident, endpoint in due:
        if len(taken) >= free:
            break
        if states[endpoint] != "healthy":
            if busy.get(endpoint, 0) > 0 or held_now >= limited:
                continue
            held_now += 1
        elif busy.get(endpoint, 0) >= max(1, threads - 1):
            continue
        busy[endpoint] = busy.get(endpoint, 0) + 1
        taken.append(ident)
    return taken
