"""Preemption: SIGTERM → final checkpoint at the next agreed step → clean exit.

Covers: a SIGTERM delivered to one rank only still makes every rank save
the same final step, commit it and exit 0; the next attempt resumes from it.
"""

from __future__ import annotations

import os
import pathlib
import signal

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
