"""A rank's data files read from its peer's replica straight into the tensors they restore.

A restore from the peer's replica used to fetch the rank's files into pod
memory, then load them from there: on a 1.13 GiB checkpoint here 1.13 s to
receive and write the files (most of it the kernel giving the new files'
pages; receiving the same bytes into memory already touched took 0.40 s)
and 0.40 s to read them into the parameters. Here the DCP load
(`cairn.checkpoint.safedcp.Reader`) reads each data file from the peer's
connection (`peer.open_file`) in the file's order, as it would read it
from disk:

    tensor entry   whose target is a plain CPU tensor of the saved dtype and
                   shape (the step's `.metadata` says; `direct_target`):
                   the entry's head (zip headers and the tensor's pickle,
                   at most HEAD_BYTES) into a small buffer, the storage
                   record straight into the target's memory, the tail (zip
                   directory) into a small buffer. Then the entry is read
                   as torch reads it (`tensorread.record_offset`:
                   weights-only, meta, torch's own offset of the record)
                   and must have its record where it was received; else it
                   is read DCP's way from the received bytes.
    anything else  bytes entries, other targets, resharded reads: the whole
                   entry into a buffer, read DCP's way (`fallback`).
    gaps           bytes no read of this rank wants: counted, dropped.

Every byte goes through CRC32C in the file's order. The replica's record of
the file (size, CRC32C) must be the manifest's before a byte is taken, and
the CRC32C counted over all of them must be the manifest's at the end; a
file that does not match raises `PeerReplicaError`. By then the tensors
hold bytes that did not verify: restore treats the memory copy as failed
and loads the next copy (the volume's, S3's), which writes every tensor
again (`cairn.checkpoint.restore`); no step is ever trained on from them.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import re
import struct
import typing

import torch
from awscrt import checksums
from torch.distributed.checkpoint import filesystem, planner
from torch.distributed.checkpoint import metadata as dcp_metadata

from cairn.api import manifest as manifest_mod
from cairn.checkpoint import errors, peer, peerwire, tensorread

HEAD_BYTES = 64 * 1024
"""How much of a tensor entry is taken before its record is looked for:
torch's local headers and a tensor's pickle are well under 1 KiB."""
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_LOCAL_SIGNATURE = 0x04034B50
_STORAGE_RECORD = re.compile(rb"[^/]{1,200}/data/[0-9]{1,12}")
"""The name torch gives a storage record inside a saved object's zip."""

Fallback = typing.Callable[[typing.BinaryIO, planner.ReadItem], None]


class PeerReplicaError(errors.CheckpointError):
    """A data file from the peer's replica could not be read or did not match
    the manifest (size, CRC32C): the memory copy is not used."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PeerFiles:
    """The data files of this rank's share that the load reads from the peer."""

    address: tuple[str, int]
    key: bytes = dataclasses.field(repr=False)
    job_uid: str
    source_rank: int
    step: int
    entries: typing.Mapping[str, manifest_mod.FileEntry]
    """Each streamed file's manifest entry (its size and CRC32C), by name."""
    deadline_s: float

    def open(self, name: str) -> typing.ContextManager[peer.Incoming]:
        return peer.open_file(
            self.address,
            key=self.key,
            job_uid=self.job_uid,
            source_rank=self.source_rank,
            step=self.step,
            name=name,
            deadline_s=self.deadline_s,
        )


def direct_target(req: planner.ReadItem, target: torch.Tensor, meta: dcp_metadata.Metadata) -> bool:
    """Whether `req`'s record can be received straight into `target`: a
    plain contiguous CPU tensor, the whole saved chunk wanted, of the dtype
    and shape `.metadata` gives it. Pure (the entry itself is checked after
    it arrived)."""
    if req.type != planner.LoadItemType.TENSOR or not tensorread.whole_target(target, req):
        return False
    item = meta.state_dict_metadata.get(req.storage_index.fqn)
    if type(item) is not dcp_metadata.TensorStorageMetadata:
        return False
    if item.properties.dtype != target.dtype:
        return False
    chunk = next((c for c in item.chunks if c.offsets == req.storage_index.offset), None)
    return chunk is not None and list(chunk.sizes) == list(target.shape)


