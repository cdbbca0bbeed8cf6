"""Reading DCP checkpoints as data, never code: every product read of DCP goes here.

DCP itself trusts its folder: `FileSystemReader.read_metadata` is a plain
unpickle of `.metadata` (any `__reduce__` in it runs), `DefaultLoadPlanner`
loads every entry the metadata declares as bytes with
`torch.load` with weights_only off, and the metadata's file references
(`relative_path`) are joined to the folder unchecked. Whoever can write a
job's volume, S3 prefix or import source could run code in its ranks. Here:

    read_metadata   `.metadata` through an allow-list unpickler (the DCP
                    metadata dataclasses, torch.Size, dtypes/layouts and plain
                    containers only), optionally pinned by its SHA-256
                    (`resume.sha256`, checked before unpickling), then
                    `check_metadata`
    check_metadata  pure: the structure is DCP's, every file reference is a
                    safe relative path inside the folder and in the allowed
                    file set (a Cairn step: its manifest's files), offsets and
                    lengths are non-negative, no stream transforms
    check_bytes     every bytes entry stored in the given files loads with
                    `torch.load(weights_only=True)` (restore vets this before
                    it loads anything: `cairn.checkpoint.vet`)
    load            DCP load with `Reader` (serves the already-checked
                    metadata; never re-reads it; tensor entries whose saved
                    layout is the target's are read straight into it,
                    `cairn.checkpoint.tensorread`; data files of a peer's
                    replica are read from its connection,
                    `cairn.checkpoint.peerread`) and `Planner` (bytes
                    entries with weights_only=True)

Anything refused raises `UnsafeCheckpointError` naming the refused class,
path or key; nothing from the checkpoint runs. Data files of tensors are read
by DCP with `torch.load(weights_only=True)` already.
"""

from __future__ import annotations

import collections
import hashlib
import io
import pathlib
import pickle
import re
import typing

import torch
import torch.distributed as dist
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import api as dcp_api
from torch.distributed.checkpoint import default_planner, filesystem, planner, state_dict_loader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.futures import Future

from cairn.api import manifest as manifest_mod
from cairn.checkpoint import errors, layout, peerread, tensorread

METADATA = ".metadata"
MAX_METADATA_BYTES = 1 << 30
"""A `.metadata` larger than this is refused unread (a 70B-parameter FSDP
checkpoint's is tens of MiB)."""
_SHOW = 300


class UnsafeCheckpointError(errors.CheckpointError):
    """The checkpoint holds something that is not plain checkpoint data (a
    class outside the allow-list, a file reference outside its folder or its
    file list, a bytes entry that is not weights-only data). Never loaded."""


def _torch_constants() -> dict[tuple[str, str], object]:
    """torch.float32, torch.strided, torch.contiguous_format...: pickled by name."""
    kinds = (torch.dtype, torch.layout, torch.memory_format)
    return {
        ("torch", name): value for name, value in vars(torch).items() if isinstance(value, kinds)
    }


