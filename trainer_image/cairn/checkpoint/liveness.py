"""Which peers are presumed dead: a heartbeat counter that stopped moving. Pure.

A rank waiting in a coordinator gather for a peer that was SIGKILLed waits
for the whole bound (the final checkpoint's: the grace period less a margin,
54 s of a 60 s grace), then gives up with "no report". Each rank's manager
beats a counter in the store from its own thread
(`StoreCoordinator.start_heartbeat`),
whatever the training thread is doing; a waiter that sees a missing rank's
counter stay put for `PRESUMED_DEAD_SECONDS` gives up early, naming it.

Only a counter seen here counts: a rank whose beat was never observed (not
started yet, or a store without heartbeats) is never presumed dead, so the
wait's own bound still applies to it. The counter's key carries the worker
group, so a dead group's last value is never read as a live peer's.
"""

from __future__ import annotations

import dataclasses

HEARTBEAT_SECONDS = 1.0
"""How often each rank's heartbeat thread moves its counter."""
PRESUMED_DEAD_SECONDS = 15.0
"""A counter that has not moved for this long belongs to a dead (or frozen)
process: 15 missed beats, far beyond a thread's scheduling delay on a busy
node, and well inside the 54 s a final checkpoint would otherwise wait."""


@dataclasses.dataclass
class PeerWatch:
    """The last counter value seen per rank and when it was first seen (monotonic)."""

    dead_after: float = PRESUMED_DEAD_SECONDS
    _seen: dict[int, tuple[str, float]] = dataclasses.field(default_factory=dict)

    def observe(self, rank: int, beat: str | None, now: float) -> None:
        """Record `rank`'s counter as read at `now` (None: no counter posted)."""
        if beat is None:
            return
        last = self._seen.get(rank)
        if last is None or last[0] != beat:
            self._seen[rank] = (beat, now)

    def silent_for(self, rank: int, now: float) -> float | None:
        """Seconds `rank`'s counter has been seen not to move; None if never seen."""
        last = self._seen.get(rank)
        return None if last is None else now - last[1]

    def presumed_dead(self, ranks: list[int], now: float) -> list[int]:
        """The ranks among `ranks` whose counter has not moved for `dead_after`."""
        return [r for r in ranks if (self.silent_for(r, now) or 0.0) >= self.dead_after]