def record_start(head: bytes | bytearray, *, nbytes: int, length: int) -> int | None:
    """Where in an entry (whose first bytes are `head`) the storage record's
    data begins: after the first local zip header named like torch's storage
    records, if `nbytes` from there fit in the entry's `length` (the start may
    lie past `head`: its padding had not all arrived). A guess that
    the entry's own directory confirms afterwards (`tensorread.record_offset`).
    Pure."""
    pos = head.find(b"PK\x03\x04")
    while pos >= 0 and pos + _LOCAL_HEADER.size <= len(head):
        fields = _LOCAL_HEADER.unpack_from(head, pos)
        signature, method, name_len, extra_len = fields[0], fields[3], fields[9], fields[10]
        name_at = pos + _LOCAL_HEADER.size
        if name_at + name_len > len(head):
            return None  # a name cut off: not guessed from half of it
        name = bytes(head[name_at : name_at + name_len])
        if signature == _LOCAL_SIGNATURE and method == 0 and _STORAGE_RECORD.fullmatch(name):
            start = name_at + name_len + extra_len
            return start if start + nbytes <= length else None
        pos = head.find(b"PK\x03\x04", pos + 1)
    return None


class _Segments(io.RawIOBase):
    """A read-only file over buffers laid end to end from `base` (an entry's
    offset in its file): what DCP's reader and torch's zip reader read the
    received bytes through."""

    def __init__(self, parts: typing.Sequence[bytearray | memoryview], *, base: int) -> None:
        super().__init__()
        self._parts: list[tuple[int, memoryview]] = []
        at = base
        for part in parts:
            self._parts.append((at, memoryview(part).cast("B")))
            at += len(part)
        self._base = base
        self._end = at
        self._pos = base

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        where = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._end}[whence]
        if where + offset < self._base:
            raise OSError(f"seek to {where + offset}, before the received bytes at {self._base}")
        self._pos = where + offset
        return self._pos

    def readinto(self, buffer: typing.Any) -> int:
        out = memoryview(buffer).cast("B")
        for start, part in self._parts:
            if start <= self._pos < start + len(part):
                n = min(len(out), start + len(part) - self._pos)
                out[:n] = part[self._pos - start : self._pos - start + n]
                self._pos += n
                return n
        return 0


def _stream(parts: typing.Sequence[bytearray | memoryview], *, base: int) -> typing.BinaryIO:
    return typing.cast(typing.BinaryIO, io.BufferedReader(_Segments(parts, base=base)))


class _Receiver:
    """The file's bytes in order, each counted into the CRC32C once."""

    def __init__(self, incoming: peer.Incoming) -> None:
        self._chan = incoming.chan
        self.name = incoming.name
        self.left = incoming.size
        self.pos = 0
        self.crc = 0
        self._scratch: bytearray | None = None

    def into(self, view: memoryview) -> None:
        if len(view) > self.left:
            raise PeerReplicaError(
                f"{self.name}: an entry runs {len(view) - self.left} bytes past the file's end"
            )
        for start in range(0, len(view), peerwire.CHUNK):
            part = view[start : start + peerwire.CHUNK]
            self._chan.recv_into(part)
            self.crc = checksums.crc32c(part, self.crc)
        self.left -= len(view)
        self.pos += len(view)

    def take(self, n: int) -> bytearray:
        buf = bytearray(n)
        self.into(memoryview(buf))
        return buf

    def skip(self, n: int) -> None:
        while n:
            if self._scratch is None:
                self._scratch = bytearray(peerwire.CHUNK)
            part = min(n, len(self._scratch))
            self.into(memoryview(self._scratch)[:part])
            n -= part


