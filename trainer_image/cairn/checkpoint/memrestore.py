"""The in-memory tier, restore side: plan a memory copy, fetch a rank's share of it.

    held / memory_step   planning (`cairn.checkpoint.candidates`): every rank
                         says which steps it holds in its own memory and which
                         step of its predecessor's replica; rank 0 picks the
                         newest step every rank can get from one of the two
                         (`memory_step`, pure)
    fetch                every rank, for that copy: its own memory first,
                         every byte checked against the step's manifest
                         (sizes, CRC32C; the manifest must authenticate as
                         the job's own), so a corrupt own copy is never
                         loaded; else its replica on its successor's server:
                         the manifest and `.metadata` fetched (`peer.fetch`,
                         checked the same way, by the CRC32C counted as they
                         arrived) and the data files left on the peer
                         (`Fetched.streamed`): the load reads them from the
                         peer's connection straight into the tensors,
                         checking each file's CRC32C as it arrives
                         (`cairn.checkpoint.peerread`); a file that fails
                         fails the load on every rank and restore moves to
                         the next copy (the volume, S3)
    agree on the manifest  all ranks must hold the same commit of the step
                         (one exchange of its attempt and time), and learn
                         which tier each rank used (`Fetched.tiers`)

A memory copy is a same-world copy: each rank's folder holds its own files
and `.metadata`, and is loaded as a node-local folder (`load`). A memory
copy that fails is reported `incomplete` (kept, never quarantined: the
volume and S3 copies of the step are separate). A replica read from the
peer is not kept as this rank's own copy (its bytes went into the tensors,
not into memory files): the rank's next save keeps one, and until then the
peer still holds the replica.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import re
import shutil
import typing

from cairn.api import manifest as manifest_mod
from cairn.checkpoint import errors, layout, load, memtier, peer, peerread
from cairn.checkpoint import fetch as fetch_mod
from cairn.checkpoint import verdict as verdict_mod

log = logging.getLogger(__name__)

RESTORE_DIR = "restore"
_REPLICA_DIR = re.compile(r"step-(\d{1,18})")
PEER_FETCH_DEADLINE_SECONDS = 120.0
"""Bound on each connection to the peer: the head files, and each data file's read."""
HEAD_FILES = (load.METADATA, manifest_mod.MANIFEST_NAME)
"""What is fetched from the peer's replica into memory: the rest is read by the load."""
Tier = typing.Literal["memory", "peer", "local", "s3"]


# -- plan -----------------------------------------------------------------------------


def held(tier: memtier.MemoryTier) -> dict[str, typing.Any]:
    """What this rank can serve: its own steps, and its predecessor's replica steps."""
    source = memtier.predecessor(tier.rank, tier.world, tier.stride)
    replicas = tier.memdir / "peer" / f"rank-{source}"  # `peer.ReplicaServer`'s layout
    found = (_REPLICA_DIR.fullmatch(p.name) for p in _children(replicas))
    return {
        "own": memtier.own_steps(tier.memdir),
        "replica": sorted(int(m.group(1)) for m in found if m is not None),
    }


def _children(folder: pathlib.Path) -> list[pathlib.Path]:
    try:
        return [p for p in folder.iterdir() if p.is_dir() and not p.is_symlink()]
    except OSError:
        return []


def memory_step(
    reports: typing.Sequence[typing.Mapping[str, typing.Any]], *, stride: int = 1
) -> int | None:
    """The newest step every rank can get from memory: from its own copy or
    from the replica its successor (`memtier.successor`, ranks `stride` apart)
    holds. Reports are by rank (`held`); anything malformed counts as nothing
    held. Pure."""
    world = len(reports)
    if world == 0:
        return None

    def steps(doc: typing.Mapping[str, typing.Any], name: str) -> set[int]:
        value = doc.get(name)
        if not isinstance(value, list):
            return set()
        return {s for s in value if isinstance(s, int) and not isinstance(s, bool) and s >= 0}

    reachable = [
        steps(reports[r], "own") | steps(reports[memtier.successor(r, world, stride)], "replica")
        for r in range(world)
    ]
    common = set.intersection(*reachable)
    return max(common, default=None)