_ALLOWED: dict[tuple[str, str], object] = {
    **{
        ("torch.distributed.checkpoint.metadata", cls.__name__): cls
        for cls in (
            dcp_metadata.Metadata,
            dcp_metadata.TensorStorageMetadata,
            dcp_metadata.BytesStorageMetadata,
            dcp_metadata.ChunkStorageMetadata,
            dcp_metadata.TensorProperties,
            dcp_metadata.MetadataIndex,
            dcp_metadata.StorageMeta,
            dcp_metadata._MEM_FORMAT_ENCODING,
        )
    },
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): filesystem._StorageInfo,
    ("torch", "Size"): torch.Size,
    # How torch pickles a torch.layout: a lookup by name (raises for unknown names).
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    # StorageMeta.checkpoint_id: the folder it was saved to (never used to read).
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib._local", "PosixPath"): pathlib.PosixPath,
    ("pathlib._local", "PurePosixPath"): pathlib.PurePosixPath,
    ("collections", "OrderedDict"): collections.OrderedDict,
    **_torch_constants(),
}
"""Every global a DCP `.metadata` may name, and what it resolves to. Each is
safe to call with any arguments (pickle's REDUCE calls them): a dataclass,
an enum, torch.Size, a name lookup, a path constructor."""


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the allow-listed globals; persistent ids are refused by
    pickle itself (no `persistent_load`)."""

    def find_class(self, module: str, name: str) -> typing.Any:
        found = _ALLOWED.get((module, name))
        if found is None:
            raise UnsafeCheckpointError(
                f"{METADATA} names {module}.{name}, which is not part of DCP metadata:"
                " refused, nothing was run"
            )
        return found


def unpickle_metadata(raw: bytes) -> object:
    """The object in `raw` if it uses allow-listed globals only. Raises
    UnsafeCheckpointError otherwise (or for bytes that are not a pickle)."""
    try:
        return _MetadataUnpickler(io.BytesIO(raw)).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # garbage can raise almost anything; none of it ran code
        raise UnsafeCheckpointError(f"{METADATA} is not readable DCP metadata: {exc!r}") from None


def read_metadata(
    folder: pathlib.Path,
    *,
    allowed: typing.Collection[str] | None = None,
    sha256: str | None = None,
) -> dcp_metadata.Metadata:
    """The checked DCP metadata of `folder` (see `check_metadata` for `allowed`).

    Raises ConfigurationError when `sha256` is given and differs (before
    unpickling), UnsafeCheckpointError for anything refused, CheckpointError
    when `.metadata` is absent, a symlink or too large.
    """
    try:
        path = layout.safe_target(folder, METADATA)
    except manifest_mod.UnsafePathError as exc:
        raise UnsafeCheckpointError(f"{folder}: {exc}") from None
    if not path.is_file():
        raise errors.CheckpointError(f"{folder} is not a DCP checkpoint: no {METADATA}")
    with path.open("rb") as stream:
        raw = stream.read(MAX_METADATA_BYTES + 1)
    if len(raw) > MAX_METADATA_BYTES:
        raise UnsafeCheckpointError(f"{path} is larger than {MAX_METADATA_BYTES} bytes: not read")
    check_sha256(raw, pinned=sha256, what=str(path))
    return check_metadata(unpickle_metadata(raw), allowed=allowed)


def check_sha256(raw: bytes, *, pinned: str | None, what: str) -> None:
    """ConfigurationError unless `raw` has the pinned SHA-256 (None: no pin). Pure."""
    if pinned is None:
        return
    found = hashlib.sha256(raw).hexdigest()
    if found != pinned:
        raise errors.ConfigurationError(
            f"{what} has sha256 {found}, resume.sha256 pins {pinned}: it is not the"
            " checkpoint that was reviewed; not read"
        )


# -- structure and file references (pure) ------------------------------------------------


def check_metadata(
    meta: object, *, allowed: typing.Collection[str] | None
) -> dcp_metadata.Metadata:
    """`meta` as DCP metadata whose file references are safe. Pure.

    `allowed`: the only files it may reference (None: any safe relative
    path; the caller then checks each referenced file exists). Raises
    UnsafeCheckpointError naming the first problem.
    """
    if type(meta) is not dcp_metadata.Metadata:
        raise UnsafeCheckpointError(f"{METADATA} holds {type(meta).__name__}, not DCP Metadata")
    entries = meta.state_dict_metadata
    if not isinstance(entries, dict) or not all(isinstance(k, str) for k in entries):
        raise UnsafeCheckpointError(f"{METADATA}: state_dict_metadata is not a dict of keys")
    for key, item in entries.items():
        _check_item(key, item)
    storage = meta.storage_data
    if not isinstance(storage, dict):
        raise UnsafeCheckpointError(f"{METADATA}: storage_data is {type(storage).__name__}")
    for index, info in storage.items():
        _check_storage(index, info, allowed=allowed)
    if meta.storage_meta is not None and type(meta.storage_meta) is not dcp_metadata.StorageMeta:
        raise UnsafeCheckpointError(f"{METADATA}: storage_meta is not StorageMeta")
    return meta


def _check_item(key: str, item: object) -> None:
    if type(item) is dcp_metadata.BytesStorageMetadata:
        return
    if type(item) is not dcp_metadata.TensorStorageMetadata:
        raise UnsafeCheckpointError(f"{METADATA}: {key!r} is a {type(item).__name__}")
    props = item.properties
    if type(props) is not dcp_metadata.TensorProperties or not isinstance(props.dtype, torch.dtype):
        raise UnsafeCheckpointError(f"{METADATA}: {key!r} has no valid tensor properties")
    if not _is_size(item.size) or not isinstance(item.chunks, list):
        raise UnsafeCheckpointError(f"{METADATA}: {key!r} has no valid size or chunks")
    for chunk in item.chunks:
        if type(chunk) is not dcp_metadata.ChunkStorageMetadata or not (
            _is_size(chunk.offsets) and _is_size(chunk.sizes)
        ):
            raise UnsafeCheckpointError(f"{METADATA}: {key!r} has an invalid chunk")


def _is_size(value: object) -> bool:
    return isinstance(value, torch.Size) and all(_is_count(v) for v in value)


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0


def _check_storage(index: object, info: object, *, allowed: typing.Collection[str] | None) -> None:
    if type(index) is not dcp_metadata.MetadataIndex or not isinstance(index.fqn, str):
        raise UnsafeCheckpointError(f"{METADATA}: a storage key is {type(index).__name__}")
    if type(info) is not filesystem._StorageInfo or not isinstance(info.relative_path, str):
        raise UnsafeCheckpointError(f"{METADATA}: {index.fqn!r} has no valid storage info")
    path = info.relative_path
    try:
        manifest_mod.check_relative_path(path)
    except manifest_mod.UnsafePathError as exc:
        raise UnsafeCheckpointError(
            f"{METADATA}: {index.fqn!r} refers to a file outside the folder: {exc}"
        ) from None
    if allowed is not None and path not in allowed:
        raise UnsafeCheckpointError(
            f"{METADATA}: {index.fqn!r} refers to {path!r}, which is not one of the"
            " checkpoint's listed files"
        )
    if not (_is_count(info.offset) and _is_count(info.length)):
        raise UnsafeCheckpointError(
            f"{METADATA}: {index.fqn!r} has offset {info.offset!r}, length {info.length!r}"
        )
    if info.transform_descriptors:
        # Cairn never writes stream transforms; a foreign one would pick code by name.
        raise UnsafeCheckpointError(
            f"{METADATA}: {index.fqn!r} needs stream transforms"
            f" {list(info.transform_descriptors)!r}: not supported"
        )


def referenced_files(meta: dcp_metadata.Metadata) -> set[str]:
    """Every data file the (checked) metadata refers to. Pure."""
    return {info.relative_path for info in (meta.storage_data or {}).values()}


# -- bytes entries ----------------------------------------------------------------------


def load_bytes(
    stream: typing.IO[bytes], *, key: str, map_location: str | None = None, kind: str = "bytes"
) -> object:
    """One `kind` ("bytes" or "tensor") entry as weights-only data;
    UnsafeCheckpointError naming `key` else. (`map_location` None: tensors in
    it go where they were saved, as in DCP.)"""
    try:
        return torch.load(stream, map_location=map_location, weights_only=True)
    except Exception as exc:  # weights_only refuses with UnpicklingError; garbage varies
        raise UnsafeCheckpointError(
            f"{kind} entry {key!r} is not weights-only data: {_weights_only_reason(exc)}"
        ) from None


def _weights_only_reason(exc: Exception) -> str:
    """torch's refusal without its advice (which is to turn weights_only off)."""
    text = str(exc)
    found = re.search(r"WeightsUnpickler error: ([^\n]*)|([^\n]*GLOBAL [^\n]*)", text)
    reason = next((g for g in found.groups() if g), "") if found else ""
    return (reason or f"{type(exc).__name__}: {text}")[:_SHOW]


