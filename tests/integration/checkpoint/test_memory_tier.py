"""The in-memory tier end to end: two gloo ranks, each with its own volume and
its own "pod memory" folder (`CheckpointOptions.memory_dir`), real replica
servers on loopback (`cairn.checkpoint.peer`), the job's manifest keyring.

One saving run (every rank keeps its share in memory and pushes its
replica to the other), then two restores (each a new process per rank, as
after a kill; no step is saved after a restore, so both see step 4):

- a corrupted memory copy: one flipped byte in rank 0's own copy AND in
  the replica rank 1 holds for it; CRC32C refuses both (the own copy before
  loading, the replica's data file as the load reads it from the peer, which
  fails the load on both ranks), the memory copy is never trained on, the
  volume's copy is loaded (tier `local`), bit-identical;
- a rank lost its volume and its memory (a replacement pod): rank 1 reads
  its replica from rank 0's server straight into its tensors (`peer`),
  while rank 0 loads its own memory copy though its volume holds the step
  too (`memory`); bit-identical; the replica is not kept as rank 1's own
  copy (its next save keeps one) and the head files fetched are gone.

Saves every step to memory and the volume, S3 every 4th (`upload_interval`,
spec `checkpoint.upload.intervalSteps`): only steps 4 and 8 are uploaded
while training, the others are committed local-only and rotate without an
upload; the clean end uploads the last step (10) too.

Two ranks of one pod (procsPerNode 2) share its memory volume: each keeps
its copy in its own folder, and both resume from memory.

Memory off (`memory_dir` None) is every other checkpoint test; the unit
tests (tests/unit/checkpoint/test_memtier.py) cover the pure parts.
"""

from __future__ import annotations

import pathlib
import shutil
import typing

import ckpt_harness  # type: ignore[import-not-found]
import pytest

from cairn.api import manifest as manifest_mod
from cairn.checkpoint import layout, memtier

pytestmark = [pytest.mark.torch]

UID = "eeeeeeee-0000-4000-8000-000000000023"
RING = manifest_mod.Keyring(current="k1", keys={"k1": bytes(range(32))})


