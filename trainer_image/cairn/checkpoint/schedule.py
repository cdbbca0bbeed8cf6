"""The save schedule: which steps are save steps, the same answer on every rank.

Step intervals are decided locally (`step % interval_steps`). Time intervals
(rank 0's clock) and the final checkpoint of a preemption (any rank's
SIGTERM) become a numbered request that every rank agrees on
(`cairn.checkpoint.agreement`). The final request's progress is one value,
`FinalState`:

    none → signalled (SIGTERM noted) → requested (posted) → saved (the
    training loop started the save of the agreed final step)
"""

from __future__ import annotations

import time
import typing

from cairn.checkpoint import agreement as agreement_mod
from cairn.checkpoint import coordinator as coordinator_mod
from cairn.checkpoint import options

FinalState = typing.Literal["none", "signalled", "requested", "saved"]


class SaveSchedule:
    """One rank's save decisions (one per `CheckpointManager`)."""

    def __init__(
        self, *, opts: options.CheckpointOptions, coordinator: coordinator_mod.Coordinator
    ) -> None:
        self._rank = coordinator.rank
        self._interval_steps = opts.interval_steps
        self._interval_seconds = opts.interval_seconds
        self.agreement = agreement_mod.Agreement(
            coordinator, timeout=opts.timeout_seconds, grace=opts.final_grace_seconds
        )
        self.final: FinalState = "none"
        self._last_save = time.monotonic()

    @property
    def final_step(self) -> int | None:
        """The agreed final (preemption) step, once known."""
        return self.agreement.final_step

    def note_signal(self) -> None:
        """SIGTERM: ask for a final checkpoint (signal-handler safe: assignments only)."""
        self.agreement.note_signal()
        if self.final == "none":
            self.final = "signalled"

    def should_save(self, step: int) -> bool:
        """Whether `step` is a save step; every rank gets the same answer.

        A rank that reports a request waits (bounded) at its report + 1
        until every report is in, so none is past the agreed step when it
        learns it (`agreement`).
        """
        agreed = self.agreement
        agreed.poll()
        if self.final == "signalled":
            self.final = "requested"
            agreed.request(final=True)
        if self._interval_due(step):
            agreed.request(final=False)
        agreed.agree(step)
        if step in agreed.requested:
            return True
        return self._interval_steps is not None and step % self._interval_steps == 0

    def _interval_due(self, step: int) -> bool:
        """Rank 0's clock says a time-interval save is due and none is pending.

        An agreed step at or after `step` answers the clock already: with
        several ranks the agreed step is one past the furthest report, so at
        that step the clock still reads "due" (the save starts only after
        this answer) and a second request would save again two steps later.
        """
        agreed = self.agreement
        return (
            self._interval_seconds is not None
            and self._rank == 0
            and time.monotonic() - self._last_save >= self._interval_seconds
            and not any(s >= step for s in agreed.requested)
            and not agreed.pending()
        )

    def started(self, step: int) -> bool:
        """A save of `step` started; True when it is the agreed final step."""
        self._last_save = time.monotonic()
        if step != self.agreement.final_step:
            return False
        self.final = "saved"
        return True

    def deadline(self) -> float:
        """The final checkpoint's deadline (`agreement.final_deadline`)."""
        return self.agreement.deadline()
