"""One checkpoint step, top to bottom: stage → write → commit → (upload) → rotate.

`run_step` runs in the writer thread of every rank after `save()` handed it
the staging future. Ranks agree through the `Coordinator` (never through the
training process group); DCP's own collectives run on a dedicated gloo group.

    stage   wait for the staged copy (host buffers, reused across saves)
    write   dcp.save into the attempt-scoped temporary folder
            `.step-<N>.tmp-<uid8>-a<attempt>/` (writer marker first); each
            file's CRC32C counted while written, the file fsynced once on
            close (`cairn.checkpoint.writer`); report files to rank 0
    commit  rank 0: every rank reported → fences (local file, API server)
            → manifest.json written last into the temporary folder →
            rename to step-<N>/ (refused if it exists) → broadcast; on
            node-local volumes every rank then commits its own folder the
            same way with the manifest rank 0 broadcast
    upload  handed to the upload worker (`cairn.checkpoint.uploader`), so
            the save never waits for the store; there, `upload_step`: each
            rank uploads its own files to attempt-scoped keys
            (`step-<N>/<data_prefix>/...`, full-object CRC32C checked by the
            server) → reports → rank 0 checks the fences (the API server's
            strictly: an unreachable one defers the put), puts the manifest
            last (If-None-Match) → marks the step uploaded
    rotate  `cairn.checkpoint.rotation`: rank 0 on a shared volume, every
            rank on its own node-local volume; a step not uploaded yet is kept
    finish  rank 0 broadcasts "finished"; no rank starts the next save
            before, so rotation never races a new step folder
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import dataclasses
import importlib.metadata
import logging
import os
import pathlib
import platform
import time
import typing

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import state_dict_saver

from cairn.api import manifest as manifest_mod
from cairn.checkpoint import (
    aside,
    errors,
    events,
    faults,
    layout,
    load,
    memtier,
    options,
    remote,
    rotation,
    tiers,
    uploader,
    writer,
)
from cairn.checkpoint import coordinator as coordinator_mod
from cairn.checkpoint import fence as fence_mod

if typing.TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

log = logging.getLogger(__name__)


def _cairn_version() -> str:
    """The installed distribution's version (pyproject.toml); a bare source tree: unknown."""
    try:
        return importlib.metadata.version("cairn-training")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


CAIRN_VERSION = _cairn_version()
"""Recorded in every manifest (``writer.cairn``); from the package metadata."""


@dataclasses.dataclass(kw_only=True, slots=True)
class StepContext:
    """What the writer thread needs for one step (built by the manager)."""

    step: int
    opts: options.CheckpointOptions
    coordinator: coordinator_mod.Coordinator
    process_group: dist.ProcessGroup | None
    """The dedicated gloo group for DCP's collectives (None without dist)."""
    s3_client: S3Client | None
    callbacks: typing.Sequence[events.ProgressCallback]
    started: float
    """time.monotonic() when save() was called."""
    shared: bool = True
    """Every rank sees one checkpoint directory (probed once by the manager);
    False: node-local volumes, every rank commits its own folder."""
    lineage: str | None = None
    """Lineage id recorded in the manifest (`cairn.checkpoint.lineage`)."""
    parent: manifest_mod.Parent | None = None
    """The step the lineage branched from, recorded in its manifests."""
    uploads: uploader.Uploader | None = None
    """The manager's upload worker (None without S3): told of each commit."""
    memory: memtier.MemoryTier | None = None
    """The in-memory tier (None when off): told of each commit, keeps it apart."""
    final: bool = False
    """The final (SIGTERM) save: always owed an upload (`tiers.upload_owed`)."""


def _emit(ctx: StepContext, phase: events.Phase, **kw: typing.Any) -> None:
    events.emit(
        ctx.callbacks,
        events.ProgressEvent(phase=phase, step=ctx.step, rank=ctx.coordinator.rank, **kw),
    )


