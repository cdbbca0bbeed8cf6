"""Save steps that every rank agrees on: time-based saves and preemption (SIGTERM).

Step intervals need no agreement (every rank computes `step % n`). A save
decided by one rank's clock (rank 0, `interval_seconds`) or one rank's
signal (SIGTERM on any rank) must happen at the SAME step on every rank, and
ranks may be any number of steps apart when it is decided (with NCCL the CPU
runs ahead of the GPU; only the collectives keep ranks together).

Protocol, over the coordinator store (never the training process group):

    request   the deciding rank posts `request/<seq>` = {final, rank}
              (compare-and-set: concurrent requests get consecutive numbers)
    report    every rank that sees request <seq> at its next `should_save(s)`
              publishes `request/<seq>/at/<rank>` = {step: s} and goes on
    agree     the agreed step is `max(reported) + 1` (`agreed_step`); a rank
              that reaches its own report + 1 (the earliest step that could
              be agreed) before every report is in waits there, bounded

Why no rank is past the agreed step: a rank reports s and does not run past
s + 1 without knowing the result, which is > every report. Why the wait
ends: the request was posted before the waiting rank reported, and every
other rank reaches a `should_save` after that without needing the waiting
rank to run further (in lockstep training it needs at most the step the
waiting rank already finished). A single rank saves at the step it is at.

The final checkpoint's wait is bounded by the grace period (`final_deadline`).
"""

from __future__ import annotations

import logging
import time
import typing

from cairn.checkpoint import coordinator as coordinator_mod

log = logging.getLogger(__name__)

FINAL_MARGIN_SECONDS = 5.0
"""Least time kept between the final checkpoint's deadline and the end of the
grace period (the process still has to exit before the kubelet's SIGKILL)."""
FINAL_MARGIN_FRACTION = 0.1
"""... or this share of the grace period, whichever is larger."""


def final_deadline(*, signalled_at: float, grace: float | None, timeout: float) -> float:
    """When the final (SIGTERM) checkpoint must be committed: the grace period
    minus a margin, counted from the signal; without a grace, `timeout`. Pure."""
    if grace is None:
        return signalled_at + timeout
    margin = max(FINAL_MARGIN_SECONDS, FINAL_MARGIN_FRACTION * grace)
    return signalled_at + max(0.0, grace - margin)


def agreed_step(current_steps: list[int]) -> int:
    """The step every rank can still save at: one past the furthest rank. Pure.

    Each rank reports the step it just finished and does not pass the next
    one before every report is in, so no rank is past the result. A single
    rank has nobody to wait for: it saves at the step it is at.
    """
    return max(current_steps) + (1 if len(current_steps) > 1 else 0)


class Agreement:
    """One rank's side of the protocol (one per `CheckpointManager`)."""

    def __init__(
        self,
        coordinator: coordinator_mod.Coordinator,
        *,
        timeout: float,
        grace: float | None,
    ) -> None:
        self._coord = coordinator
        self._timeout = timeout
        self._grace = grace
        self._seq = 0
        self._seen: list[tuple[int, bool]] = []
        """Requests (seq, final) seen but not reported yet."""
        self._reported: dict[int, tuple[bool, int]] = {}
        """Requests reported, not agreed yet: seq -> (final, step reported)."""
        self.requested: set[int] = set()
        """Agreed save steps."""
        self.final_step: int | None = None
        """The agreed final (preemption) step, once known."""
        self.signalled_at: float | None = None
        """time.monotonic() of this rank's SIGTERM (or of learning of another's)."""

    def note_signal(self) -> None:
        """This rank got SIGTERM (signal-handler safe: one assignment)."""
        if self.signalled_at is None:
            self.signalled_at = time.monotonic()

    def pending(self) -> bool:
        """A request is seen or reported but not agreed yet."""
        return bool(self._seen or self._reported)

    def poll(self) -> None:
        """Learn the requests posted since the last poll (never blocks)."""
        while (request := self._coord.poll(f"request/{self._seq}")) is not None:
            self._seen.append((self._seq, bool(request.get("final"))))
            self._seq += 1

    def request(self, *, final: bool) -> None:
        """Post a save request; a final one retries until a final request is posted."""
        mine = {"final": final, "rank": self._coord.rank}
        while True:
            self.poll()
            won = self._coord.propose(f"request/{self._seq}", mine)
            self.poll()
            if won == mine or not final or won.get("final"):
                return

    def agree(self, step: int) -> None:
        """Report `step` for every new request; learn each agreed step."""
        for seq, final in self._seen:
            self._coord.publish(f"request/{seq}/at", {"step": step})
            self._reported[seq] = (final, step)
        self._seen.clear()
        for seq, (final, mine) in sorted(self._reported.items()):
            key = f"request/{seq}/at"
            reports = self._reports(key)
            if reports is None and step > mine:
                reports = self._coord.gather(key, timeout=self._wait_bound(final))
            if reports is None:
                continue
            del self._reported[seq]
            target = agreed_step([int(r["step"]) for r in reports])
            self.requested.add(target)
            if final and self.final_step is None:
                self.final_step = target
                log.info("rank %d: final checkpoint agreed at step %d", self._coord.rank, target)

    def deadline(self) -> float:
        """The final checkpoint's deadline (from this rank's signal, or now)."""
        self.note_signal()
        return final_deadline(
            signalled_at=typing.cast(float, self.signalled_at),
            grace=self._grace,
            timeout=self._timeout,
        )

    def _reports(self, key: str) -> list[dict[str, typing.Any]] | None:
        """Every rank's report for `key` if all are in, else None (no wait)."""
        found = [self._coord.poll(f"{key}/{r}") for r in range(self._coord.world_size)]
        if any(report is None for report in found):
            return None
        return [report for report in found if report is not None]

    def _wait_bound(self, final: bool) -> float:
        if not final:
            return self._timeout
        # The agreement is part of the final checkpoint's grace period.
        return max(1.0, self.deadline() - time.monotonic())
