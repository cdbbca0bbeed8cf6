"""One checkpoint step, top to bottom: stage → write → commit → upload → rotate.

`run_step` runs in the writer thread of every rank after `save()` handed it
the staging future. Ranks agree through the `Coordinator` (never through the
training process group); DCP's own collectives run on a dedicated gloo group.

    stage   wait for the staged copy (host buffers, reused across saves)
    write   dcp.save into step-<N>/ (files fsynced), CRC32C of own files,
            fsync the folder, report files to rank 0
    commit  rank 0: every rank reported → fence check → manifest.json
            written last (exclusive create) → broadcast
    upload  each rank uploads its own files → reports → rank 0 puts the
            manifest last (If-None-Match) → marks the step uploaded
    rotate  rank 0 applies the pure local retention policy
    finish  rank 0 broadcasts "finished"; no rank starts the next save
            before, so rotation never races a new step folder
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import pathlib
import platform
import time
import typing

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import filesystem, state_dict_saver

from cairn.api import manifest as manifest_mod
from cairn.api import retention
from cairn.checkpoint import coordinator as coordinator_mod
from cairn.checkpoint import errors, events, faults, layout, options, remote

if typing.TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

log = logging.getLogger(__name__)

CAIRN_VERSION = "0.1.0"


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
    timeout = ctx.opts.timeout_seconds
    try:
        # stage
        state = staged.result()
        _emit(ctx, "staged", seconds=time.monotonic() - ctx.started)

        # write
        t0 = time.monotonic()
        try:
            writer = filesystem.FileSystemWriter(
                folder, sync_files=True, thread_count=ctx.opts.write_threads
            )
            state_dict_saver.save(
                state,
                storage_writer=writer,
                process_group=ctx.process_group,
                no_dist=ctx.process_group is None,
            )
            faults.pause_point("write", rank=rank, step=step)
            dcp_seconds = time.monotonic() - t0
            entries = [layout.entry_for(folder, n, rank=rank) for n in own_files(folder, rank)]
            layout.fsync_dir(folder)
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
            message=f"dcp {dcp_seconds:.3f}s, crc32c+fsync {write_seconds - dcp_seconds:.3f}s",
        )

        # commit
        t0 = time.monotonic()
        manifest = _commit(ctx, folder=folder, write_seconds=write_seconds)
        _emit(ctx, "committed", seconds=time.monotonic() - t0, bytes=manifest.total_bytes)

        # upload
        if ctx.s3_client is not None and ctx.opts.s3 is not None:
            t0 = time.monotonic()
            sent = _upload(ctx, folder=folder, manifest=manifest)
            _emit(ctx, "uploaded", seconds=time.monotonic() - t0, bytes=sent)

        # rotate
        if rank == 0:
            t0 = time.monotonic()
            freed = rotate(
                ctx.opts, in_flight=frozenset(), callbacks=ctx.callbacks, pause_step=step
            )
            _emit(ctx, "rotated", seconds=time.monotonic() - t0, bytes=freed)
            coord.broadcast(f"{key}/finished", {"ok": True})
        else:
            result = coord.wait_for(f"{key}/finished", timeout=timeout)
            if result.get("error"):
                raise errors.CheckpointError(f"step {step} failed on rank 0: {result['error']}")
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
    ctx: StepContext, *, folder: pathlib.Path, write_seconds: float
) -> manifest_mod.Manifest:
    coord = ctx.coordinator
    key = f"step-{ctx.step}"
    timeout = ctx.opts.timeout_seconds
    if coord.rank != 0:
        result = coord.wait_for(f"{key}/committed", timeout=timeout)
        if result.get("error"):
            raise errors.CheckpointError(f"commit of step {ctx.step} failed: {result['error']}")
        return manifest_mod.Manifest.model_validate(result["manifest"])
    try:
        reports = coord.gather(f"{key}/written", timeout=timeout)
        _check_reports(reports, f"write of step {ctx.step}")
        files = tuple(
            manifest_mod.FileEntry.model_validate(f) for rep in reports for f in rep["files"]
        )
        manifest = manifest_mod.Manifest(
            step=ctx.step,
            world_size=coord.world_size,
            attempt=ctx.opts.attempt,
            created_at=time.time(),
            files=files,
            versions={
                "torch": torch.__version__,
                "cairn": CAIRN_VERSION,
                "python": platform.python_version(),
            },
            extra={"write_seconds": round(write_seconds, 3)},
        )
        # Fencing: a newer attempt has started → this (zombie) writer must
        # not commit. The exclusive link below also refuses to overwrite.
        layout.check_fence(ctx.opts.directory, ctx.opts.attempt)
        faults.pause_point("commit", rank=0, step=ctx.step)
        layout.write_manifest_exclusive(folder, manifest)
    except BaseException as exc:
        coord.propose(f"{key}/committed", {"error": repr(exc)})
        raise
    coord.propose(f"{key}/committed", {"manifest": manifest.model_dump(mode="json")})
    return manifest


def _upload(ctx: StepContext, *, folder: pathlib.Path, manifest: manifest_mod.Manifest) -> int:
    assert ctx.s3_client is not None and ctx.opts.s3 is not None  # checked by caller
    coord = ctx.coordinator
    key = f"step-{ctx.step}"
    names = [e.path for e in manifest.files_of_rank(coord.rank)]
    try:
        sent = remote.upload_files(
            ctx.s3_client, ctx.opts.s3, step=ctx.step, folder=folder, names=names
        )
        faults.pause_point("upload", rank=coord.rank, step=ctx.step)
    except Exception as exc:
        coord.publish(f"{key}/uploaded", {"error": repr(exc)})
        raise
    coord.publish(f"{key}/uploaded", {"bytes": sent})
    if coord.rank == 0:
        reports = coord.gather(f"{key}/uploaded", timeout=ctx.opts.timeout_seconds)
        _check_reports(reports, f"upload of step {ctx.step}")
        # Rank 0's "uploaded" event stands for the whole step (status, metrics).
        sent = sum(int(report.get("bytes", 0)) for report in reports)
        # Only now, with every rank's files in the bucket, is the step
        # committed remotely.
        layout.check_fence(ctx.opts.directory, ctx.opts.attempt)
        remote.put_manifest(ctx.s3_client, ctx.opts.s3, manifest)
        layout.mark_uploaded(folder)
    return sent


def rotate(
    opts: options.CheckpointOptions,
    *,
    in_flight: frozenset[int],
    callbacks: typing.Sequence[events.ProgressCallback],
    pause_step: int | None = None,
) -> int:
    """Observe the local root, ask the pure policy, delete; returns bytes freed (rank 0)."""
    records = []
    folders = layout.step_dirs(opts.directory)
    for step, folder in folders.items():
        committed = layout.is_committed(folder)
        size = layout.read_manifest(folder).total_bytes if committed else 0
        records.append(
            retention.StepRecord(
                step=step, committed=committed, bytes=size, uploaded=layout.is_uploaded(folder)
            )
        )
    plan = retention.plan_local(
        steps=records,
        in_flight=in_flight,
        keep_last=opts.keep_last,
        max_bytes=opts.max_bytes,
        upload_enabled=opts.s3 is not None,
    )
    freed = 0

    def pause() -> None:
        # Fault injection: stop between "manifest gone" and "files gone".
        if pause_step is not None:
            faults.pause_point("rotate", rank=0, step=pause_step)

    for step in (*plan.delete_committed, *plan.delete_partial):
        freed += layout.delete_step(folders[step], after_manifest=pause)
        events.emit(
            callbacks,
            events.ProgressEvent(phase="deleted", step=step, rank=0, message="rotated"),
        )
    return freed
