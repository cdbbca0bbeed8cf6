"""Tensor entries of a DCP data file read straight into the tensors they restore.

DCP's `FileSystemReader` hands every tensor entry to `torch.load`, which
reads it into a new tensor (fresh pages, one copy), and then copies that
into the tensor being restored (a second copy): for a 1.13 GiB checkpoint in
`/dev/shm`, 0.61 s of a 0.98 s restore was `torch.load` filling new
storages (cProfile, 2 cores). Where the saved entry has exactly the target's
layout, its bytes are read from the file into the target's memory instead:
one copy, into pages the model already holds.

    layout       `torch.load(entry, map_location="meta", weights_only=True)`:
                 the entry's pickle through torch's weights-only unpickler
                 (never plain pickle), no data read, and torch's own offset of
                 the storage record inside the entry (`_checkpoint_offset`,
                 what torch's meta and mmap loads use)
    direct read  only when everything agrees: the target a plain dense CPU
                 tensor, contiguous and non-empty; the saved tensor
                 contiguous, of the same dtype and shape, starting its
                 storage and filling it; the whole tensor wanted (no
                 resharding narrow); the record inside the entry; saved
                 little-endian on a little-endian host. Then `os.preadv`
                 into the target's bytes.
    otherwise    None: the caller reads the entry DCP's way (same result,
                 slower). A file that ends early (a Cairn step's files are
                 size- and CRC32C-checked before; an imported folder's are
                 not) goes to that fallback too, which rewrites the target
                 or raises.

Which path each entry took is counted (`Counts`) for tests and benches.
"""

from __future__ import annotations

import dataclasses
import io
import os
import sys
import typing

import torch
from torch.distributed.checkpoint import filesystem, planner
from torch.distributed.checkpoint import metadata as dcp_metadata

_BYTEORDER = "byteorder"


@dataclasses.dataclass
class Counts:
    """Tensor entries read straight into their targets, and those read DCP's way."""

    direct: int = 0
    fallback: int = 0


def target_bytes(target: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (any dtype:
    viewed as uint8 first, so bfloat16 needs no numpy dtype). `view`, never
    `reshape`: a copy would take the bytes and leave the target as it was."""
    flat = target.view(-1).view(torch.uint8)
    return memoryview(typing.cast(typing.Any, flat.numpy())).cast("B")


def _plain_cpu(target: torch.Tensor) -> bool:
    """A plain dense CPU tensor whose bytes are its values (no subclass, no
    quantized or sparse layout, no lazy conjugate/negative view)."""
    return (
        type(target) is torch.Tensor
        and target.device.type == "cpu"
        and target.layout == torch.strided
        and not target.is_quantized
        and not target.is_conj()
        and not target.is_neg()
    )


def whole_target(target: torch.Tensor, req: planner.ReadItem) -> bool:
    """Whether `req` fills all of `target` and `target`'s memory is its values
    in order: a plain dense contiguous CPU tensor, not empty, no resharding
    narrow. What a read straight into it needs of the target. Pure."""
    return (
        _plain_cpu(target)
        and target.is_contiguous()
        and target.numel() > 0
        and list(req.storage_offsets) == [0] * target.dim()
        and list(req.lengths) == list(target.shape)
    )


def record_offset(
    stream: typing.BinaryIO,
    info: filesystem._StorageInfo,
    target: torch.Tensor,
    req: planner.ReadItem,
) -> int | None:
    """The file offset of the entry's tensor bytes when they can be read
    straight into `target` (module docstring), else None. Reads the entry's
    zip directory and its pickle only."""
    if not whole_target(target, req) or sys.byteorder != "little":
        return None
    # DCP's own bounded view of one entry (what its reader gives torch.load).
    create_view = filesystem._create_file_view  # type: ignore[attr-defined]
    view = typing.cast(
        typing.IO[bytes], create_view(typing.cast(typing.Any, stream), info.offset, info.length)
    )
    try:
        zip_reader: typing.Any = torch._C.PyTorchFileReader(view)  # the stubs lack has_record
        if zip_reader.has_record(_BYTEORDER) and zip_reader.get_record(_BYTEORDER) != b"little":
            return None
        view.seek(0)
        saved = torch.load(view, map_location="meta", weights_only=True)
    except Exception:  # anything torch refuses here, DCP's own read reports
        return None
    if not isinstance(saved, torch.Tensor) or type(saved) is not torch.Tensor:
        return None
    nbytes = target.numel() * target.element_size()
    if (
        saved.dtype != target.dtype
        or saved.shape != target.shape
        or not saved.is_contiguous()
        or saved.storage_offset() != 0
        or saved.untyped_storage().nbytes() != nbytes
    ):
        return None
    offset = getattr(saved.untyped_storage(), "_checkpoint_offset", None)
    if not isinstance(offset, int) or offset < 0 or offset + nbytes > info.length:
        return None
    return info.offset + offset


def read_into(fd: int, target: torch.Tensor, offset: int) -> bool:
    """Fill `target` with the file's bytes from `offset`; False when the file
    ends first (the caller falls back, which reports the short file)."""
    view = target_bytes(target)
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            return False
        done += n
    return True


def read_file(
    path: str | os.PathLike[str],
    reqs: typing.Sequence[planner.ReadItem],
    *,
    storage_data: typing.Mapping[dcp_metadata.MetadataIndex, filesystem._StorageInfo],
    load_planner: planner.LoadPlanner,
    fallback: typing.Callable[[typing.BinaryIO, planner.ReadItem], None],
    counts: Counts,
) -> None:
    """Serve every read of one data file: tensor entries straight into their
    targets where `record_offset` allows, everything else by `fallback`
    (DCP's way for one entry, given the open file)."""
    with open(path, "rb", buffering=0) as raw:
        stream = typing.cast(typing.BinaryIO, io.BufferedReader(raw))
        for req in sorted(reqs, key=lambda r: storage_data[r.storage_index].offset):
            if req.type == planner.LoadItemType.TENSOR:
                info = storage_data[req.storage_index]
                target = load_planner.resolve_tensor(req).detach()
                offset = record_offset(stream, info, target, req)
                if offset is not None and read_into(raw.fileno(), target, offset):
                    load_planner.commit_tensor(req, target)
                    counts.direct += 1
                    continue
                counts.fallback += 1
            fallback(stream, req)
