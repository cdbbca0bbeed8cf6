"""Local rotation of one volume: observe → pure policy → delete.

    observe   list this volume's `step-<N>` folders, classify each (the one
              classification of `cairn.checkpoint.layout`), measure the bytes
              of the files PRESENT here (on a node-local volume a committed
              folder holds this rank's files only, while its manifest lists
              every rank's: the manifest total would over-count)
    decide    `cairn.api.retention.plan_local` (pure): keepLast, maxBytes,
              protected steps, own partials
    delete    manifest first (a half-deleted step is a partial, never a
              "committed" one), then the rest; each deletion is an event

Who rotates: on a shared volume (every rank sees one directory) rank 0 alone;
on node-local volumes (emptyDir per pod) every rank rotates its own, guided
by the commit rank 0 broadcast (the manifest each rank renamed into place)
and by rank 0's "uploaded" broadcast (each rank's own `.uploaded` marker).

What may be deleted: committed steps of this job by policy, and partials
proven to be this job's. Foreign, unreadable and unknown folders are never
deleted here; they are counted in `Rotation.kept_aside` for the report.
Folders moved aside under `.cairn/` are bounded by `aside.prune` (this
job's quarantined and superseded ones beyond `keep_aside` per kind).
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import shutil
import typing

from cairn.api import manifest as manifest_mod
from cairn.api import retention
from cairn.checkpoint import aside as aside_mod
from cairn.checkpoint import events, faults, layout, options

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Observed:
    """One step folder on this volume as rotation sees it."""

    step: int
    folder: pathlib.Path
    kind: layout.Kind
    bytes: int
    """Sizes of the files present in the folder (this volume only)."""
    uploaded: bool


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Rotation:
    """What one rotation did on this volume."""

    freed: int = 0
    deleted: tuple[int, ...] = ()
    over_budget: tuple[int, ...] = ()
    """Committed steps kept beyond keepLast/maxBytes because they are not
    uploaded yet (or in flight); reported, never silently grown."""
    kept_bytes: int = 0
    kept_aside: tuple[int, ...] = ()
    """Folders that are not this job's to delete (foreign, unreadable, unknown)."""


def present_bytes(folder: pathlib.Path) -> int:
    """Bytes of the regular files under folder (symlinks not followed)."""
    total = 0
    for path in folder.rglob("*"):
        try:
            if path.is_file() and not path.is_symlink():
                total += path.stat().st_size
        except OSError:
            continue  # vanished or unreadable: not ours to count
    return total


def observe(
    root: pathlib.Path, *, job_uid: str | None, keyring: manifest_mod.Keyring | None = None
) -> list[Observed]:
    """This volume's step folders, classified and measured, oldest first.

    Only authentic steps (`layout.classify` with the job's keyring) are
    "committed" and so ever rotated; a forged or foreign one is kept."""
    found = []
    for step, folder in sorted(layout.step_dirs(root).items()):
        kind = layout.classify(folder, job_uid=job_uid, keyring=keyring)
        found.append(
            Observed(
                step=step,
                folder=folder,
                kind=kind,
                bytes=present_bytes(folder) if kind in ("committed", "partial_own") else 0,
                # A local-only step owes no upload: it rotates like an uploaded one.
                uploaded=kind == "committed"
                and (layout.is_uploaded(folder) or layout.is_local_only(folder)),
            )
        )
    return found


def stale_temps(
    temps: dict[pathlib.Path, tuple[int, str, int]],
    *,
    job_uid: str | None,
    attempt: int,
    in_flight: frozenset[int],
) -> list[pathlib.Path]:
    """This job's temporary step folders that no write of this attempt still
    uses (a crashed attempt's, or this attempt's abandoned ones). Pure.

    Another job's temporary folders are not ours: kept.
    """
    return sorted(
        path
        for path, (step, owner, their_attempt) in temps.items()
        if owner == layout.uid8(job_uid) and not (their_attempt == attempt and step in in_flight)
    )


