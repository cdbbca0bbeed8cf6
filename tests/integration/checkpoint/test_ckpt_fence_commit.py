"""The fence check before the commit stops a zombie writer on its own (world 1, one volume).

The zombie (attempt 0) saves step 2, then is held after step 3. Attempt 1
starts on the same volume (its fence file now says attempt 1), resumes
step 2 and ends. Released, the zombie trains step 4 and saves it into a
fresh temporary folder: nothing is in the way, so the rename would succeed;
only the fence check before the commit (`pipeline._commit`) refuses it.
Without that check this test fails (`scripts/mutations`, rule `fence`).
"""

from __future__ import annotations

import pathlib
import time

import ckpt_harness  # type: ignore[import-not-found]
import pytest

from cairn.checkpoint import layout

pytestmark = [pytest.mark.torch, pytest.mark.timeout(600)]

JOB_UID = "c0ffee00-0000-4000-8000-000000fence1"


def wait_until(check: object, *, what: str, job: ckpt_harness.Job, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if job.procs[0].poll() is not None or time.monotonic() > deadline:
            job.kill()
            raise AssertionError(f"{what} not seen in {timeout} s\n{job.tail()}")
        time.sleep(0.05)


def test_fenced_zombie_never_commits_a_step_after_a_newer_attempt_started(
    tmp_path: pathlib.Path,
) -> None:
    volume = tmp_path / "volume"
    release = tmp_path / "release-zombie"
    base = {"dir": str(volume), "interval": 2, "job_uid": JOB_UID, "resume": True}
    zombie = ckpt_harness.launch(
        {
            **base,
            "steps": 4,
            "attempt": 0,
            "step_file": str(tmp_path / "zombie-step"),
            # Held (bounded) until released, however slow attempt 1 is.
            "hold": {"rank": 0, "after": 3, "until": str(release), "seconds": 280},
        },
        world=1,
        tmp=tmp_path,
        name="zombie",
    )
    step_file = tmp_path / "zombie-step.0"
    wait_until(
        lambda: (
            step_file.exists()
            and step_file.read_text() == "3"
            and 2 in layout.committed_steps(volume, job_uid=JOB_UID)
        ),
        what="zombie held after step 3 with step 2 committed",
        job=zombie,
    )
    newer = ckpt_harness.launch(
        {**base, "steps": 2, "attempt": 1}, world=1, tmp=tmp_path, name="attempt-1"
    )
    newer.wait(timeout=180)
    assert step_file.read_text() == "3", "the zombie went on before it was released"
    assert newer.result(0)["restored"] == 2
    release.write_text("")
    try:
        zombie.procs[0].wait(timeout=120)
    finally:
        zombie.kill()
    assert 4 not in layout.committed_steps(volume, job_uid=JOB_UID), zombie.tail()
    assert "fenced" in zombie.tail(), zombie.tail()