def own_files(folder: pathlib.Path, rank: int) -> list[str]:
    """The files this rank wrote: its DCP data files, plus `.metadata` for rank 0."""
    names = sorted(p.name for p in folder.iterdir() if p.name.startswith(f"__{rank}_"))
    if rank == 0 and (folder / ".metadata").is_file():
        names.append(".metadata")
    return names


def _check_reports(reports: list[dict[str, typing.Any]], what: str) -> None:
    failed = [f"rank {r}: {rep['error']}" for r, rep in enumerate(reports) if rep.get("error")]
    if failed:
        raise errors.CheckpointError(f"{what} failed on " + "; ".join(failed))


def run_step(ctx: StepContext, staged: concurrent.futures.Future[dict[str, typing.Any]]) -> None:
    """The whole background life of one step on this rank; raises on failure."""
    coord = ctx.coordinator
    rank = coord.rank
    step = ctx.step
    key = f"step-{step}"
    folder = layout.step_dir(ctx.opts.directory, step)
    tmp = layout.tmp_step_dir(
        ctx.opts.directory,
        step,
        job_uid=ctx.opts.job_uid,
        attempt=ctx.opts.attempt,
        group=ctx.opts.group,
    )
    timeout = ctx.opts.timeout_seconds
    try:
        # stage
        state = staged.result()
        _emit(ctx, "staged", seconds=time.monotonic() - ctx.started)

        # write
        t0 = time.monotonic()
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            # Before any data: proof that this job's attempt wrote here.
            layout.write_writer_marker(tmp, job_uid=ctx.opts.job_uid, attempt=ctx.opts.attempt)
            if tiers.local_only(step, opts=ctx.opts, final=ctx.final):
                # Committed with the step by the rename: uploads skip it,
                # retention rotates it (`cairn.checkpoint.tiers`).
                layout.mark_local_only(tmp)
            # One pass: each file's CRC32C is counted while DCP writes it,
            # and the file is fsynced once when closed (cairn.checkpoint.writer).
            dcp_writer = writer.ChecksummingWriter(tmp, thread_count=ctx.opts.write_threads)
            state_dict_saver.save(
                state,
                storage_writer=dcp_writer,
                planner=load.save_planner(),
                process_group=ctx.process_group,
                no_dist=ctx.process_group is None,
            )
            faults.pause_point("write", rank=rank, step=step)
            dcp_seconds = time.monotonic() - t0
            entries = writer.entries(
                tmp, own_files(tmp, rank), rank=rank, written=dcp_writer.checksum_fs.checksums()
            )
            layout.fsync_dir(tmp)
        except Exception as exc:
            coord.publish(f"{key}/written", {"error": repr(exc)})
            raise
        written = sum(e.size for e in entries)
        write_seconds = time.monotonic() - t0
        coord.publish(f"{key}/written", {"files": [e.model_dump() for e in entries]})
        _emit(
            ctx,
            "written",
            seconds=write_seconds,
            bytes=written,
            message=f"dcp+crc32c+fsync {dcp_seconds:.3f}s, entries {write_seconds - dcp_seconds:.3f}s",
        )

        # commit
        t0 = time.monotonic()
        manifest = _commit(ctx, tmp=tmp, folder=folder, write_seconds=write_seconds)
        _emit(ctx, "committed", seconds=time.monotonic() - t0, bytes=manifest.total_bytes)

        # memory: the tier's own thread copies this rank's share (and pushes the replica)
        if ctx.memory is not None:
            ctx.memory.committed(folder=folder, manifest=manifest)

        # upload: the worker's (this step with the backlog of earlier ones)
        if ctx.uploads is not None:
            ctx.uploads.committed(step)

        # rotate (cairn.checkpoint.rotation: every rank its own volume,
        # rank 0 alone on a shared one)
        if rank == 0:
            _rotate(ctx)
            coord.broadcast(f"{key}/finished", {"ok": True})
        else:
            result = coord.wait_for(f"{key}/finished", timeout=timeout)
            if result.get("error"):
                raise errors.CheckpointError(f"step {step} failed on rank 0: {result['error']}")
            if rotation.rotates_here(rank=rank, shared=_shared(ctx)):
                _rotate(ctx)
        _emit(ctx, "finished", seconds=time.monotonic() - ctx.started)
    except BaseException as exc:
        if rank == 0:
            # Release ranks waiting for the commit (if it never happened:
            # propose() does not replace a manifest already broadcast) and
            # for the end of the step, instead of letting them time out.
            coord.propose(f"{key}/committed", {"error": repr(exc)})
            coord.broadcast(f"{key}/finished", {"error": repr(exc)})
        _emit(ctx, "failed", message=repr(exc))
        raise