def check_bytes(
    folder: pathlib.Path, meta: dcp_metadata.Metadata, *, files: typing.Collection[str]
) -> int:
    """Load every bytes entry stored in `files` (relative paths in `folder`) with
    weights_only=True; returns how many. Raises UnsafeCheckpointError."""
    checked = 0
    wanted = set(files)
    for index, info in sorted(meta.storage_data.items(), key=lambda kv: kv[0].fqn):
        item = meta.state_dict_metadata.get(index.fqn)
        if type(item) is not dcp_metadata.BytesStorageMetadata or info.relative_path not in wanted:
            continue
        try:
            target = layout.safe_target(folder, info.relative_path)
        except manifest_mod.UnsafePathError as exc:
            raise UnsafeCheckpointError(f"{index.fqn!r}: {exc}") from None
        with target.open("rb") as stream:
            stream.seek(info.offset)
            blob = stream.read(info.length)
        if len(blob) != info.length:
            raise UnsafeCheckpointError(
                f"bytes entry {index.fqn!r}: {info.relative_path} is shorter than the metadata says"
            )
        # On CPU: vetting a GPU checkpoint needs no GPU.
        load_bytes(io.BytesIO(blob), key=index.fqn, map_location="cpu")
        checked += 1
    return checked


# -- loading -----------------------------------------------------------------------------


