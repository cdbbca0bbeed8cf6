"""The write phase's DCP storage writer: each file's CRC32C while DCP writes it.

`ChecksummingWriter` is DCP's `FileSystemWriter` with one change: every
stream DCP opens for writing is wrapped, so the bytes are checksummed
(CRC32C, awscrt, the same function as `layout.file_crc32c`) as they pass to
the file, and the file is fsynced exactly once, when DCP closes it. The
pipeline then builds the manifest entries from these records instead of
reading every file back (`entries`), so the write phase is one pass over
the bytes.

torch.save's own zip CRC32 is not computed for these files (`skip_zip_crc32`:
a software CRC32 that cost as much CPU as copying the bytes into the page
cache): `torch.load` never checks it (a flipped data byte loads silently),
while the CRC32C counted here is checked against the manifest before any
restore loads the file and by the store on upload. The switch is per
thread, so a `torch.save` elsewhere in the process keeps its CRC32.

A record exists only for a file that was followed from open to close: no
seek, no method the wrapper does not see through, and the size on disk
after the fsync equals the bytes counted. Any other file of the rank (one
left by an earlier try of the same step, or a stream DCP used in a way the
wrapper cannot follow) is read back and fsynced the old way
(`layout.entry_for`), so a manifest entry is always the file's true size
and CRC32C, and every file is durable before its entry is reported to rank
0 for the commit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import threading
import typing

import torch.serialization
from awscrt import checksums
from torch.distributed.checkpoint import filesystem

from cairn.api import manifest as manifest_mod
from cairn.checkpoint import layout

_THREAD = threading.local()
"""`.skip_zip_crc32`: this thread is inside `skip_zip_crc32()` (writing a checkpoint file)."""


def _install_zip_crc32_switch() -> None:
    """Make torch.save's CRC32 option answer False in a thread inside
    `skip_zip_crc32`, and torch's configured value everywhere else.

    torch.save reads the option (`torch.serialization.get_crc32_options`, a
    module global) each time it opens a zip writer; the process-wide setter
    (`set_crc32_options`) would also drop the CRC32 of a user's concurrent
    torch.save in the training thread, so the module function is wrapped
    once instead. If a torch version stops reading it, files keep their
    CRC32 (slower, same bytes otherwise); `test_ckpt_writer.py` says so."""
    current = torch.serialization.get_crc32_options
    if getattr(current, "_cairn_switch", False):
        return

    def get_crc32_options() -> bool:
        if getattr(_THREAD, "skip_zip_crc32", False):
            return False
        return bool(current())

    get_crc32_options._cairn_switch = True  # type: ignore[attr-defined]
    torch.serialization.get_crc32_options = get_crc32_options


_install_zip_crc32_switch()


@contextlib.contextmanager
def skip_zip_crc32() -> typing.Generator[None, None, None]:
    """In this thread, torch.save writes no zip CRC32 (zeros) until the block ends."""
    before = getattr(_THREAD, "skip_zip_crc32", False)
    _THREAD.skip_zip_crc32 = True
    try:
        yield
    finally:
        _THREAD.skip_zip_crc32 = before


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Checksum:
    """Size and CRC32C (8 hex digits) of a file, counted while it was written."""

    size: int
    crc32c: str


class _ChecksumStream:
    """A write stream that checksums what passes through it; fsync on close."""

    def __init__(self, raw: typing.Any) -> None:
        self._raw = raw
        self.crc = 0
        self.size = 0
        self.followed = True
        """False once the stream was used in a way the checksum cannot follow."""
        self.synced = False

    def write(self, data: typing.Any) -> int:
        view = memoryview(data).cast("B")
        written = self._raw.write(view)
        count = len(view) if written is None else written
        self.crc = checksums.crc32c(view[:count], self.crc)
        self.size += count
        return count

    def seek(self, *args: typing.Any) -> int:
        self.followed = False  # bytes may be overwritten: checksum afterwards
        return int(self._raw.seek(*args))

    def tell(self) -> int:
        return int(self._raw.tell())

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return int(self._raw.fileno())

    def writable(self) -> bool:
        return True

    @property
    def closed(self) -> bool:
        return bool(self._raw.closed)

    def close(self) -> None:
        if self._raw.closed:
            return
        self._raw.flush()
        os.fsync(self._raw.fileno())
        self.synced = True
        if os.fstat(self._raw.fileno()).st_size != self.size:
            self.followed = False
        self._raw.close()

    def __getattr__(self, name: str) -> typing.Any:
        # Anything else (writelines, truncate, ...) bypasses the checksum.
        self.followed = False
        return getattr(self._raw, name)


class ChecksummingFileSystem(filesystem.FileSystem):
    """DCP's local file system; write streams are checksummed and fsynced on
    close, and torch.save writes no zip CRC32 into them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: dict[str, Checksum | None] = {}

    @contextlib.contextmanager
    def create_stream(
        self, path: str | os.PathLike[str], mode: str
    ) -> typing.Generator[typing.Any, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        self._record(path, None)  # a file being written has no record yet
        with super().create_stream(path, mode) as raw, skip_zip_crc32():
            counting = _ChecksumStream(raw)
            yield counting
            counting.close()  # DCP closes it already; a no-op then
        if counting.followed and counting.synced:
            self._record(path, Checksum(size=counting.size, crc32c=f"{counting.crc:08x}"))

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)  # DCP's `.metadata.tmp` -> `.metadata`
        with self._lock:
            self._records[os.fspath(new_path)] = self._records.pop(os.fspath(path), None)

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        super().rm_file(path)
        self._record(path, None)

    def _record(self, path: str | os.PathLike[str], value: Checksum | None) -> None:
        with self._lock:
            self._records[os.fspath(path)] = value

    def checksums(self) -> dict[str, Checksum]:
        """File name -> checksum of every file followed whole since construction."""
        with self._lock:
            return {pathlib.Path(p).name: c for p, c in self._records.items() if c is not None}


class ChecksummingWriter(filesystem.FileSystemWriter):
    """`FileSystemWriter` whose files are checksummed while written, fsynced once.

    DCP's own `sync_files` is off: the stream's close fsyncs each file (data
    files and `.metadata.tmp` alike), so no file is fsynced twice.
    """

    def __init__(self, path: pathlib.Path, *, thread_count: int) -> None:
        super().__init__(path, sync_files=False, thread_count=thread_count)
        self.checksum_fs = ChecksummingFileSystem()
        self.fs = self.checksum_fs


def entries(
    folder: pathlib.Path,
    names: typing.Sequence[str],
    *,
    rank: int,
    written: typing.Mapping[str, Checksum],
) -> list[manifest_mod.FileEntry]:
    """Manifest entries of this rank's files: from `written` when recorded, else
    read back and fsynced (a file not followed whole while written)."""
    found: list[manifest_mod.FileEntry] = []
    for name in names:
        record = written.get(name)
        if record is None:
            layout.fsync_file(folder / name)
            found.append(layout.entry_for(folder, name, rank=rank))
        else:
            found.append(
                manifest_mod.FileEntry(path=name, size=record.size, crc32c=record.crc32c, rank=rank)
            )
    return found