def _commit(
    ctx: StepContext, *, tmp: pathlib.Path, folder: pathlib.Path, write_seconds: float
) -> manifest_mod.Manifest:
    """Rank 0 builds the manifest and commits; node-local ranks commit their own copy.

    Node-local volumes: every other rank commits its copy FIRST and rank 0
    last, once all reported their commit, so a step rank 0 holds as committed
    (the one listing restore and uploads plan from) is committed on every
    volume. The other order left, after a kill between the two renames, a
    step committed on rank 0 whose other copies never were (found by the
    kill trials' commit phase at a job's first step: no fresh start, no
    restore)."""
    coord = ctx.coordinator
    key = f"step-{ctx.step}"
    timeout = ctx.opts.timeout_seconds
    if coord.rank != 0:
        result = coord.wait_for(f"{key}/committed", timeout=timeout)
        if result.get("error"):
            raise errors.CheckpointError(f"commit of step {ctx.step} failed: {result['error']}")
        manifest = manifest_mod.Manifest.model_validate(result["manifest"])
        if not ctx.shared:
            _commit_copy(ctx, tmp=tmp, folder=folder, manifest=manifest, doc=result)
        return manifest
    try:
        reports = coord.gather(f"{key}/written", timeout=timeout)
        _check_reports(reports, f"write of step {ctx.step}")
        manifest = _build_manifest(ctx, reports=reports, write_seconds=write_seconds)
        # Fencing: a newer attempt (or a re-created job) has started → this
        # zombie writer must not commit. The rename refuses to replace too.
        _fence(ctx)
        doc: dict[str, typing.Any] = {"manifest": manifest.model_dump(mode="json")}
        if not ctx.shared:
            doc["metadata"] = base64.b64encode((tmp / load.METADATA).read_bytes()).decode()
            coord.propose(f"{key}/committed", doc)  # the others commit their copies
            coord.publish(f"{key}/copy", {"ok": True})
            _check_reports(
                coord.gather(f"{key}/copy", timeout=timeout), f"commit of step {ctx.step}"
            )
        faults.pause_point("commit", rank=0, step=ctx.step)
        _commit_here(ctx, tmp=tmp, folder=folder, manifest=manifest)
    except BaseException as exc:
        coord.propose(f"{key}/committed", {"error": repr(exc)})
        raise
    coord.propose(f"{key}/committed", doc)
    return manifest


def _commit_copy(
    ctx: StepContext,
    *,
    tmp: pathlib.Path,
    folder: pathlib.Path,
    manifest: manifest_mod.Manifest,
    doc: dict[str, typing.Any],
) -> None:
    """Node-local, a rank other than 0: commit this volume's copy of the step
    (its own files, rank 0's `.metadata`, the manifest listing every rank's),
    fenced by its own file, and report it to rank 0 (which commits last).
    With `.metadata` here a restore knows which files this rank reads without
    another node (`load`)."""
    coord = ctx.coordinator
    key = f"step-{ctx.step}"
    try:
        _write_metadata(tmp, doc.get("metadata"))
        _fence_local(ctx.opts)
        faults.pause_point("commit", rank=coord.rank, step=ctx.step)
        _commit_here(ctx, tmp=tmp, folder=folder, manifest=manifest)
    except BaseException as exc:
        coord.publish(f"{key}/copy", {"error": repr(exc)})
        raise
    coord.publish(f"{key}/copy", {"ok": True})


