"""Loading a verified Cairn step with DCP, and which files a rank's load reads.

    template       the state dicts to load into (per-rank objects only when
                   the world size is the same; optional keys the checkpoint
                   lacks dropped)
    needed_files   the files THIS rank's DCP load reads: its load plan against
                   the step's `.metadata` (pure over metadata and template)
    load           DCP load, resharding to the current world size

Node-local volumes (every rank its own folder, holding its own files and
`.metadata`): DCP writes each replicated entry (anything that is not a
DTensor shard: optimizer step counters, schedulers, data positions) once,
into rank 0's files (`SAVE_PLANNER`). So on a node-local volume a rank other
than 0 loads only its DTensor shards and its per-rank objects from its own
files, and receives the replicated entries from rank 0 (one broadcast on the
checkpoint group) instead of reading rank 0's files, which are on another
node. With an unchanged world size every rank's load then reads only its own
volume; after a world-size change the plan names other ranks' files too and
restore downloads exactly those.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import typing

import torch.distributed as dist
from torch.distributed.checkpoint import _traverse as traverse
from torch.distributed.checkpoint import default_planner
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._nested_dict import FLATTEN_MAPPING, flatten_state_dict
from torch.distributed.tensor import DTensor

from cairn.api import manifest as manifest_mod
from cairn.checkpoint import errors, peerread, safedcp, state

log = logging.getLogger(__name__)

METADATA = ".metadata"

SAVE_PLANNER_KW: dict[str, typing.Any] = {"dedup_save_to_lowest_rank": True}
"""Replicated entries are written by rank 0 only (see the module docstring)."""


def save_planner() -> default_planner.DefaultSavePlanner:
    return default_planner.DefaultSavePlanner(**SAVE_PLANNER_KW)


def state_key(name: str, obj: object, rank: int) -> str:
    """The checkpoint key of a Stateful (per-rank objects get their rank). Pure."""
    return f"{name}/rank-{rank}" if state.is_per_rank(obj) else name


@dataclasses.dataclass(kw_only=True, slots=True)
class Template:
    """The state dicts one rank loads into, by checkpoint key."""

    dicts: dict[str, typing.Any]
    skipped: tuple[str, ...]
    """Per-rank objects not loaded (the world size changed)."""
    per_rank: frozenset[str]
    """Checkpoint keys of per-rank objects (never replicated)."""


def template(
    objects: typing.Mapping[str, state.Stateful],
    *,
    rank: int,
    same_world: bool,
    present: typing.Collection[str] | None = None,
) -> Template:
    """The load template of `objects` on `rank` (`present`: the checkpoint's keys)."""
    dicts: dict[str, typing.Any] = {}
    skipped: list[str] = []
    per_rank: set[str] = set()
    for name, obj in objects.items():
        if state.is_per_rank(obj) and not same_world:
            # Rank r of a different world has no state of its own; DCP can
            # reshard tensors, not meaning.
            skipped.append(name)
            continue
        key = state_key(name, obj, rank)
        dicts[key] = obj.state_dict()
        if state.is_per_rank(obj):
            per_rank.add(key)
        if present is not None:
            # Device-specific state (CUDA RNG) saved on another device: not requested.
            state.drop_absent_optional(dicts, key=key, obj=obj, present=set(present))
    return Template(dicts=dicts, skipped=tuple(skipped), per_rank=frozenset(per_rank))


def _replicated(flat: typing.Mapping[str, typing.Any], per_rank: frozenset[str]) -> set[str]:
    """Flat keys rank 0 alone holds on node-local volumes: neither a DTensor
    shard nor part of a per-rank object. Pure."""
    return {
        key
        for key, value in flat.items()
        if not isinstance(value, DTensor)
        and not any(key == k or key.startswith(f"{k}.") for k in per_rank)
    }


def own_part(tmpl: Template, *, rank: int, node_local: bool) -> dict[str, typing.Any]:
    """What this rank loads with DCP: everything, except replicated entries
    on a node-local rank other than 0 (flat keys). Pure."""
    if not node_local or rank == 0:
        return tmpl.dicts
    flat, _ = flatten_state_dict(tmpl.dicts)
    skip = _replicated(flat, tmpl.per_rank)
    return {key: value for key, value in flat.items() if key not in skip}


def manifest_files(manifest: manifest_mod.Manifest) -> frozenset[str]:
    """The only files a Cairn step's `.metadata` may refer to. Pure."""
    return frozenset(entry.path for entry in manifest.files)


def read_metadata(
    folder: pathlib.Path,
    *,
    manifest: manifest_mod.Manifest | None = None,
    sha256: str | None = None,
) -> dcp_metadata.Metadata:
    """The step's `.metadata`, read as data (`safedcp`): its file references
    confined to the folder and, given the manifest, to the manifest's files."""
    allowed = None if manifest is None else manifest_files(manifest)
    return safedcp.read_metadata(folder, allowed=allowed, sha256=sha256)


def needed_files(meta: dcp_metadata.Metadata, part: typing.Mapping[str, typing.Any]) -> set[str]:
    """The data files a DCP load of `part` reads, by the step's metadata. Pure.

    Raises CheckpointError when the checkpoint lacks a requested key or a
    shape differs (the load would fail the same way).
    """
    flat, _ = flatten_state_dict(dict(part))
    try:
        plan = default_planner.create_default_local_load_plan(flat, meta)
    except (RuntimeError, ValueError) as exc:
        raise errors.CheckpointError(f"the checkpoint does not fit this run: {exc}") from exc
    storage = meta.storage_data or {}
    return {storage[item.storage_index].relative_path for item in plan.items}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Loaded:
    step: int
    world_size: int
    skipped_state: tuple[str, ...]


def load(
    folder: pathlib.Path,
    *,
    manifest: manifest_mod.Manifest,
    meta: dcp_metadata.Metadata,
    objects: typing.Mapping[str, state.Stateful],
    rank: int,
    world: int,
    node_local: bool,
    process_group: dist.ProcessGroup | None,
    streams: peerread.PeerFiles | None = None,
) -> Loaded:
    """DCP-load a verified and vetted Cairn step into objects (collective over
    the group). `meta`: its `.metadata` as `cairn.checkpoint.vet` read it (not
    read again: what was vetted is what is loaded). `streams`: this rank's
    data files, read from its peer's replica (`cairn.checkpoint.peerread`)."""
    tmpl = template(
        objects,
        rank=rank,
        same_world=manifest.world_size == world,
        present=meta.state_dict_metadata.keys(),
    )
    split = node_local and world > 1 and process_group is not None
    part = own_part(tmpl, rank=rank, node_local=split)
    safedcp.load(
        part,
        folder=folder,
        meta=meta,
        allowed=manifest_files(manifest),
        process_group=process_group,
        streams=streams,
    )
    dicts = _with_replicated(tmpl, part, rank=rank, group=process_group) if split else part
    for name, obj in objects.items():
        key = state_key(name, obj, rank)
        if key in dicts:
            obj.load_state_dict(dicts[key])
    if tmpl.skipped:
        log.warning(
            "world size changed (%d -> %d): per-rank state %s not restored",
            manifest.world_size,
            world,
            list(tmpl.skipped),
        )
    return Loaded(step=manifest.step, world_size=manifest.world_size, skipped_state=tmpl.skipped)


def _with_replicated(
    tmpl: Template, part: dict[str, typing.Any], *, rank: int, group: dist.ProcessGroup | None
) -> dict[str, typing.Any]:
    """Node-local: rank 0 sends the replicated entries it loaded; the others
    merge them into their flat part and get the nested state dicts back."""
    payload: list[typing.Any] = [None]
    if rank == 0:
        flat, _ = flatten_state_dict(part)
        payload = [{key: flat[key] for key in _replicated(flat, tmpl.per_rank)}]
    dist.broadcast_object_list(payload, src=0, group=group)
    if rank == 0:
        return part
    received: dict[str, typing.Any] = payload[0]
    flat, mapping = flatten_state_dict(tmpl.dicts)
    missing = sorted(_replicated(flat, tmpl.per_rank) - set(received))
    if missing:
        raise errors.CheckpointError(f"rank 0 did not send replicated state {missing[:5]}")
    merged = {**part, **{key: received[key] for key in _replicated(flat, tmpl.per_rank)}}
    return into_template(tmpl.dicts, merged, mapping)


def into_template(
    dicts: dict[str, typing.Any], flat: typing.Mapping[str, typing.Any], mapping: FLATTEN_MAPPING
) -> dict[str, typing.Any]:
    """Write the loaded flat entries into the template's nested dicts (in place,
    as DCP's own load does) and return them. Unlike `unflatten_state_dict`, this
    keeps containers without leaves: a LambdaLR of `functools.partial`s (every
    Transformers scheduler) has `lr_lambdas: [{}, {}]`, which flattens to
    nothing but its `load_state_dict` requires."""
    for key, value in flat.items():
        traverse.set_element(dicts, mapping[key], value)
    return dicts
