"""Power cuts on a file system that keeps only what was fsynced (crash consistency).

SIGKILL keeps the page cache, so the kill trials cannot see a missing
fsync. Here the volume is `powercut_fs`, a FUSE file system that, when the
test cuts the power, drops every byte and every folder entry not covered by
an fsync (the strictest POSIX reading). One job (one UID, world 1, the real
writer and real DCP, saving every step, keep_last 2) is cut again and again,
each attempt at a different point of the commit path:

- at a pause point (DCP write, just before the commit rename,
  inside a rotation between "manifest gone" and "files gone"), where every
  step the writer had committed (its commit returned) must survive the cut;
- at an arbitrary moment, where a commit or a deletion may be half done,
  so only the weaker promise holds: the newest durable step is not older
  than the oldest step that was committed before the cut.

After every cut: every folder `classify` calls committed holds the
manifest's files with their sizes and CRC32C (nothing half-written is taken
for committed), and the next attempt resumes from the newest committed step
with every state part equal to an uninterrupted reference run.

Removing the folder fsync after the commit rename (`layout.commit_folder`)
makes this test fail: the renamed step vanishes with the cut
(`scripts/mutations`, docs/testing.md).
"""

from __future__ import annotations

import pathlib
import signal
import time
import typing

import ckpt_harness  # type: ignore[import-not-found]
import powercut_fs  # type: ignore[import-not-found]
import pytest
import torch

from cairn.checkpoint import layout

pytestmark = [pytest.mark.torch, pytest.mark.timeout(900)]

JOB_UID = "c0ffee00-0000-4000-8000-0000powercut"
SAVES_PER_ATTEMPT = 3
# (fault phase or "anytime", save number within the attempt, 1-based)
CUTS: tuple[tuple[str, int], ...] = (
    ("write", 2),
    ("commit", 3),
    ("rotate", 2),
    ("anytime", 0),
)
"""Each attempt's cut; "staging" of step N+1 is the same durable state as "write"."""


def committed(volume: pathlib.Path) -> set[int]:
    return set(layout.committed_steps(volume, job_uid=JOB_UID))


def half_written(volume: pathlib.Path) -> list[str]:
    """Committed folders whose files do not match their manifest."""
    found = []
    for step in sorted(committed(volume)):
        folder = layout.step_dir(volume, step)
        manifest = layout.read_manifest(folder)
        problems = layout.verify_files(folder, manifest.files_of_rank(0))
        if problems:
            found.append(f"step {step}: {problems}")
    return found


def reference_dumps(tmp: pathlib.Path, steps: int) -> ckpt_harness.Job:
    """Uninterrupted run dumping every step (it calls restore() like attempt 0)."""
    job = ckpt_harness.launch(
        {
            "dir": str(tmp / "ref-ckpt"),
            "steps": steps,
            "resume": True,
            "dump_steps": list(range(1, steps + 1)),
        },
        world=1,
        tmp=tmp,
        name="reference",
    )
    job.wait(timeout=300)
    return job


def stop_at(job: ckpt_harness.Job, *, marker: pathlib.Path, after: float = 0.0) -> None:
    """Wait (bounded) for `marker` (a pause point, or the trainer's step file),
    then `after` seconds more; then SIGKILL."""
    deadline = time.monotonic() + 180
    while not marker.exists() and job.procs[0].poll() is None:
        if time.monotonic() > deadline:
            job.kill()
            raise AssertionError(f"{marker.name} not reached in 180 s\n{job.tail()}")
        time.sleep(0.01)
    time.sleep(after)
    code = job.procs[0].poll()
    if code is not None:
        raise AssertionError(f"attempt ended by itself (exit {code}) before its cut\n{job.tail()}")
    job.procs[0].send_signal(signal.SIGKILL)
    job.procs[0].wait(timeout=30)


def check_resume(job: ckpt_harness.Job, *, reference: ckpt_harness.Job, newest: int | None) -> str:
    """The attempt restored `newest`, every state part equal to the reference."""
    result_restored = job.out / "dump-restored-rank0.pt"
    got = torch.load(result_restored, weights_only=False)
    step = int(got["train"]["step"])
    assert step == (newest or 0), f"resumed from step {step}, newest committed is {newest}"
    if step:
        differs = ckpt_harness.state_differences(got, reference.dump(step))
        assert differs == [], f"step {step} restored differently in {differs}"
    return f"resumed {step}"


def test_power_cuts_keep_every_committed_step(tmp_path: pathlib.Path) -> None:
    mount = powercut_fs.PowerCutMount.start(tmp_path / "powercut")
    try:
        run_cuts(tmp_path, mount)
    finally:
        mount.stop()


def run_cuts(tmp_path: pathlib.Path, mount: typing.Any) -> None:
    volume = mount.path / "volume"  # the volume itself exists durably, as a mount does
    volume.mkdir()
    layout.fsync_dir(mount.path)
    faults = tmp_path / "faults"
    faults.mkdir()
    reference = reference_dumps(tmp_path, steps=SAVES_PER_ATTEMPT * (len(CUTS) + 1))
    log: list[str] = []
    newest: int | None = None
    for attempt, (phase, nth) in enumerate((*CUTS, ("none", 0))):
        start = newest or 0
        target = start + nth
        env = {"CAIRN_CKPT_FAULT_DIR": str(faults), "CAIRN_CKPT_FAULT_SLEEP": "200"}
        if phase not in ("anytime", "none"):
            env["CAIRN_CKPT_FAULT"] = f"{phase}:0:{target}"
        job = ckpt_harness.launch(
            {
                "dir": str(volume),
                "interval": 1,
                "keep_last": 2,
                "steps": start + SAVES_PER_ATTEMPT,
                "resume": True,
                "attempt": attempt,
                "job_uid": JOB_UID,
                "timeout": 60.0,
                "step_file": str(tmp_path / f"step-{attempt}"),
                "sleep_per_step": 0.2,
            },
            world=1,
            tmp=tmp_path,
            name=f"attempt-{attempt}",
            env=env,
        )
        label = f"attempt {attempt} cut at {phase}:{target}"
        if phase == "none":
            job.wait(timeout=300)
            log.append(f"{label}: {check_resume(job, reference=reference, newest=newest)}")
            break
        if phase == "anytime":  # mid-save: the trainer finished its first step, + 0.15 s
            stop_at(job, marker=tmp_path / f"step-{attempt}.0", after=0.15)
        else:
            stop_at(job, marker=faults / f"{phase}-0-{target}")
        before = committed(volume)
        mount.cut()
        after = committed(volume)
        log.append(f"{label}: committed {sorted(before)} -> {sorted(after)} after the cut")
        assert half_written(volume) == [], f"{label}: {half_written(volume)}\n{log}"
        if phase == "anytime":
            assert not before or max(after, default=0) >= min(before), f"{label}\n{log}"
        else:
            assert before <= after, f"{label}: committed steps lost by the cut\n{log}"
        if job.out.joinpath("dump-restored-rank0.pt").exists():
            log.append(f"{label}: {check_resume(job, reference=reference, newest=newest)}")
        newest = max(after, default=None)
    print("\n".join(log))