def read_file(
    files: PeerFiles,
    name: str,
    reqs: typing.Sequence[planner.ReadItem],
    *,
    meta: dcp_metadata.Metadata,
    load_planner: planner.LoadPlanner,
    fallback: Fallback,
    counts: tensorread.Counts,
) -> None:
    """Serve every read of data file `name` from the peer (module docstring).
    Raises PeerReplicaError when the file cannot be had or does not match."""
    entry = files.entries[name]
    try:
        with files.open(name) as incoming:
            if incoming.size != entry.size or incoming.crc32c != entry.crc32c:
                raise PeerReplicaError(
                    f"{name}: the peer's replica is {incoming.size} bytes, crc32c"
                    f" {incoming.crc32c}; the manifest says {entry.size}, {entry.crc32c}"
                )
            rx = _Receiver(incoming)
            _serve(rx, reqs, meta=meta, load_planner=load_planner, fallback=fallback, counts=counts)
            rx.skip(rx.left)
    except peer.PeerUnavailable as exc:
        raise PeerReplicaError(f"{name} from the peer: {exc}") from exc
    got = f"{rx.crc:08x}"
    if got != entry.crc32c:
        raise PeerReplicaError(
            f"{name} from the peer: crc32c {got} != manifest {entry.crc32c}"
            " (the tensors read from it are written again from the next copy)"
        )


def _serve(
    rx: _Receiver,
    reqs: typing.Sequence[planner.ReadItem],
    *,
    meta: dcp_metadata.Metadata,
    load_planner: planner.LoadPlanner,
    fallback: Fallback,
    counts: tensorread.Counts,
) -> None:
    storage = meta.storage_data
    by_entry: dict[dcp_metadata.MetadataIndex, list[planner.ReadItem]] = collections.defaultdict(
        list
    )
    for req in reqs:
        by_entry[req.storage_index].append(req)
    for index in sorted(by_entry, key=lambda i: storage[i].offset):
        info: filesystem._StorageInfo = storage[index]
        group = by_entry[index]
        if info.offset < rx.pos:
            raise PeerReplicaError(
                f"{rx.name}: entries overlap at byte {info.offset}; read from the next copy"
            )
        rx.skip(info.offset - rx.pos)
        if len(group) == 1:
            target = load_planner.resolve_tensor(group[0]).detach() if _tensor(group[0]) else None
            nbytes = 0 if target is None else target.numel() * target.element_size()
            if (
                target is not None
                and nbytes < info.length
                and direct_target(group[0], target, meta)
            ):
                _direct(
                    rx,
                    info,
                    group[0],
                    target,
                    nbytes=nbytes,
                    load_planner=load_planner,
                    fallback=fallback,
                    counts=counts,
                )
                continue
        received = _stream([rx.take(info.length)], base=info.offset)
        for req in group:
            if _tensor(req):
                counts.fallback += 1
            fallback(received, req)


def _tensor(req: planner.ReadItem) -> bool:
    return req.type == planner.LoadItemType.TENSOR


def _direct(
    rx: _Receiver,
    info: filesystem._StorageInfo,
    req: planner.ReadItem,
    target: torch.Tensor,
    *,
    nbytes: int,
    load_planner: planner.LoadPlanner,
    fallback: Fallback,
    counts: tensorread.Counts,
) -> None:
    """Receive one tensor entry with its record straight into `target`."""
    head = rx.take(min(HEAD_BYTES, info.length - nbytes))
    start = record_start(head, nbytes=nbytes, length=info.length)
    if start is None:  # not torch's layout as expected: the whole entry, DCP's way
        received = _stream([head, rx.take(info.length - len(head))], base=info.offset)
        counts.fallback += 1
        fallback(received, req)
        return
    if start > len(head):  # the record's padding went past the head
        head += rx.take(start - len(head))
    view = tensorread.target_bytes(target)
    inside = max(0, min(len(head) - start, nbytes))  # record bytes that came with the head
    view[:inside] = head[start : start + inside]
    rx.into(view[inside:])
    tail_from_head = head[min(len(head), start + nbytes) :]
    tail = rx.take(info.length - start - nbytes - len(tail_from_head))
    parts: list[bytearray | memoryview] = [head[:start], view, tail_from_head + tail]
    entry_only = dataclasses.replace(info, offset=0)
    confirmed = tensorread.record_offset(_stream(parts, base=0), entry_only, target, req)
    if confirmed == start:
        load_planner.commit_tensor(req, target)
        counts.direct += 1
        return
    # torch places the record elsewhere (or refuses the entry): read it DCP's
    # way from the received bytes, which rewrites the target or raises.
    counts.fallback += 1
    fallback(_stream(parts, base=info.offset), req)
