"""Node-local resume reads and fetches only what each rank's load needs.

Two gloo ranks, each with its own checkpoint directory (node-local volumes,
like an emptyDir per pod), uploading to the real S3 server (SeaweedFS):

- every rank's committed folder holds its own data files and `.metadata`,
  never another rank's data files;
- a restart with intact local copies downloads nothing on any rank, and
  restores exactly the saved state (the replicated entries rank 0 holds
  reach rank 1 without its files);
- a corrupted file of rank 1 makes only rank 1 download (its own files and
  `.metadata`), quarantines only rank 1's local copy, and restores the same
  state.
"""

from __future__ import annotations

import pathlib
import typing

import ckpt_harness  # type: ignore[import-not-found]
import pytest
import torch

from cairn.checkpoint import layout

pytestmark = [pytest.mark.torch, pytest.mark.s3]

UID = "eeeeeeee-0000-4000-8000-000000000005"


def same(a: typing.Any, b: typing.Any) -> bool:
    """Deep equality of nested state (tensors bit for bit)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def assert_restored_state(saved: ckpt_harness.Job, resumed: ckpt_harness.Job) -> None:
    for rank in range(2):
        before, after = saved.dump(4, rank), resumed.dump("restored", rank)
        for part in ("model", "optim", "data", "train", "rng_torch"):
            assert same(before[part], after[part]), (rank, part)


def test_node_local_resume_downloads_only_what_a_rank_lacks(
    tmp_path: pathlib.Path, s3_server: typing.Any
) -> None:
    bucket = s3_server.new_bucket("node-local-restore")
    base: dict[str, typing.Any] = {
        "dir": str(tmp_path / "pod-{rank}"),
        "interval": 2,
        "keep_last": 10,
        "job_uid": UID,
        "s3": ckpt_harness.s3_cfg(s3_server, bucket, prefix="jobs/local"),
    }
    saved = ckpt_harness.launch(
        {**base, "steps": 4, "dump_steps": [4]}, world=2, tmp=tmp_path, name="saved"
    )
    saved.wait()
    volumes = [tmp_path / f"pod-{rank}" for rank in range(2)]
    for rank, volume in enumerate(volumes):
        folder = layout.step_dir(volume, 4)
        names = {p.name for p in folder.iterdir()}
        assert ".metadata" in names
        assert {n for n in names if n.startswith("__")} == {
            n for n in names if n.startswith(f"__{rank}_")
        }
        assert layout.is_uploaded(folder)

    intact = ckpt_harness.launch(
        {**base, "steps": 4, "resume": True, "attempt": 1}, world=2, tmp=tmp_path, name="intact"
    )
    intact.wait()
    for rank in range(2):
        result = intact.result(rank)
        assert (result["restored"], result["skipped"]) == (4, [])
        assert result["downloaded"] == []  # every rank loaded from its own volume
    assert_restored_state(saved, intact)

    shard = layout.step_dir(volumes[1], 4) / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the CRC32C sees it
    shard.write_bytes(bytes(data))

    repaired = ckpt_harness.launch(
        {**base, "steps": 4, "resume": True, "attempt": 2}, world=2, tmp=tmp_path, name="repaired"
    )
    repaired.wait()
    rank0, rank1 = repaired.result(0), repaired.result(1)
    assert rank0["restored"] == rank1["restored"] == 4
    assert rank0["downloaded"] == []
    assert "__1_0.distcp" in rank1["downloaded"]
    assert not [n for n in rank1["downloaded"] if n.startswith("__0_")]
    assert [pathlib.Path(q).parent.parent.name for q in rank1["quarantined"]] == ["quarantine"]
    assert all(str(volumes[1]) in q for q in rank1["quarantined"])
    assert layout.is_committed(layout.step_dir(volumes[0], 4), job_uid=UID)  # rank 0's untouched
    assert layout.is_committed(layout.step_dir(volumes[1], 4), job_uid=UID)  # re-installed
    assert_restored_state(saved, repaired)


@pytest.mark.parametrize("paused_rank", [1, 0], ids=["rank1-before-its-copy", "rank0-last"])
def test_a_kill_between_the_ranks_commits_of_a_first_step_never_blocks_the_restart(
    tmp_path: pathlib.Path, s3_server: typing.Any, paused_rank: int
) -> None:
    """Node-local volumes commit every other rank's copy first and rank 0's
    last. Killed at either rank's commit of the job's FIRST step, the next
    attempt starts fresh and saves that step again (the kill trials' commit
    phase found the old order, rank 0 first: a step committed on rank 0 only,
    so no restore and no fresh start). A copy rank 1 committed before rank 0
    died is moved aside at the re-save (`.cairn/superseded`), never deleted."""
    from cairn.checkpoint import faults

    bucket = s3_server.new_bucket(f"node-local-cut-{paused_rank}")
    base: dict[str, typing.Any] = {
        "dir": str(tmp_path / "pod-{rank}"),
        "interval": 2,
        "keep_last": 10,
        "job_uid": UID,
        "s3": ckpt_harness.s3_cfg(s3_server, bucket, prefix="jobs/cut"),
    }
    marks = tmp_path / "faults"
    marks.mkdir()
    killed = ckpt_harness.launch(
        {**base, "steps": 4},
        world=2,
        tmp=tmp_path,
        name="killed",
        env={
            faults.ENV_FAULT: f"commit:{paused_rank}:2",
            faults.ENV_FAULT_DIR: str(marks),
        },
    )
    ckpt_harness.wait_for_file(marks / f"commit-{paused_rank}-2", job=killed)
    killed.kill()
    volumes = [tmp_path / f"pod-{rank}" for rank in range(2)]
    assert not layout.is_committed(layout.step_dir(volumes[0], 2), job_uid=UID)
    stray = layout.is_committed(layout.step_dir(volumes[1], 2), job_uid=UID)
    assert stray == (paused_rank == 0)  # rank 1 committed its copy before rank 0

    again = ckpt_harness.launch(
        {**base, "steps": 4, "resume": True, "attempt": 1}, world=2, tmp=tmp_path, name="again"
    )
    again.wait()
    assert again.result(0)["restored"] is None  # a fresh start: step 2 was never committed
    for volume in volumes:
        assert layout.is_committed(layout.step_dir(volume, 2), job_uid=UID)
        assert layout.is_committed(layout.step_dir(volume, 4), job_uid=UID)
    aside = sorted(p.name for p in (volumes[1] / ".cairn").rglob("step-*") if p.is_dir())
    assert aside == (["step-000000002"] if stray else [])
