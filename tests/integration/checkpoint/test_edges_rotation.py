"""Edges of rotation, the upload backlog, asyncMode and the SIGTERM agreement.

Real files, real multi-process gloo ranks (`ckpt_harness` + `ckpt_worker`),
the real S3 server (SeaweedFS on loopback). Covers:

- node-local volumes: a 2-rank run with keepLast 2 leaves at most 2
  committed steps on EVERY rank's own directory after 10 saves (each rank
  rotates its own volume), and each rank's folders hold its own files only;
- upload failure: with S3 unreachable (`s3_fault_proxy` in front of the real
  server resets every connection) training goes on, the failure is reported
  (`upload_failed` events → `status.checkpoints.uploadError`), local
  retention keeps the not-uploaded steps and says it is over budget; when S3
  returns, the backlog is uploaded and the error clears;
- `asyncMode: off` blocks like a synchronous `dcp.save`: save() returns only
  once the step's manifest exists, on every rank, for every save;
- SIGTERM with ranks 3+ steps apart (ranks without training collectives,
  as with NCCL where the CPU runs ahead): both ranks save, commit and report
  one common final step, `max(reported current steps) + 1`, and no rank
  reports a save it skipped.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pathlib
import signal
import time
import typing

import ckpt_harness  # type: ignore[import-not-found]
import pytest
import s3_fault_proxy  # type: ignore[import-not-found]

from cairn.api import manifest as manifest_mod
from cairn.checkpoint import checkpoint_status, events, layout, upload_backlog

pytestmark = pytest.mark.torch


def committed_on(root: pathlib.Path) -> list[int]:
    return layout.committed_steps(root)


# -- node-local rotation ------------------------------------------------------------


def test_node_local_keep_last_two_leaves_two_steps_on_every_rank(tmp_path: pathlib.Path) -> None:
    cfg = {"dir": str(tmp_path / "node-{rank}"), "interval": 1, "steps": 10, "keep_last": 2}
    job = ckpt_harness.launch(cfg, world=2, tmp=tmp_path, name="node-local")
    job.wait(timeout=180)
    for rank in range(2):
        root = tmp_path / f"node-{rank}"
        assert job.result(rank)["saved"] == list(range(1, 11))
        # At every save: at most keepLast committed steps (+ the one in flight).
        assert max(job.result(rank)["committed_during"]) <= 2 + 1
        assert committed_on(root) == [9, 10], f"rank {rank}'s volume"
        assert not layout.tmp_dirs(root), f"rank {rank}: temporary folders left"
        assert sorted(layout.step_dirs(root)) == [9, 10]
        for step in (9, 10):
            folder = layout.step_dir(root, step)
            manifest = layout.read_manifest(folder)
            # The manifest lists both ranks' files; this volume holds its own.
            assert {e.rank for e in manifest.files} == {0, 1}
            own = {e.path for e in manifest.files_of_rank(rank)}
            data = {p.name for p in folder.iterdir() if p.name.startswith("__")}
            assert data == {n for n in own if n.startswith("__")}
        deleted = [e["step"] for e in job.result(rank)["events"] if e["phase"] == "deleted"]
        assert sorted(deleted) == list(range(1, 9)), f"rank {rank} rotated its own volume"


# -- upload backlog ---------------------------------------------------------------------


NO_FAULTS = "\x00none"
"""A `FaultProxy.match` no request path contains: every request is forwarded."""


def wait_step(path: pathlib.Path, at_least: int, *, job: typing.Any, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError, ValueError):
            step = int(path.read_text())
            if step >= at_least:
                return step
        if any(p.poll() is not None for p in job.procs):
            job.kill()
            raise AssertionError(f"a rank exited before step {at_least}\n{job.tail()}")
        if time.monotonic() > deadline:
            job.kill()
            raise AssertionError(f"step {at_least} not reached in {timeout}s\n{job.tail()}")
        time.sleep(0.05)


def wait_stable(path: pathlib.Path, *, job: typing.Any, quiet: float = 1.5) -> int:
    """The step in `path` once it stopped changing for `quiet` seconds (bounded)."""
    deadline = time.monotonic() + 60
    last, since = path.read_text(), time.monotonic()
    while time.monotonic() - since < quiet:
        if time.monotonic() > deadline or any(p.poll() is not None for p in job.procs):
            job.kill()
            raise AssertionError(f"{path.name} never settled\n{job.tail()}")
        time.sleep(0.05)
        now = path.read_text()
        if now != last:
            last, since = now, time.monotonic()
    return int(last)


def remote_steps(server: typing.Any, bucket: str, prefix: str) -> list[int]:
    client = server.client()
    steps = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            folder, _, name = obj["Key"][len(prefix) :].partition("/")
            step = manifest_mod.parse_step_dir_name(folder)
            if step is not None and name == manifest_mod.MANIFEST_NAME:
                steps.append(step)
    return sorted(steps)


@pytest.mark.s3
def test_upload_failure_keeps_training_then_the_backlog_uploads(
    tmp_path: pathlib.Path, s3_server: typing.Any
) -> None:
    bucket = s3_server.new_bucket("backlog")
    # The real server behind a loopback proxy that can reset every
    # connection: what a client sees while S3 is gone.
    proxy = s3_fault_proxy.FaultProxy(
        s3_server.endpoint_url, match=NO_FAULTS, fail_first=None, modes=("reset",)
    )
    steps_file = tmp_path / "steps"
    try:
        cfg = {
            "dir": str(tmp_path / "ckpt"),
            "interval": 2,
            "steps": 80,
            "keep_last": 2,
            "sleep_per_step": 0.05,
            "step_file": str(steps_file),
            "upload_retry": 0.2,
            "s3": {
                "uri": f"s3://{bucket}/jobs/backlog",
                "endpoint_url": proxy.endpoint_url,
                "region": s3_server.region,
                "access_key": s3_server.access_key,
                "secret_key": s3_server.secret_key,
                "max_attempts": 1,
                "connect_timeout": 2.0,
                "read_timeout": 5.0,
            },
        }
        job = ckpt_harness.launch(cfg, world=2, tmp=tmp_path, name="backlog")
        # The first save starts the lineage (which reads S3); then S3 goes
        # away for several saves: training must go on.
        wait_step(steps_file.with_suffix(".0"), 3, job=job)
        proxy.match = ""  # outage: every request
        down_at = wait_step(steps_file.with_suffix(".0"), 4, job=job)
        wait_step(steps_file.with_suffix(".0"), down_at + 16, job=job)
        during = remote_steps(s3_server, bucket, "jobs/backlog/")
        proxy.match = NO_FAULTS  # S3 is back
        job.wait(timeout=240)
    finally:
        proxy.close()

    result = job.result(0)
    assert result["saved"] == list(range(2, 81, 2))
    evs = result["events"]
    failed = [e for e in evs if e["phase"] == "upload_failed"]
    assert failed, "the outage was not reported"
    backlog, error = upload_backlog.parse_failure_message(failed[0]["message"])
    assert backlog and error
    # While S3 was down, rotation kept the not-uploaded steps and said so.
    notes = [e["message"] for e in evs if e["phase"] == "rotated" and e["message"]]
    assert any("not uploaded yet" in n for n in notes)
    # Every step committed while S3 was down was uploaded later.
    uploaded = {e["step"] for e in evs if e["phase"] == "uploaded"}
    first_failed = min(e["step"] for e in failed)
    assert set(range(first_failed, 81, 2)) <= uploaded
    remote = remote_steps(s3_server, bucket, "jobs/backlog/")
    assert first_failed not in during  # it really was down for that step
    assert set(range(first_failed, 81, 2)) <= set(remote)
    # And what is left locally is within keepLast once the backlog is gone.
    assert committed_on(tmp_path / "ckpt") == [78, 80]
    # The status the writer reports: uploadError set during the outage, cleared after.
    tracker = checkpoint_status.Tracker(upload_uri=f"s3://{bucket}/jobs/backlog")
    now = datetime.datetime(2026, 11, 23, tzinfo=datetime.UTC)
    states = []
    for e in evs:
        event = events.ProgressEvent(
            phase=e["phase"], step=e["step"], rank=e["rank"], message=e["message"]
        )
        tracker = checkpoint_status.apply(tracker, event, now=now)
        states.append(tracker.status.upload_error)
    assert any(s is not None and s.backlog for s in states)
    assert tracker.status.upload_error is None
    assert tracker.status.last_uploaded is not None and tracker.status.last_uploaded.step == 80


# -- asyncMode: off ---------------------------------------------------------------------


def test_async_mode_off_returns_only_after_the_commit(tmp_path: pathlib.Path) -> None:
    cfg = {"dir": str(tmp_path / "ckpt"), "interval": 2, "steps": 8, "async_mode": "off"}
    job = ckpt_harness.launch(cfg, world=2, tmp=tmp_path, name="sync")
    job.wait(timeout=180)
    for rank in range(2):
        result = job.result(rank)
        assert result["saved"] == [2, 4, 6, 8]
        # Like dcp.save: when save() returned, the step was on disk, committed.
        assert result["committed_on_return"] == {"2": True, "4": True, "6": True, "8": True}
    assert committed_on(tmp_path / "ckpt") == [4, 6, 8]


# -- SIGTERM agreement ------------------------------------------------------------------


def test_sigterm_with_ranks_three_steps_apart_commits_one_common_step(
    tmp_path: pathlib.Path,
) -> None:
    steps_file = tmp_path / "steps"
    release = tmp_path / "release"
    cfg = {
        "dir": str(tmp_path / "ckpt"),
        "interval": 100_000,
        "steps": 10_000,
        "sigterm": True,
        "independent": True,  # no collectives while training: ranks drift apart
        "sleep_per_step": 0.02,
        "step_file": str(steps_file),
        "hold": {"rank": 1, "after": 2, "until": str(release)},
    }
    job = ckpt_harness.launch(cfg, world=2, tmp=tmp_path, name="apart")
    ahead = wait_step(steps_file.with_suffix(".0"), 5, job=job)
    behind = int(steps_file.with_suffix(".1").read_text())
    assert ahead - behind >= 3
    os.kill(job.procs[0].pid, signal.SIGTERM)
    # Rank 0 reports the step it finished (r) and runs one more; at r + 1
    # (the earliest step that could be agreed) it waits for rank 1's report.
    waiting_at = wait_stable(steps_file.with_suffix(".0"), job=job)
    assert waiting_at - 1 - behind >= 3
    release.write_text("go")
    job.wait(timeout=120)
    finals = [job.result(r)["final_step"] for r in range(2)]
    assert finals[0] == finals[1]
    # One past the furthest rank's report (rank 0's r; rank 1 reported <= 3).
    assert finals[0] == waiting_at
    for rank in range(2):
        assert job.result(rank)["saved"] == [finals[0]], "a rank reported a save it skipped"
    assert committed_on(tmp_path / "ckpt") == [finals[0]]