# -- fetch ----------------------------------------------------------------------------


def context_for(ctx: fetch_mod.Context, copy: verdict_mod.Copy) -> fetch_mod.Context:
    """A memory copy is per rank (node-local), whatever the volume is."""
    return dataclasses.replace(ctx, shared=False) if copy.source == "memory" else ctx


def fetch(ctx: fetch_mod.Context, copy: verdict_mod.Copy) -> fetch_mod.Fetched:
    """This rank's share of the memory copy of `copy.step` (collective: every
    rank calls it for the same copy). Never raises for what it finds."""
    try:
        found, reasons = _find(ctx, copy.step)
    except Exception as exc:  # never skip the exchange below: the other ranks wait on it
        found, reasons = None, [f"{type(exc).__name__}: {exc}"]
    mine: dict[str, typing.Any] = {"tier": None, "commit": None}
    streamed = None
    if found is not None:
        folder, manifest, tier, streamed = found
        mine = {"tier": tier, "commit": [manifest.attempt, manifest.created_at]}
    key = f"{ctx.namespace}/memory-{copy.step}"
    ctx.coordinator.publish(key, mine)
    everyone = ctx.coordinator.gather(key, timeout=ctx.timeout)
    tiers = tuple(str(doc.get("tier")) for doc in everyone)
    if found is None:
        return fetch_mod.Fetched(report=_report(ctx, "; ".join(reasons)), tiers=tiers)
    if any(doc.get("commit") != mine["commit"] for doc in everyone):
        why = f"ranks hold different commits of step {copy.step} in memory"
        return fetch_mod.Fetched(report=_report(ctx, why), tiers=tiers)
    return fetch_mod.Fetched(
        report=verdict_mod.Report(status="ok", rank=ctx.rank),
        folder=folder,
        manifest=manifest,
        tiers=tiers,
        streamed=streamed,
    )


def _report(ctx: fetch_mod.Context, detail: str) -> verdict_mod.Report:
    return verdict_mod.Report(status="incomplete", detail=detail[:2000], rank=ctx.rank)


_Found = tuple[pathlib.Path, manifest_mod.Manifest, Tier, peerread.PeerFiles | None]


def _find(ctx: fetch_mod.Context, step: int) -> tuple[_Found | None, list[str]]:
    """(folder, manifest, tier, data files to read from the peer) of the first
    source that verifies, and why the others did not."""
    tier = ctx.memory
    reasons: list[str] = []
    if tier is None:
        return None, ["the memory tier is off on this rank"]
    own = memtier.own_folder(tier.memdir, step)
    if own.is_dir():
        try:
            return (own, _verified(ctx, own, step), "memory", None), reasons
        except _UnusableError as exc:
            reasons.append(f"own memory: {exc}")
            log.warning("memory copy of step %d refused, trying the peer: %s", step, exc)
            ctx.emit("memory_failed", step, f"own memory copy refused: {exc}")
    else:
        reasons.append("own memory: absent")
    folder = restore_folder(tier, step)
    try:
        address, received = _from_peer(ctx, tier, step, dest=folder)
        manifest = _verified(ctx, folder, step, received=received)
    except _UnusableError as exc:
        shutil.rmtree(folder, ignore_errors=True)  # our own download: memory is scarce
        reasons.append(f"peer: {exc}")
        return None, reasons
    assert tier.key is not None and tier.job_uid is not None  # `_from_peer` checked
    streamed = peerread.PeerFiles(
        address=address,
        key=tier.key,
        job_uid=tier.job_uid,
        source_rank=ctx.rank,
        step=step,
        entries={
            e.path: e for e in memtier.share_entries(manifest, ctx.rank) if e.path not in received
        },
        deadline_s=min(PEER_FETCH_DEADLINE_SECONDS, ctx.timeout),
    )
    return (folder, manifest, "peer", streamed), reasons