def _write_metadata(tmp: pathlib.Path, encoded: str | None) -> None:
    """Node-local: rank 0's `.metadata` into this rank's temporary folder (fsynced)."""
    if encoded is None:
        return
    target = tmp / load.METADATA
    with target.open("wb") as stream:
        stream.write(base64.b64decode(encoded))
        stream.flush()
        os.fsync(stream.fileno())
    layout.fsync_dir(tmp)


def data_prefix(opts: options.CheckpointOptions) -> str | None:
    """The attempt-scoped S3 sub-prefix of this attempt's data objects. Pure."""
    if opts.s3 is None:
        return None
    return f"{layout.attempt_token(opts.attempt, opts.group)}-{layout.uid8(opts.job_uid)}"


def _build_manifest(
    ctx: StepContext, *, reports: list[dict[str, typing.Any]], write_seconds: float
) -> manifest_mod.Manifest:
    files = tuple(manifest_mod.FileEntry.model_validate(f) for rep in reports for f in rep["files"])
    manifest = manifest_mod.Manifest(
        step=ctx.step,
        world_size=ctx.coordinator.world_size,
        attempt=ctx.opts.attempt,
        created_at=time.time(),
        files=files,
        versions={
            "torch": torch.__version__,
            "cairn": CAIRN_VERSION,
            "python": platform.python_version(),
        },
        extra={"write_seconds": round(write_seconds, 3)},
        job_uid=ctx.opts.job_uid,
        lineage=ctx.lineage,
        parent=ctx.parent,
        data_prefix=data_prefix(ctx.opts),
        tiers=tiers.in_pod(ctx.opts),
    )
    keyring = ctx.opts.manifest_keyring  # signed: only authentic steps are ever "latest"
    return manifest if keyring is None else manifest_mod.sign(manifest, keyring)


def _fence_local(opts: options.CheckpointOptions) -> None:
    fence_mod.LocalFence(root=opts.directory, job_uid=opts.job_uid, group=opts.group).check(
        opts.attempt
    )


def _fence(ctx: StepContext) -> None:
    """Rank 0 before a local commit: the local fence file, then the API server's
    view (bounded: unanswered, the local fence decides; see `fence`)."""
    _fence_local(ctx.opts)
    if ctx.opts.fence is not None:
        ctx.opts.fence.check(ctx.opts.attempt)


def _commit_here(
    ctx: StepContext, *, tmp: pathlib.Path, folder: pathlib.Path, manifest: manifest_mod.Manifest
) -> None:
    """Clear the way (another job's folder is moved aside), then rename into place."""
    if os.path.lexists(folder):
        kind = layout.classify(folder, job_uid=ctx.opts.job_uid, keyring=ctx.opts.manifest_keyring)
        if kind == "partial_own":
            # A deletion of ours interrupted after the manifest went.
            layout.delete_step(folder)
        elif kind == "committed" and _stray_copy(ctx, folder):
            # Node-local, a rank other than 0: an earlier attempt committed this
            # copy but rank 0 never committed the step (killed in between), so
            # no restore could use it. Kept, out of the way.
            aside.move_aside_local(
                ctx.opts.directory,
                folder,
                kind="superseded",
                tag=f"a{layout.read_manifest(folder).attempt}",
                reason=f"copy of step {ctx.step} that rank 0 never committed",
            )
        elif kind == "committed":
            raise errors.FencedError(
                f"step {ctx.step} is already committed in {folder}; not committed again"
            )
        else:
            aside.move_aside_local(
                ctx.opts.directory,
                folder,
                kind="foreign",
                tag=_owner_tag(folder, kind),
                reason=f"{kind} folder in the way of job {ctx.opts.job_uid} step {ctx.step}",
            )
    layout.commit_folder(tmp, folder, manifest)


