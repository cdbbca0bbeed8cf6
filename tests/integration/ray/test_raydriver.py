"""The Ray driver on a real Ray head (loopback), real gloo, the real reference trainer.

Covers: 2 rank actors train and commit (uploads to the real S3 server); a
rank actor's process SIGKILLed mid-training → the driver starts group 1 in
place from the standby rank actors warmed meanwhile (torch imported), which
restores from the last committed step, and the run ends with
per-step losses and exported weights bit-identical to an undisturbed torchrun
run; a standby that died before it was needed → the restart starts fresh
actors and the run completes; the in-place budget spent → retryable exit
(75); SIGTERM of the driver →
every rank saves a final checkpoint, committed, exit 143 (preempted).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import time
import typing

import pytest

from cairn.api import exitcodes
from cairn.trainer.raydriver import recovery
from tests.integration.ray import harness, rayhead

pytestmark = [pytest.mark.torch]

JOB_UID = "0123abcd-4567-89ef-0123-456789abcdef"


@pytest.mark.s3
@pytest.mark.timeout(1200)
def test_sigkill_rank_recovers_in_place_bit_identical(
    tmp_path: pathlib.Path, ray_head: rayhead.RayHead, s3_server: typing.Any
) -> None:
    steps = 12  # long enough for the standbys to warm before the kill

    def s3_env(bucket: str) -> dict[str, str]:
        return {
            "CAIRN_UPLOAD_URI": f"s3://{bucket}/run",
            "AWS_ENDPOINT_URL_S3": s3_server.endpoint_url,
            "AWS_ACCESS_KEY_ID": s3_server.access_key,
            "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
            "AWS_REGION": s3_server.region,
            "CAIRN_JOB_UID": JOB_UID,
        }

    straight = tmp_path / "torchrun"
    proc = harness.launch_torchrun(
        straight,
        harness.base_env(straight, **s3_env(s3_server.new_bucket("ray-straight"))),
        steps=steps,
        port=rayhead.free_port(),
    )
    assert harness.wait(proc, straight) == 0, harness.log_text(straight)

    run = tmp_path / "ray"
    driver = harness.launch_driver(
        run,
        ray_head,
        harness.base_env(run, **s3_env(s3_server.new_bucket("ray-killed"))),
        steps=steps,
        trainer_extra=["--step-delay=1.0"],
    )
    harness.wait_until("step 4 committed", lambda: harness.committed(run, 4), driver, run)
    harness.wait_until(
        "group 1's standbys warm",
        lambda: (
            "group 1: standby rank actors ready"
            in (run / "driver.log").read_text("utf-8", "replace")
        ),
        driver,
        run,
    )
    victim = harness.group_pids(run)[0][1]
    os.kill(victim, signal.SIGKILL)
    assert harness.wait(driver, run) == 0, harness.log_text(run)

    log = (run / "driver.log").read_text(errors="replace")
    groups = harness.group_pids(run)
    assert sorted(groups) == [0, 1], log[-4000:]
    assert victim not in groups[1]
    assert "in-place restart 1/3: group 0 -> 1" in log
    # Group 1 is the standbys (torch imported before the kill), not new actors.
    assert "group 1: the standby rank actors take over" in log, log[-4000:]
    resumed = [int(s) for s in re.findall(r"resumed from step (\d+)", log)]
    assert resumed and resumed[-1] >= 4, log[-4000:]
    # Bit for bit the torchrun run: every step's loss and the exported weights.
    assert harness.losses(run) == harness.losses(straight)
    assert sorted(harness.losses(run)) == list(range(1, steps + 1))
    assert (run / "model.safetensors").read_bytes() == (straight / "model.safetensors").read_bytes()
    # The last step was committed by group 1: its data objects are group-scoped
    # and it was uploaded (manifest last) like under torchrun.
    final = run / "ckpt" / f"step-{steps:09d}"
    manifest = json.loads((final / "manifest.json").read_text())
    assert manifest["data_prefix"] == "a1g1-0123abcd"
    assert (final / ".uploaded").is_file()
    fence = json.loads((run / "ckpt" / ".cairn-fence").read_text())
    assert fence == {"job_uid": JOB_UID, "attempt": 1, "group": 1}


@pytest.mark.timeout(900)
def test_a_dead_standby_makes_the_restart_start_fresh_actors(
    tmp_path: pathlib.Path, ray_head: rayhead.RayHead
) -> None:
    run = tmp_path / "ray"
    driver = harness.launch_driver(
        run, ray_head, harness.base_env(run), steps=20, trainer_extra=["--step-delay=1.0"]
    )
    ready = re.compile(r"group 1: standby rank actors ready, pids \[([\d, ]+)\]")

    def text() -> str:
        return (run / "driver.log").read_text("utf-8", "replace")

    harness.wait_until(
        "group 1's standbys warm", lambda: ready.search(text()) is not None, driver, run
    )
    found = ready.search(text())
    assert found is not None
    standbys = [int(p) for p in found.group(1).split(",")]
    os.kill(standbys[1], signal.SIGKILL)  # rank 1's standby dies first...
    time.sleep(1.0)  # ...and Ray has seen it go
    victim = harness.group_pids(run)[0][1]
    os.kill(victim, signal.SIGKILL)  # ...then rank 1 itself
    assert harness.wait(driver, run) == 0, harness.log_text(run)
    log = text()
    assert "group 1: standby rank actors unusable (ActorDiedError), starting new ones" in log, log[
        -4000:
    ]
    groups = harness.group_pids(run)
    assert sorted(groups) == [0, 1], log[-4000:]
    assert not set(groups[1]) & set(standbys), (groups, standbys)
    assert sorted(harness.losses(run)) == list(range(1, 21))


@pytest.mark.timeout(900)
def test_budget_spent_exits_retryable(tmp_path: pathlib.Path, ray_head: rayhead.RayHead) -> None:
    run = tmp_path / "ray"
    driver = harness.launch_driver(
        run,
        ray_head,
        harness.base_env(run),
        steps=40,
        driver_args=["--max-inplace-restarts=0"],
        trainer_extra=["--step-delay=0.5"],
    )
    harness.wait_until("step 2 committed", lambda: harness.committed(run, 2), driver, run)
    os.kill(harness.group_pids(run)[0][0], signal.SIGKILL)
    assert harness.wait(driver, run) == recovery.RETRYABLE_EXIT_CODE, harness.log_text(run)
    log = (run / "driver.log").read_text(errors="replace")
    assert "in-place restart budget (0) is spent" in log
    assert sorted(harness.group_pids(run)) == [0]


@pytest.mark.timeout(900)
def test_sigterm_commits_final_checkpoint_and_exits_preempted(
    tmp_path: pathlib.Path, ray_head: rayhead.RayHead
) -> None:
    run = tmp_path / "ray"
    driver = harness.launch_driver(
        run,
        ray_head,
        harness.base_env(
            run, CAIRN_CHECKPOINT_INTERVAL_STEPS="100", CAIRN_FINAL_CHECKPOINT_GRACE_SECONDS="240"
        ),
        steps=200,
        trainer_extra=["--step-delay=0.3"],
    )
    harness.wait_until("3 steps", lambda: harness.loss_lines(run) >= 3, driver, run)
    driver.send_signal(signal.SIGTERM)
    assert harness.wait(driver, run) == exitcodes.PREEMPTED, harness.log_text(run)
    steps = sorted(int(p.name.split("-")[1]) for p in (run / "ckpt").glob("step-*") if p.is_dir())
    # No interval step was reached: the committed step is the final one.
    assert len(steps) == 1 and 3 <= steps[0] < 100, steps
    assert harness.committed(run, steps[0])
    assert max(harness.losses(run)) == steps[0]
    assert "preempted: final checkpoint at step" in (run / "driver.log").read_text(errors="replace")