def restore_folder(tier: memtier.MemoryTier, step: int) -> pathlib.Path:
    """Where a peer restore keeps the head files it fetched (removed after the load)."""
    return tier.memdir / RESTORE_DIR / manifest_mod.step_dir_name(step)


class _UnusableError(Exception):
    """This source of the memory copy cannot be used (why)."""


def _verified(
    ctx: fetch_mod.Context,
    folder: pathlib.Path,
    step: int,
    *,
    received: typing.Mapping[str, tuple[int, str]] | None = None,
) -> manifest_mod.Manifest:
    """The folder's manifest, when it is the job's own step and every file of
    this rank's share matches it (sizes, CRC32C). `received`: the head files
    of a replica just fetched, name -> (size, CRC32C) counted as their bytes
    arrived, compared with the manifest instead of reading the files a second
    time (the share's data files are checked as the load reads them)."""
    try:
        manifest = layout.read_manifest(folder)
    except errors.CheckpointError as exc:
        raise _UnusableError(str(exc)) from exc
    checked = manifest_mod.authenticate(
        manifest, job_uid=ctx.opts.job_uid, keyring=ctx.opts.manifest_keyring
    )
    if not checked.own:
        raise _UnusableError(f"not this job's own: {checked.reason}")
    if manifest.step != step or manifest.world_size != ctx.world:
        raise _UnusableError(
            f"step {manifest.step} of world {manifest.world_size}, wanted {step} of {ctx.world}"
        )
    entries = memtier.share_entries(manifest, ctx.rank)
    if received is None:
        problems = layout.verify_files(folder, entries)
    else:
        head = [e for e in entries if e.path in HEAD_FILES]
        if not any(e.path == load.METADATA for e in head):
            raise _UnusableError(f"the manifest lists no {load.METADATA}")
        problems = received_problems(head, received)
    if problems:
        raise _UnusableError(verdict_mod.describe(problems))
    return manifest


def received_problems(
    entries: typing.Sequence[manifest_mod.FileEntry],
    received: typing.Mapping[str, tuple[int, str]],
) -> list[layout.Problem]:
    """Where the files of a fetched replica (name -> size, CRC32C counted on
    arrival) differ from the manifest's entries; [] when all match. Pure."""
    problems: list[layout.Problem] = []
    for entry in entries:
        got = received.get(entry.path)
        if got is None:
            problems.append(layout.Problem(path=entry.path, reason="not in the replica"))
        elif got[0] != entry.size:
            problems.append(
                layout.Problem(path=entry.path, reason=f"size {got[0]} != manifest {entry.size}")
            )
        elif got[1] != entry.crc32c:
            problems.append(
                layout.Problem(
                    path=entry.path, reason=f"crc32c {got[1]} != manifest {entry.crc32c}"
                )
            )
    return problems


def _from_peer(
    ctx: fetch_mod.Context, tier: memtier.MemoryTier, step: int, *, dest: pathlib.Path
) -> tuple[tuple[str, int], dict[str, tuple[int, str]]]:
    """The head files of this rank's replica of `step`, fetched from its
    successor into `dest` (in memory): the successor's address, and name ->
    (size, CRC32C) as counted on arrival."""
    address = tier.peer_of(ctx.rank)
    if address is None or tier.key is None or tier.job_uid is None:
        raise _UnusableError("no peer replica (replicas off, no key, or one rank)")
    shutil.rmtree(dest, ignore_errors=True)
    try:
        fetched = peer.fetch(
            address,
            key=tier.key,
            job_uid=tier.job_uid,
            source_rank=ctx.rank,
            step=step,
            dest=dest,
            deadline_s=min(PEER_FETCH_DEADLINE_SECONDS, ctx.timeout),
            names=HEAD_FILES,
        )
    except (peer.PeerUnavailable, OSError) as exc:
        raise _UnusableError(str(exc)) from exc
    return address, {f.path.name: (f.size, f.crc32c) for f in fetched}