def records(observed: list[Observed]) -> list[retention.StepRecord]:
    """The policy's view of this job's folders (others are not passed). Pure."""
    return [
        retention.StepRecord(
            step=o.step,
            committed=o.kind == "committed",
            bytes=o.bytes,
            uploaded=o.uploaded,
            own_partial=o.kind == "partial_own",
        )
        for o in observed
        if o.kind in ("committed", "partial_own")
    ]


def _prune_aside(
    opts: options.CheckpointOptions,
    *,
    rank: int,
    callbacks: typing.Sequence[events.ProgressCallback],
) -> None:
    """The bounded pruning of what was moved aside, each folder reported."""
    for path in aside_mod.prune(opts.directory, job_uid=opts.job_uid, keep=opts.keep_aside):
        events.emit(
            callbacks,
            events.ProgressEvent(
                phase="deleted",
                step=_step_of(path),
                rank=rank,
                message=f"pruned {path.parent.parent.name} folder {path.relative_to(opts.directory)}",
            ),
        )


def rotate(
    opts: options.CheckpointOptions,
    *,
    rank: int,
    in_flight: frozenset[int],
    callbacks: typing.Sequence[events.ProgressCallback],
    pause_step: int | None = None,
) -> Rotation:
    """Observe this volume, ask the pure policy, delete what it allows."""
    job_uid = opts.job_uid
    observed = observe(opts.directory, job_uid=job_uid, keyring=opts.manifest_keyring)
    plan = retention.plan_local(
        steps=records(observed),
        in_flight=in_flight,
        keep_last=opts.keep_last,
        max_bytes=opts.max_bytes,
        upload_enabled=opts.s3 is not None,
    )
    by_step = {o.step: o for o in observed}

    def pause() -> None:
        # Fault injection: stop between "manifest gone" and "files gone".
        if pause_step is not None:
            faults.pause_point("rotate", rank=rank, step=pause_step)

    freed = 0
    for step in (*plan.delete_committed, *plan.delete_partial):
        freed += layout.delete_step(by_step[step].folder, after_manifest=pause)
        events.emit(
            callbacks,
            events.ProgressEvent(phase="deleted", step=step, rank=rank, message="rotated"),
        )
    for path in stale_temps(
        layout.tmp_dirs(opts.directory),
        job_uid=job_uid,
        attempt=opts.attempt,
        in_flight=in_flight,
    ):
        freed += present_bytes(path)
        shutil.rmtree(path, ignore_errors=True)
        log.info("rank %d: removed abandoned temporary folder %s", rank, path.name)
    _prune_aside(opts, rank=rank, callbacks=callbacks)
    aside = tuple(o.step for o in observed if o.kind in ("foreign", "unreadable", "unknown"))
    if aside:
        log.info("rank %d: rotation keeps step folders it may not delete: %s", rank, aside)
    return Rotation(
        freed=freed,
        deleted=(*plan.delete_committed, *plan.delete_partial),
        over_budget=plan.over_budget,
        kept_bytes=plan.kept_bytes,
        kept_aside=aside,
    )


def _step_of(folder: pathlib.Path) -> int:
    """The step of a moved-aside `step-<N>[.<i>]` folder (-1 if the name says none)."""
    step = manifest_mod.parse_step_dir_name(folder.name.split(".")[0])
    return -1 if step is None else step


def rotates_here(*, rank: int, shared: bool) -> bool:
    """Whether this rank rotates: its own volume, or rank 0 for a shared one. Pure."""
    return rank == 0 or not shared


def over_budget_message(result: Rotation, opts: options.CheckpointOptions) -> str:
    """The report for steps kept beyond the local budget (empty when none). Pure."""
    if not result.over_budget:
        return ""
    budget = f"keepLast {opts.keep_last}" + (
        f", maxBytes {opts.max_bytes}" if opts.max_bytes is not None else ""
    )
    return (
        f"local retention over budget ({budget}): keeping steps {list(result.over_budget)} "
        f"that are not uploaded yet ({result.kept_bytes} bytes kept on this volume)"
    )
