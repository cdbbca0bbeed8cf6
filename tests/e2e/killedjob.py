"""A job run with one rank SIGKILLed after a commit, checked as a user watches it.

Shared by the e2e modules whose trainer is not ours (a user's script, the
Transformers `Trainer`): the job succeeds after exactly one gang restart;
STEP and COMMITTED fill in the first attempt and RESUMED-FROM in the second;
the second attempt resumed from a saved step at or after the kill and ran
to the end with its last step committed and uploaded.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tests import demo


@dataclasses.dataclass(frozen=True, kw_only=True)
class KilledRun:
    status: dict[str, Any]
    rows: list[demo.Row]
    first: list[demo.Row]
    """Rows while attempt 1 ran."""
    second: list[demo.Row]
    """Rows while attempt 2 ran."""


def run_with_a_killed_rank(
    *, api_client: Any, namespace: str, body: dict[str, Any], kill_after_commit: int, timeout: float
) -> KilledRun:
    rows: list[demo.Row] = []
    job = demo.run_job(
        api_client=api_client,
        namespace=namespace,
        body=body,
        kill_rank_after_commit=kill_after_commit,
        on_row=rows.append,
        poll_seconds=0.5,
        timeout=timeout,
    )
    for row in rows:
        print("   ", row.line())
    status = job["status"]
    assert status["phase"] == "Succeeded", status
    assert status["restarts"] == 1, "exactly one gang restart (the killed rank)"
    first = [r for r in rows if r.phase == "Running" and r.attempt == 1]
    second = [r for r in rows if r.phase == "Running" and r.attempt == 2]
    # Every column filled while the trainer ran, from the library alone.
    assert any(r.step is not None and r.step > 0 for r in first), "STEP never filled"
    assert any(r.committed is not None for r in first), "COMMITTED never filled"
    assert any(r.resumed_from is not None for r in second), "RESUMED-FROM never filled"
    return KilledRun(status=status, rows=rows, first=first, second=second)


def check_resumed_to_the_end(
    status: dict[str, Any], *, interval: int, kill_after_commit: int, steps: int
) -> int:
    """The second attempt resumed from a saved step at or after the kill and
    finished: returns the step it resumed from."""
    ckpts = status["checkpoints"]
    resumed: int = ckpts["resumedFrom"]["step"]
    assert resumed % interval == 0 and kill_after_commit <= resumed < steps, resumed
    assert ckpts["resumedFrom"]["attempt"] == 2
    assert ckpts["lastCommitted"]["step"] == steps
    assert ckpts["lastUploaded"]["step"] == steps
    assert status["step"] == steps
    return resumed
