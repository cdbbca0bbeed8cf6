"""SIGKILL of a rank at each phase of the lifecycle, then resume (gloo on CPU).

Covers, for kills during staging, writing, commit and rotation: a folder
without a complete manifest is never selected for resume; the previous
committed step survives; the next attempt resumes, cleans the abandoned
partial and commits new steps. Also: a corrupted shard of the newest
committed step makes resume fall back to the older step and say so.
"""

from __future__ import annotations

import pathlib

import ckpt_harness  # type: ignore[import-not-found]
import pytest

from cairn.checkpoint import layout

pytestmark = pytest.mark.torch

BASE = {"interval": 2, "keep_last": 2, "steps": 6}


@pytest.mark.parametrize(
    ("phase", "rank", "step", "expected_resume"),
    [
        pytest.param("staging", 1, 4, 2, id="staging"),
        pytest.param("write", 1, 4, 2, id="write"),
        pytest.param("commit", 0, 4, 2, id="commit"),
        pytest.param("rotate", 0, 6, 6, id="rotation"),
    ],
)
def test_kill_during_phase_then_resume(
    tmp_path: pathlib.Path, phase: str, rank: int, step: int, expected_resume: int
) -> None:
    ckpt = tmp_path / "ckpt"
    cfg = {**BASE, "dir": str(ckpt)}
    job = ckpt_harness.launch(
        cfg,
        world=2,
        tmp=tmp_path,
        name="killed",
        env={
            "CAIRN_CKPT_FAULT": f"{phase}:{rank}:{step}",
            "CAIRN_CKPT_FAULT_DIR": str(tmp_path),
            "CAIRN_CKPT_FAULT_SLEEP": "60",
        },
    )
    ckpt_harness.wait_for_file(tmp_path / f"{phase}-{rank}-{step}", job=job)
    ckpt_harness.sigkill(job, rank)
    job.kill()  # the surviving rank would only wait for its peer

    assert layout.committed_steps(ckpt)[-1] == expected_resume
    killed = layout.step_dir(ckpt, step)
    if phase != "rotate":
        assert not layout.is_committed(killed)

    resumed = ckpt_harness.launch(
        {**cfg, "steps": 8, "resume": True, "attempt": 1}, world=2, tmp=tmp_path, name="resumed"
    )
    resumed.wait()
    for r in range(2):
        result = resumed.result(r)
        assert result["restored"] == expected_resume
        assert result["skipped"] == []
    # Every step folder left is committed: the partial was cleaned, new steps committed.
    folders = layout.step_dirs(ckpt)
    assert all(layout.is_committed(f) for f in folders.values()), sorted(folders)
    assert layout.committed_steps(ckpt)[-1] == 8


def test_corrupt_shard_falls_back_to_older_step(tmp_path: pathlib.Path) -> None:
    ckpt = tmp_path / "ckpt"
    cfg = {**BASE, "dir": str(ckpt), "keep_last": 3}
    ckpt_harness.launch(cfg, world=2, tmp=tmp_path, name="first").wait()
    assert layout.committed_steps(ckpt) == [2, 4, 6]
    shard = layout.step_dir(ckpt, 6) / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different bytes: only the checksum sees it
    shard.write_bytes(bytes(data))

    resumed = ckpt_harness.launch(
        # Resume only (no further steps), so step 6 is not written again.
        {**cfg, "steps": 4, "resume": True, "attempt": 1},
        world=2,
        tmp=tmp_path,
        name="resumed",
    )
    resumed.wait()
    for r in range(2):
        result = resumed.result(r)
        assert result["restored"] == 4
        assert result["skipped"] == [6]
    assert "failed verification" in resumed.logs[0].read_text()
    # The corrupt step is quarantined (moved aside, not deleted): never selected again.
    assert 6 not in layout.committed_steps(ckpt)
