"""The save schedule's time interval with several ranks: one save per interval.

Covers `schedule.SaveSchedule` with an agreement that behaves as the real
one does for two ranks (a request posted at step N is agreed at N + 1, one
past the furthest report) and a clock the test moves: rank 0 saves once per
`interval_seconds`, never twice in a row (the agreed step used to find the
clock still "due" and post a second request, saving again two steps later:
seen on the devcluster as saves at 10, 12, 25, 27, ...).
"""

from __future__ import annotations

import itertools
import pathlib
from typing import Any

import pytest

from cairn.checkpoint import options, schedule

STEP_SECONDS = 0.2
INTERVAL_SECONDS = 3.0


class _TwoRankAgreement:
    """The real protocol's outcome for two ranks, without a store."""

    def __init__(self, *_: Any, **__: Any) -> None:
        self.requested: set[int] = set()
        self.final_step: int | None = None
        self._seen = 0

    def poll(self) -> None:
        pass

    def pending(self) -> bool:
        return self._seen > 0

    def request(self, *, final: bool) -> None:
        self._seen += 1

    def agree(self, step: int) -> None:
        if self._seen:
            self.requested.add(step + 1)  # agreed_step([step, step]) with two ranks
            self._seen = 0


class _Coordinator:
    rank = 0


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr("cairn.checkpoint.schedule.time.monotonic", lambda: now[0])
    monkeypatch.setattr("cairn.checkpoint.schedule.agreement_mod.Agreement", _TwoRankAgreement)
    return now


@pytest.mark.parametrize("steps", [40, 100])
def test_one_save_per_interval_with_two_ranks(
    clock: list[float], tmp_path: pathlib.Path, steps: int
) -> None:
    opts = options.CheckpointOptions(directory=tmp_path, interval_seconds=INTERVAL_SECONDS)
    plan = schedule.SaveSchedule(opts=opts, coordinator=_Coordinator())  # type: ignore[arg-type]
    saves: list[tuple[int, float]] = []
    for step in range(1, steps + 1):
        clock[0] += STEP_SECONDS
        if plan.should_save(step):
            plan.started(step)
            saves.append((step, clock[0]))
    gaps = [b - a for (_, a), (_, b) in itertools.pairwise(saves)]
    assert saves, "the clock never asked for a save"
    assert all(g >= INTERVAL_SECONDS for g in gaps), saves
    expected = int(steps * STEP_SECONDS // (INTERVAL_SECONDS + STEP_SECONDS))
    assert expected - 1 <= len(saves) <= expected + 1, (expected, saves)
