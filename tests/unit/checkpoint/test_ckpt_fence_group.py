"""Fencing by rank-actor group (Ray in-place restarts): the writer's identity is
(attempt, group); group 0 keeps torchrun's records, folder names and keys."""

from __future__ import annotations

import json
import pathlib

import pytest

from cairn.checkpoint import errors, fence, layout, options, pipeline

UID = "0123abcd-0000-0000-0000-000000000000"


def _job(*, attempt: int, group: int | None = None) -> dict[str, object]:
    status: dict[str, object] = {"attempt": attempt}
    if group is not None:
        status["ray"] = {"group": group}
    return {"metadata": {"uid": UID}, "status": status}


def test_api_fence_refuses_an_older_group_of_the_same_attempt() -> None:
    reason = fence.job_stale_reason(_job(attempt=2, group=1), job_uid=UID, attempt=2, group=0)
    assert reason is not None and "rank-actor group is 1" in reason


def test_api_fence_lets_the_current_group_commit() -> None:
    assert fence.job_stale_reason(_job(attempt=2, group=1), job_uid=UID, attempt=2, group=1) is None


def test_api_fence_ignores_the_group_of_an_older_attempt() -> None:
    # A new attempt writes status.attempt first; our group counts in our attempt only.
    assert fence.job_stale_reason(_job(attempt=3, group=0), job_uid=UID, attempt=3, group=0) is None
    assert fence.job_stale_reason(_job(attempt=1, group=5), job_uid=UID, attempt=2, group=0) is None


def test_api_fence_object_checks_its_group() -> None:
    api = fence.ApiFence(get_job=lambda: _job(attempt=1, group=2), job_uid=UID, group=1)
    with pytest.raises(errors.FencedError, match="group is 2"):
        api.check(1)


def test_torchrun_job_without_ray_status_is_unchanged() -> None:
    assert fence.job_stale_reason(_job(attempt=1), job_uid=UID, attempt=1) is None


def test_local_fence_records_group_and_refuses_the_old_group(tmp_path: pathlib.Path) -> None:
    fence.raise_local(tmp_path, job_uid=UID, attempt=1)
    fence.raise_local(tmp_path, job_uid=UID, attempt=1, group=1)
    doc = json.loads((tmp_path / fence.FENCE_NAME).read_text())
    assert doc == {"job_uid": UID, "attempt": 1, "group": 1}
    with pytest.raises(errors.FencedError, match="group 1 of attempt 1 has started"):
        fence.LocalFence(root=tmp_path, job_uid=UID, group=0).check(1)
    fence.LocalFence(root=tmp_path, job_uid=UID, group=1).check(1)


def test_local_fence_old_group_cannot_start_after_a_newer_one(tmp_path: pathlib.Path) -> None:
    fence.raise_local(tmp_path, job_uid=UID, attempt=1, group=2)
    with pytest.raises(errors.FencedError, match="fenced"):
        fence.raise_local(tmp_path, job_uid=UID, attempt=1, group=1)


def test_a_new_attempt_supersedes_any_group(tmp_path: pathlib.Path) -> None:
    fence.raise_local(tmp_path, job_uid=UID, attempt=1, group=3)
    fence.raise_local(tmp_path, job_uid=UID, attempt=2)
    assert fence.read_record(tmp_path) == fence.FenceRecord(job_uid=UID, attempt=2, group=0)
    with pytest.raises(errors.FencedError):
        fence.LocalFence(root=tmp_path, job_uid=UID, group=3).check(1)


def test_group_zero_keeps_torchruns_record(tmp_path: pathlib.Path) -> None:
    fence.raise_local(tmp_path, job_uid=UID, attempt=4)
    assert json.loads((tmp_path / fence.FENCE_NAME).read_text()) == {"job_uid": UID, "attempt": 4}


def test_tmp_folder_token_includes_the_group_and_parses() -> None:
    assert layout.tmp_dir_name(6, job_uid=UID, attempt=1) == ".step-000000006.tmp-0123abcd-a1"
    name = layout.tmp_dir_name(6, job_uid=UID, attempt=1, group=2)
    assert name == ".step-000000006.tmp-0123abcd-a1g2"
    assert layout.parse_tmp_dir_name(name) == (6, "0123abcd", 1)


def test_data_prefix_is_group_scoped(tmp_path: pathlib.Path) -> None:
    s3 = options.S3Options(uri="s3://b/p")
    base = options.CheckpointOptions(directory=tmp_path, attempt=1, job_uid=UID, s3=s3)
    assert pipeline.data_prefix(base) == "a1-0123abcd"
    grouped = options.CheckpointOptions(directory=tmp_path, attempt=1, group=1, job_uid=UID, s3=s3)
    assert pipeline.data_prefix(grouped) == "a1g1-0123abcd"


def test_negative_group_is_rejected(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="group"):
        options.CheckpointOptions(directory=tmp_path, group=-1)