class Reader(filesystem.FileSystemReader):
    """A FileSystemReader that serves metadata already read and checked here
    (never `pickle.load`s `.metadata` itself) and re-checks its file references."""

    def __init__(
        self,
        folder: pathlib.Path,
        *,
        meta: dcp_metadata.Metadata,
        allowed: typing.Collection[str] | None,
        streams: peerread.PeerFiles | None = None,
    ) -> None:
        super().__init__(folder)
        self.counts = tensorread.Counts()
        self._checked = check_metadata(meta, allowed=allowed)
        self._streams = streams
        for path in referenced_files(self._checked):
            try:
                layout.safe_target(folder, path)
            except manifest_mod.UnsafePathError as exc:
                raise UnsafeCheckpointError(str(exc)) from None

    def read_data(self, plan: planner.LoadPlan, planner_: planner.LoadPlanner) -> Future[None]:
        """DCP's `read_data`, except that tensor entries whose saved layout is
        the target's are read straight into it (`cairn.checkpoint.tensorread`:
        one copy instead of two); every other entry is read as DCP does.
        A file `streams` names is read from the peer's replica instead
        (`cairn.checkpoint.peerread`), with the same split."""
        per_file: dict[str, list[planner.ReadItem]] = collections.defaultdict(list)
        for req in plan.items:
            per_file[self.storage_data[req.storage_index].relative_path].append(req)

        def fallback(stream: typing.BinaryIO, req: planner.ReadItem) -> None:
            self._read_entry(stream, req, planner_)

        for relative_path, reqs in per_file.items():
            if self._streams is not None and relative_path in self._streams.entries:
                peerread.read_file(
                    self._streams,
                    relative_path,
                    reqs,
                    meta=self._checked,
                    load_planner=planner_,
                    fallback=fallback,
                    counts=self.counts,
                )
                continue
            tensorread.read_file(
                self.fs.concat_path(self.path, relative_path),
                reqs,
                storage_data=self.storage_data,
                load_planner=planner_,
                fallback=fallback,
                counts=self.counts,
            )
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_entry(
        self, stream: typing.BinaryIO, req: planner.ReadItem, planner_: planner.LoadPlanner
    ) -> None:
        """One entry DCP's way (`FileSystemReader.read_data`'s loop body; the
        metadata allows no stream transforms, `check_metadata`)."""
        entry = self._slice_file(stream, self.storage_data[req.storage_index])
        if req.type == planner.LoadItemType.BYTE_IO:
            planner_.load_bytes(req, io.BytesIO(entry.read(-1)))
            return
        fqn = req.storage_index.fqn
        loaded = load_bytes(entry, key=fqn, map_location="cpu", kind="tensor")
        if not isinstance(loaded, torch.Tensor):
            raise UnsafeCheckpointError(f"tensor entry {fqn!r} holds a {type(loaded).__name__}")
        tensor = narrow_tensor_by_index(loaded, req.storage_offsets, req.lengths)
        target = planner_.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise errors.CheckpointError(
                f"{fqn}: saved {tuple(tensor.size())}, wanted {tuple(target.size())}"
            )
        target.copy_(tensor)
        planner_.commit_tensor(req, target)

    def read_metadata(self, *args: typing.Any, **kwargs: typing.Any) -> dcp_metadata.Metadata:
        if kwargs.get("rank") is not None:
            raise UnsafeCheckpointError("rank-local DCP metadata is not read")
        meta = self._checked
        if meta.storage_meta is None:
            meta.storage_meta = dcp_metadata.StorageMeta()
        meta.storage_meta.load_id = self.load_id
        return meta


class Planner(default_planner.DefaultLoadPlanner):
    """DCP's default load planner, except that bytes entries load with
    `torch.load(weights_only=True)` (DCP's own turns weights_only off)."""

    def load_bytes(self, read_item: planner.ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        loaded = load_bytes(value, key=fqn)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def load(
    state_dict: dict[str, typing.Any],
    *,
    folder: pathlib.Path,
    meta: dcp_metadata.Metadata,
    allowed: typing.Collection[str] | None,
    process_group: dist.ProcessGroup | None,
    streams: peerread.PeerFiles | None = None,
) -> tensorread.Counts:
    """DCP-load `state_dict` in place from `folder` with checked `meta` (collective);
    how many tensor entries were read straight into their targets. `streams`:
    data files this rank reads from its peer's replica, not from `folder`.

    Raises UnsafeCheckpointError when any rank met a bytes entry that is not
    weights-only data, PeerReplicaError when any rank's file from its peer
    failed (DCP gathers every rank's failure, so every rank raises the same).
    """
    reader = Reader(folder, meta=meta, allowed=allowed, streams=streams)
    try:
        state_dict_loader.load(
            state_dict,
            storage_reader=reader,
            planner=Planner(),
            process_group=process_group,
            no_dist=process_group is None,
        )
    except dcp_api.CheckpointException as exc:
        for failure, _ in exc.failures.values():
            if isinstance(failure, UnsafeCheckpointError):
                raise UnsafeCheckpointError(str(failure)) from None
            if isinstance(failure, peerread.PeerReplicaError):
                raise peerread.PeerReplicaError(str(failure)) from None
        raise
    return reader.counts