def _stray_copy(ctx: StepContext, folder: pathlib.Path) -> bool:
    """Whether a committed folder in the way is this job's copy of an earlier
    attempt on a node-local rank other than 0 (rank 0 commits last: a step it
    lacks was never committed). A zombie of a newer attempt is never stray."""
    if ctx.shared or ctx.coordinator.rank == 0:
        return False
    try:
        found = layout.read_manifest(folder)
    except errors.CheckpointError:
        return False
    return found.job_uid == ctx.opts.job_uid and found.attempt < ctx.opts.attempt


def _owner_tag(folder: pathlib.Path, kind: layout.Kind) -> str:
    """The aside tag of a folder in the way: its job's uid8, else its kind."""
    if kind == "foreign":
        with contextlib.suppress(errors.CheckpointError):
            uid = layout.read_manifest(folder).job_uid
            if uid:
                return layout.uid8(uid)
        marker = layout.read_writer_marker(folder) or {}
        if isinstance(marker.get("job_uid"), str):
            return layout.uid8(marker["job_uid"])
        return "dcp"
    return kind


def upload_step(
    *,
    opts: options.CheckpointOptions,
    coordinator: coordinator_mod.Coordinator,
    s3_client: S3Client,
    folder: pathlib.Path,
    manifest: manifest_mod.Manifest,
    key: str,
) -> int:
    """Upload one committed step (this save's or one of the backlog) under
    coordinator key `key`: own files, then rank 0 puts the manifest last.
    (The upload worker binds the first three: the worker has no step of its own.)"""
    assert opts.s3 is not None  # checked by caller
    coord = coordinator
    try:
        sent = remote.upload_files(
            s3_client,
            opts.s3,
            folder=folder,
            manifest=manifest,
            entries=manifest.files_of_rank(coord.rank),
        )
        faults.pause_point("upload", rank=coord.rank, step=manifest.step)
    except Exception as exc:
        coord.publish(f"{key}/uploaded", {"error": repr(exc)})
        raise
    coord.publish(f"{key}/uploaded", {"bytes": sent})
    if coord.rank == 0:
        reports = coord.gather(f"{key}/uploaded", timeout=opts.timeout_seconds)
        _check_reports(reports, f"upload of step {manifest.step}")
        # Rank 0's "uploaded" event stands for the whole step (status, metrics).
        sent = sum(int(report.get("bytes", 0)) for report in reports)
        # Only now, with every rank's files in the bucket, is the step
        # committed remotely; the API server must confirm (strict fence).
        _fence_local(opts)
        if opts.fence is not None:
            fence_mod.check_strict(opts.fence, opts.attempt)
        _put_manifest(s3_client, opts.s3, manifest)
        faults.pause_point("marker", rank=0, step=manifest.step)  # remote commit, no `.uploaded`
        layout.mark_uploaded(folder)
    return sent


def _put_manifest(
    client: S3Client, s3opts: options.S3Options, manifest: manifest_mod.Manifest
) -> None:
    """The remote commit; another job's manifest in the way is moved aside first."""
    try:
        remote.put_manifest(client, s3opts, manifest)
    except remote.ForeignManifestError as exc:
        aside.move_aside_remote(
            client,
            s3opts,
            manifest.step,
            kind="foreign",
            tag=layout.uid8(exc.owner),
            reason=f"in the way of job {manifest.job_uid} step {manifest.step}",
        )
        remote.put_manifest(client, s3opts, manifest)


def _shared(ctx: StepContext) -> bool:
    return ctx.shared


def _rotate(ctx: StepContext) -> None:
    t0 = time.monotonic()
    result = rotation.rotate(
        ctx.opts,
        rank=ctx.coordinator.rank,
        in_flight=frozenset(),
        callbacks=ctx.callbacks,
        pause_step=ctx.step,
    )
    message = rotation.over_budget_message(result, ctx.opts)
    if message:
        log.warning("rank %d: %s", ctx.coordinator.rank, message)
    _emit(ctx, "rotated", seconds=time.monotonic() - t0, bytes=result.freed, message=message)
