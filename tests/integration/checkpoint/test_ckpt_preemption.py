"""Preemption: SIGTERM → final checkpoint at the next agreed step → clean exit.

Covers: a SIGTERM delivered to one rank only still makes every rank save
the same final step, commit it and exit 0; the next attempt resumes from it.
A final checkpoint whose peer was SIGKILLed does not wait out the grace
period: the survivor's agreement ends once the dead rank's heartbeat has
stopped (`cairn.checkpoint.liveness`), naming it.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import time

import ckpt_harness  # type: ignore[import-not-found]
import pytest

from cairn.checkpoint import layout

pytestmark = pytest.mark.torch


def test_sigterm_on_one_rank_takes_a_final_checkpoint(tmp_path: pathlib.Path) -> None:
    ckpt = tmp_path / "ckpt"
    progress = tmp_path / "progress"
    cfg = {
        "dir": str(ckpt),
        "interval": 1000,
        "steps": 10_000,
        "sigterm": True,
        "sleep_per_step": 0.05,
        "progress_file": str(progress),
    }
    job = ckpt_harness.launch(cfg, world=2, tmp=tmp_path, name="preempted")
    for rank in range(2):
        ckpt_harness.wait_for_file(progress.with_suffix(f".{rank}"), job=job)
    os.kill(job.procs[1].pid, signal.SIGTERM)
    job.wait(timeout=60)
    finals = [job.result(r)["final_step"] for r in range(2)]
    assert finals[0] == finals[1]
    assert layout.committed_steps(ckpt) == [finals[0]]

    resumed = ckpt_harness.launch(
        {"dir": str(ckpt), "steps": finals[0], "resume": True, "attempt": 1},
        world=2,
        tmp=tmp_path,
        name="resumed",
    )
    resumed.wait()
    assert resumed.result(0)["restored"] == finals[0]


def test_final_checkpoint_with_a_killed_peer_ends_on_its_stopped_heartbeat(
    tmp_path: pathlib.Path,
) -> None:
    """Rank 1 SIGKILLed, then rank 0 SIGTERMed (a pod deletion meeting a crash).

    Ranks train independently (no collective fails first), so rank 0 reaches
    the final agreement and waits for rank 1's report. Its bound is the grace
    period less the margin (300 s -> 270 s); the wait here is 240 s, so rank 0
    can only be done by then if the dead peer's stopped heartbeat ended it."""
    progress = tmp_path / "progress"
    cfg = {
        "dir": str(tmp_path / "ckpt-{rank}"),
        "interval": 1000,
        "steps": 1_000_000,
        "sigterm": True,
        "independent": True,
        "final_grace": 300,
        "timeout": 300.0,
        "sleep_per_step": 0.05,
        "progress_file": str(progress),
    }
    job = ckpt_harness.launch(cfg, world=2, tmp=tmp_path, name="peer-killed")
    try:
        for rank in range(2):
            ckpt_harness.wait_for_file(progress.with_suffix(f".{rank}"), job=job)
        job.procs[1].kill()
        job.procs[1].wait(timeout=30)
        signalled = time.monotonic()
        os.kill(job.procs[0].pid, signal.SIGTERM)
        try:
            code = job.procs[0].wait(timeout=240)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"rank 0 still waits for its dead peer after 240 s\n{job.tail()}"
            ) from None
        ended_after = time.monotonic() - signalled
    finally:
        job.kill()
    log = job.logs[0].read_text(errors="replace")
    print(f"final agreement with a dead peer ended after {ended_after:.1f} s (bound 270 s)")
    assert code != 0, "a final checkpoint without its peer cannot have been committed"
    assert "PeerLostError" in log, log[-3000:]
    assert "rank 1's heartbeat has not moved" in log, log[-3000:]
    assert not list((tmp_path / "ckpt-0").glob("step-*/manifest.json"))