def _flip(path: pathlib.Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _assert_same_state(saved: ckpt_harness.Job, resumed: ckpt_harness.Job) -> None:
    for rank in range(2):
        diff = ckpt_harness.state_differences(resumed.dump("restored", rank), saved.dump(4, rank))
        assert diff == [], (rank, diff)


def _base(tmp: pathlib.Path, *, volume: str, memory: str) -> dict[str, typing.Any]:
    """A 2-rank job saving every 2nd step, its volume and memory folders under `tmp`
    (`{rank}` in a name: one per rank, as one pod per rank)."""
    return {
        "dir": str(tmp / volume),
        "memory_dir": str(tmp / memory),
        "interval": 2,
        "job_uid": UID,
        "keyring": manifest_mod.dump_keyring(RING).decode(),
    }


def _save(base: dict[str, typing.Any], tmp: pathlib.Path) -> ckpt_harness.Job:
    """Four steps saved (steps 2 and 4), the state of step 4 dumped."""
    job = ckpt_harness.launch(
        {**base, "steps": 4, "dump_steps": [4]}, world=2, tmp=tmp, name="saved"
    )
    job.wait()
    return job


def _resume(base: dict[str, typing.Any], tmp: pathlib.Path, name: str) -> ckpt_harness.Job:
    job = ckpt_harness.launch(
        {**base, "steps": 4, "resume": True, "attempt": 1}, world=2, tmp=tmp, name=name
    )
    job.wait()
    return job


def test_restore_order_memory_then_peer_then_volume(tmp_path: pathlib.Path) -> None:
    base = _base(tmp_path, volume="pod-{rank}", memory="mem-{rank}")
    saved = _save(base, tmp_path)
    # each rank's folder of its pod's memory (`rank-<r>/`)
    mem = [memtier.rank_dir(tmp_path / f"mem-{rank}", rank) for rank in range(2)]
    for rank in range(2):
        assert memtier.own_steps(mem[rank]) == [4]  # step 2 dropped once 4 was complete
        kept = [e for e in saved.result(rank)["events"] if e["phase"] == "memory_kept"]
        assert [e["step"] for e in kept][-1] == 4
        assert (mem[(rank + 1) % 2] / "peer" / f"rank-{rank}" / "step-4").is_dir()

    # a flipped byte in rank 0's own copy and in its replica: never loaded
    flipped = [
        memtier.own_folder(mem[0], 4) / "__0_0.distcp",
        mem[1] / "peer" / "rank-0" / "step-4" / "__0_0.distcp",
    ]
    for path in flipped:
        shutil.copyfile(path, path.with_suffix(".good"))
        _flip(path)
    corrupt = _resume(base, tmp_path, "corrupt")
    assert [corrupt.result(r)["tier"] for r in range(2)] == ["local", "local"]
    refused = [e for e in corrupt.result(0)["events"] if e["phase"] == "memory_failed"]
    assert refused and "crc32c" in refused[0]["message"]
    streamed = [e["message"] for e in refused if "peer replica refused" in e["message"]]
    assert streamed and "__0_0.distcp from the peer: crc32c" in streamed[0], refused
    fallback = [e for e in corrupt.result(0)["events"] if e["phase"] == "restored"]
    assert fallback and "(local)" in fallback[0]["message"]
    _assert_same_state(saved, corrupt)
    for path in flipped:
        path.with_suffix(".good").replace(path)

    # rank 1's pod replaced: no volume, no own memory -> its replica on rank 0;
    # rank 0 loads its own memory copy, though its volume holds the step too
    shutil.rmtree(tmp_path / "pod-1")
    shutil.rmtree(memtier.own_root(mem[1]))
    lost = _resume(base, tmp_path, "lost")
    assert [lost.result(r)["tier"] for r in range(2)] == ["peer", "peer"]  # the job's summary
    assert [lost.result(r)["tiers"] for r in range(2)] == [["memory", "peer"]] * 2
    _assert_same_state(saved, lost)
    assert memtier.own_steps(mem[1]) == []  # read into the tensors, not kept in memory
    assert not any((mem[1] / "restore").iterdir())  # the fetched head files are gone
    assert not layout.step_dir(tmp_path / "pod-1", 4).exists()  # memory is not the volume


@pytest.mark.s3
def test_every_step_in_memory_s3_every_fourth(
    tmp_path: pathlib.Path, s3_server: typing.Any
) -> None:
    bucket = s3_server.new_bucket("every-step")
    job = ckpt_harness.launch(
        {
            "dir": str(tmp_path / "pod-{rank}"),
            "memory_dir": str(tmp_path / "mem-{rank}"),
            "interval": 1,
            "upload_interval": 4,
            "keep_last": 2,
            "steps": 10,
            "job_uid": UID,
            "keyring": manifest_mod.dump_keyring(RING).decode(),
            "s3": ckpt_harness.s3_cfg(s3_server, bucket),
        },
        world=2,
        tmp=tmp_path,
        name="every-step",
    )
    job.wait()
    keys = ckpt_harness.bucket_keys(s3_server, bucket)
    remote = sorted(int(k.split("/")[2].split("-")[1]) for k in keys if k.endswith("manifest.json"))
    assert remote == [4, 8, 10]  # every 4th, and the last one at the clean end
    for rank in range(2):
        events = job.result(rank)["events"]
        assert sorted(e["step"] for e in events if e["phase"] == "committed") == list(range(1, 11))
        assert not [e for e in events if e["phase"] == "upload_failed"]
        pod = tmp_path / f"pod-{rank}"
        # keep_last 2: the local-only steps rotated without an upload (none kept over budget)
        assert sorted(layout.step_dirs(pod)) == [9, 10]
        assert layout.is_local_only(layout.step_dir(pod, 9))
        last = layout.step_dir(pod, 10)
        assert layout.is_uploaded(last) and not layout.is_local_only(last)
        assert layout.read_manifest(last).tiers == ("memory", "peer", "volume")
        assert memtier.own_steps(memtier.rank_dir(tmp_path / f"mem-{rank}", rank)) == [10]


def test_two_ranks_in_one_pod_keep_their_own_copies(tmp_path: pathlib.Path) -> None:
    """procsPerNode 2: both ranks share the pod's volume and its memory volume.
    Each keeps its own share in its own folder (before, both used one folder:
    each replaced or deleted the other's copy, `memory_failed` on every save),
    and a restart in place loads both from memory."""
    base = _base(tmp_path, volume="pod", memory="mem")
    saved = _save(base, tmp_path)
    for rank in range(2):
        events = saved.result(rank)["events"]
        assert not [e for e in events if e["phase"] == "memory_failed"], events
        assert memtier.own_steps(memtier.rank_dir(tmp_path / "mem", rank)) == [4]
    resumed = _resume(base, tmp_path, "in-place")
    assert [resumed.result(r)["tier"] for r in range(2)] == ["memory", "memory"]
    _assert_same_state(saved, resumed)
