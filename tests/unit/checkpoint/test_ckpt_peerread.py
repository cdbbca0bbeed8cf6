"""Data files read from a peer's replica straight into their tensors
(`cairn.checkpoint.peerread`): real `dcp.save` output, pushed to a real
`peer.ReplicaServer` on loopback, loaded through `safedcp.load(streams=...)`
with only `.metadata` on this side.

Covers: tensors of the target's layout are received straight in (counted)
and come back bit for bit beside a bytes entry; entries this rank does not
read are skipped; a dtype change, a non-contiguous target and a tensor
subclass go DCP's way with DCP's result; a guessed record start that
torch's reader does not confirm is read DCP's way from the received bytes;
a byte flipped in the peer's stored file fails the load with the CRC32C
(PeerReplicaError) once the file has been read; a replica whose record is
not the manifest's is refused before a byte is read (the targets keep their
bytes); a peer that is gone fails at once; a `__reduce__` payload streamed
in a tensor entry is refused and never runs; `record_start` finds torch's
record and declines a cut-off name, an entry without a storage record and
a record that would run past the entry.
"""

from __future__ import annotations

import dataclasses
import io
import pathlib
import shutil
import typing

import pytest
import torch

from cairn.api import manifest as manifest_mod
from cairn.checkpoint import layout, peer, peerread, safedcp, tensorread
from tests.unit.checkpoint.test_ckpt_tensorread import (
    Tagged,
    dcp_load,
    payload_checkpoint,
    save,
    saved_tensors,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

KEY = peer.derive_key(b"manifest-key-of-job-p")
JOB = "job-p-uid"


@pytest.fixture
def server(tmp_path: pathlib.Path) -> typing.Iterator[peer.ReplicaServer]:
    with peer.ReplicaServer(
        root=tmp_path / "srv", key=KEY, host="127.0.0.1", io_timeout_s=2.0
    ) as srv:
        yield srv


def replicate(
    folder: pathlib.Path, server: peer.ReplicaServer, head: pathlib.Path
) -> peerread.PeerFiles:
    """Push `folder` as rank 0's replica of step 1; `head` gets `.metadata` only."""
    data = sorted(p for p in folder.iterdir() if p.suffix == ".distcp")
    peer.push(
        server.address,
        key=KEY,
        job_uid=JOB,
        source_rank=0,
        step=1,
        files=[*data, folder / ".metadata"],
        deadline_s=30,
    )
    head.mkdir()
    shutil.copyfile(folder / ".metadata", head / ".metadata")
    entries = {}
    for path in data:
        size, crc = layout.file_crc32c(path)
        entries[path.name] = manifest_mod.FileEntry(path=path.name, size=size, crc32c=crc, rank=0)
    return peerread.PeerFiles(
        address=server.address,
        key=KEY,
        job_uid=JOB,
        source_rank=0,
        step=1,
        entries=entries,
        deadline_s=30,
    )


def stream_load(
    head: pathlib.Path, files: peerread.PeerFiles, state_dict: dict[str, typing.Any]
) -> tensorread.Counts:
    meta = safedcp.read_metadata(head)
    return safedcp.load(
        state_dict, folder=head, meta=meta, allowed=None, process_group=None, streams=files
    )


def stored(server: peer.ReplicaServer, name: str) -> pathlib.Path:
    return server.store / "rank-0" / "step-1" / name


def test_tensors_are_received_straight_into_their_targets(
    tmp_path: pathlib.Path, server: peer.ReplicaServer
) -> None:
    tensors = saved_tensors()
    save(tmp_path / "saved", {**tensors, "extra": {"note": "kept", "n": 3}})
    files = replicate(tmp_path / "saved", server, tmp_path / "head")
    targets: dict[str, typing.Any] = {k: torch.zeros_like(v) for k, v in tensors.items()}
    targets["extra"] = {"note": "", "n": 0}
    counts = stream_load(tmp_path / "head", files, targets)
    assert counts == tensorread.Counts(direct=4, fallback=0)
    for key, want in tensors.items():
        assert torch.equal(targets[key], want), key
    assert targets["extra"] == {"note": "kept", "n": 3}
    assert [p.name for p in (tmp_path / "head").iterdir()] == [".metadata"]  # nothing written


def test_entries_this_rank_does_not_read_are_skipped(
    tmp_path: pathlib.Path, server: peer.ReplicaServer
) -> None:
    tensors = saved_tensors()
    save(tmp_path / "saved", tensors)
    files = replicate(tmp_path / "saved", server, tmp_path / "head")
    targets = {"bias": torch.zeros_like(tensors["bias"])}
    assert stream_load(tmp_path / "head", files, targets) == tensorread.Counts(direct=1)
    assert torch.equal(targets["bias"], tensors["bias"])


@pytest.mark.parametrize(
    "target",
    [
        pytest.param(lambda: torch.zeros(64, 48, dtype=torch.float64), id="dtype-change"),
        pytest.param(lambda: torch.zeros(48, 64).t(), id="non-contiguous-target"),
        pytest.param(lambda: torch.zeros(64, 48).as_subclass(Tagged), id="subclass-target"),
    ],
)
def test_what_does_not_match_is_read_dcps_way_with_dcps_result(
    tmp_path: pathlib.Path,
    server: peer.ReplicaServer,
    target: typing.Callable[[], torch.Tensor],
) -> None:
    saved = saved_tensors()["w"]
    save(tmp_path / "saved", {"w": saved})
    files = replicate(tmp_path / "saved", server, tmp_path / "head")
    ours, theirs = {"w": target()}, {"w": target()}
    assert stream_load(tmp_path / "head", files, ours) == tensorread.Counts(fallback=1)
    dcp_load(tmp_path / "saved", theirs)
    assert torch.equal(ours["w"], theirs["w"])
    assert torch.equal(ours["w"].to(saved.dtype), saved)


def test_a_guess_torch_does_not_confirm_is_read_dcps_way(
    tmp_path: pathlib.Path, server: peer.ReplicaServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved = saved_tensors()["w"]
    save(tmp_path / "saved", {"w": saved})
    files = replicate(tmp_path / "saved", server, tmp_path / "head")
    real = peerread.record_start
    guesses: list[int] = []

    def early(head: bytes | bytearray, *, nbytes: int, length: int) -> int | None:
        found = real(head, nbytes=nbytes, length=length)
        assert found is not None and found >= 64
        guesses.append(found - 64)  # 64 bytes early: part of the zip header lands in the target
        return found - 64

    monkeypatch.setattr(peerread, "record_start", early)
    targets = {"w": torch.zeros_like(saved)}
    assert stream_load(tmp_path / "head", files, targets) == tensorread.Counts(fallback=1)
    assert guesses and torch.equal(targets["w"], saved)


def test_a_byte_flipped_in_the_peers_file_fails_the_load(
    tmp_path: pathlib.Path, server: peer.ReplicaServer
) -> None:
    saved = saved_tensors()
    save(tmp_path / "saved", saved)
    files = replicate(tmp_path / "saved", server, tmp_path / "head")
    (name,) = files.entries
    path = stored(server, name)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # the replica record still says the old CRC32C
    path.write_bytes(bytes(data))
    targets = {k: torch.zeros_like(v) for k, v in saved.items()}
    with pytest.raises(peerread.PeerReplicaError, match=rf"{name} from the peer: crc32c \w+ != "):
        stream_load(tmp_path / "head", files, targets)


def test_a_replica_that_is_not_the_manifests_is_refused_before_reading(
    tmp_path: pathlib.Path, server: peer.ReplicaServer
) -> None:
    saved = saved_tensors()
    save(tmp_path / "saved", saved)
    files = replicate(tmp_path / "saved", server, tmp_path / "head")
    (name, entry), *_ = files.entries.items()
    other = "00000000" if entry.crc32c != "00000000" else "00000001"
    files = dataclasses.replace(files, entries={name: entry.model_copy(update={"crc32c": other})})
    targets = {k: torch.full_like(v, 7) for k, v in saved.items()}
    with pytest.raises(peerread.PeerReplicaError, match="the manifest says"):
        stream_load(tmp_path / "head", files, targets)
    for key, value in targets.items():
        assert torch.equal(value, torch.full_like(saved[key], 7)), key


def test_a_peer_that_is_gone_fails_the_load(
    tmp_path: pathlib.Path, server: peer.ReplicaServer
) -> None:
    save(tmp_path / "saved", {"w": torch.ones(4, 4)})
    files = replicate(tmp_path / "saved", server, tmp_path / "head")
    server.close()
    with pytest.raises(peerread.PeerReplicaError, match=r"from the peer: .*connect failed"):
        stream_load(tmp_path / "head", files, {"w": torch.zeros(4, 4)})


def test_a_reduce_payload_streamed_is_refused_and_never_runs(
    tmp_path: pathlib.Path, server: peer.ReplicaServer
) -> None:
    marker = tmp_path / "ran"
    payload_checkpoint(tmp_path / "saved", marker)
    files = replicate(tmp_path / "saved", server, tmp_path / "head")
    with pytest.raises(safedcp.UnsafeCheckpointError, match=r"'w' is not weights-only"):
        stream_load(tmp_path / "head", files, {"w": torch.zeros(4, 8)})
    assert not marker.exists()


def entry_bytes(tensor: torch.Tensor) -> bytes:
    blob = io.BytesIO()
    torch.save(tensor, blob)
    return blob.getvalue()


def test_record_start_finds_torchs_record() -> None:
    tensor = torch.arange(100, dtype=torch.float32)
    data = entry_bytes(tensor)
    start = peerread.record_start(data[:4096], nbytes=400, length=len(data))
    assert start is not None
    assert data[start : start + 400] == tensor.numpy().tobytes()


def test_record_start_declines_what_it_cannot_place() -> None:
    data = entry_bytes(torch.arange(100, dtype=torch.float32))
    start = peerread.record_start(data, nbytes=400, length=len(data))
    assert start is not None
    name_end = data.rfind(b"/data/0", 0, start) + len(b"/data/0")
    # the storage record's name cut off by the end of the head
    assert peerread.record_start(data[: name_end - 1], nbytes=400, length=len(data)) is None
    # a record that would run past the entry
    assert peerread.record_start(data, nbytes=len(data), length=len(data)) is None
    # no storage record at all (a bytes entry)
    blob = io.BytesIO()
    torch.save({"n": 3}, blob)
    assert peerread.record_start(blob.getvalue(), nbytes=8, length=len(blob.getvalue())) is None
