"""The one-pass write (`cairn.checkpoint.writer`), one process, real files.

Covers:
- a DCP save through `ChecksummingWriter` (2 write threads, tensors, bytes,
  plain objects) records every file it wrote, `.metadata` included (written
  as `.metadata.tmp`, renamed), with the size and CRC32C a read-back gives;
- each file is fsynced exactly once, by the stream's close (DCP's own
  `sync_files` is off);
- an empty file and a multi-byte-format buffer are counted as bytes;
- a stream that seeks, or is used through a method the wrapper does not
  see through, gets no record; a file that fails while written keeps none;
  a file removed by DCP loses its record;
- `entries` takes recorded files as counted and reads back (and fsyncs) a
  file with no record, e.g. one left by an earlier try of the step;
- the files carry no torch.save zip CRC32 (all zero) and load back bit for
  bit; the skip holds only in the writing thread (a concurrent torch.save
  elsewhere keeps its CRC32) and ends with the block.
"""

from __future__ import annotations

import io
import os
import pathlib
import threading
import typing
import zipfile

import pytest
import torch
from torch.distributed.checkpoint import filesystem, state_dict_loader, state_dict_saver

from cairn.checkpoint import layout, writer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def state() -> dict[str, typing.Any]:
    torch.manual_seed(0)
    return {
        "weights": torch.randn(300, 200),
        "ints": torch.arange(1000, dtype=torch.int64),
        "blob": io.BytesIO(b"a byte entry"),
        "plain": {"lr": 0.1, "name": "adamw"},
    }


def test_save_records_every_file_as_a_read_back_gives(tmp_path: pathlib.Path) -> None:
    dcp_writer = writer.ChecksummingWriter(tmp_path, thread_count=2)
    state_dict_saver.save(state(), storage_writer=dcp_writer, no_dist=True)
    recorded = dcp_writer.checksum_fs.checksums()
    on_disk = sorted(p.name for p in tmp_path.iterdir())
    assert sorted(recorded) == on_disk == [".metadata", "__0_0.distcp", "__0_1.distcp"]
    for name, record in recorded.items():
        assert (record.size, record.crc32c) == layout.file_crc32c(tmp_path / name), name


def test_each_file_is_fsynced_once_by_the_stream(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    dcp_writer = writer.ChecksummingWriter(tmp_path, thread_count=2)
    assert dcp_writer.sync_files is False  # DCP's own fsync would be a second one
    state_dict_saver.save(state(), storage_writer=dcp_writer, no_dist=True)
    assert sorted(synced) == [".metadata.tmp", "__0_0.distcp", "__0_1.distcp"]


def test_empty_file_and_float_buffer_are_counted_as_bytes(tmp_path: pathlib.Path) -> None:
    fs = writer.ChecksummingFileSystem()
    with fs.create_stream(tmp_path / "empty", "wb") as stream:
        stream.close()
    floats = torch.randn(257)
    with fs.create_stream(tmp_path / "floats", "wb") as stream:
        assert stream.write(floats.numpy().data) == 257 * 4
    recorded = fs.checksums()
    assert (recorded["empty"].size, recorded["empty"].crc32c) == (0, "00000000")
    assert (recorded["floats"].size, recorded["floats"].crc32c) == layout.file_crc32c(
        tmp_path / "floats"
    )


@pytest.mark.parametrize(
    "misuse",
    [
        pytest.param(lambda s: (s.write(b"abcdef"), s.seek(0), s.write(b"X")), id="seek"),
        pytest.param(lambda s: s.writelines([b"ab", b"cd"]), id="writelines"),
    ],
)
def test_a_stream_not_followed_whole_gets_no_record(
    tmp_path: pathlib.Path, misuse: typing.Callable[[typing.Any], object]
) -> None:
    fs = writer.ChecksummingFileSystem()
    with fs.create_stream(tmp_path / "f", "wb") as stream:
        misuse(stream)
    assert fs.checksums() == {}


def test_a_file_that_fails_while_written_keeps_no_record(tmp_path: pathlib.Path) -> None:
    fs = writer.ChecksummingFileSystem()
    with (
        pytest.raises(RuntimeError, match="disk gone"),
        fs.create_stream(tmp_path / "f", "wb") as stream,
    ):
        stream.write(b"partial")
        raise RuntimeError("disk gone")
    assert fs.checksums() == {}


def test_rename_moves_the_record_and_removal_drops_it(tmp_path: pathlib.Path) -> None:
    fs = writer.ChecksummingFileSystem()
    with fs.create_stream(tmp_path / "a.tmp", "wb") as stream:
        stream.write(b"metadata")
    fs.rename(tmp_path / "a.tmp", tmp_path / "a")
    assert list(fs.checksums()) == ["a"]
    fs.rm_file(tmp_path / "a")
    assert fs.checksums() == {}


def test_entries_read_back_a_file_without_record(tmp_path: pathlib.Path) -> None:
    dcp_writer = writer.ChecksummingWriter(tmp_path, thread_count=1)
    state_dict_saver.save(state(), storage_writer=dcp_writer, no_dist=True)
    stale = tmp_path / "__0_7.distcp"  # left by an earlier try of this step
    stale.write_bytes(b"earlier try")
    names = ["__0_0.distcp", "__0_7.distcp", ".metadata"]
    got = writer.entries(tmp_path, names, rank=0, written=dcp_writer.checksum_fs.checksums())
    assert got == [layout.entry_for(tmp_path, name, rank=0) for name in names]


def _zip_crcs(data: bytes) -> list[int]:
    """The CRC32 fields of a torch.save archive's records."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        return [info.CRC for info in archive.infolist()]


def _saved(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


def test_checkpoint_files_have_no_zip_crc32_and_load_bit_for_bit(tmp_path: pathlib.Path) -> None:
    saved = state()
    dcp_writer = writer.ChecksummingWriter(tmp_path, thread_count=2)
    state_dict_saver.save(saved, storage_writer=dcp_writer, no_dist=True)
    meta = filesystem.FileSystemReader(tmp_path).read_metadata()
    archives = [
        (tmp_path / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
        for index, info in meta.storage_data.items()
        if index.fqn in ("weights", "ints")  # tensors: one torch.save archive each
    ]
    assert len(archives) == 2
    for archive in archives:
        assert set(_zip_crcs(archive)) == {0}  # torch.save's CRC32 was skipped
    loaded = {"weights": torch.zeros(300, 200), "ints": torch.zeros(1000, dtype=torch.int64)}
    state_dict_loader.load(loaded, storage_reader=filesystem.FileSystemReader(tmp_path))
    assert torch.equal(loaded["weights"], saved["weights"])
    assert torch.equal(loaded["ints"], saved["ints"])


def test_zip_crc32_is_skipped_only_in_the_writing_thread() -> None:
    tensor = torch.arange(100, dtype=torch.float32)
    assert 0 not in _zip_crcs(_saved(tensor))  # torch's default outside the writer
    elsewhere: list[bytes] = []
    with writer.skip_zip_crc32():
        assert set(_zip_crcs(_saved(tensor))) == {0}
        # A torch.save of the training thread meanwhile keeps its CRC32.
        other = threading.Thread(target=lambda: elsewhere.append(_saved(tensor)))
        other.start()
        other.join()
    assert 0 not in _zip_crcs(elsewhere[0])
    assert 0 not in _zip_crcs(_saved(tensor))  # restored when the block ends
    assert torch.equal(torch.load(io.BytesIO(elsewhere[0]), weights_only=True), tensor)
