"""Resume: plan candidate copies → fetch and verify a share → agree → load.

    restore()          one call on every rank, in the same order
      _plan            rank 0 lists the copies to try, newest step first
                       (the local folder, then the S3 copy of each step) and
                       broadcasts them; an explicit target that does not exist
                       or is of a newer format is a ConfigurationError
      _fetch           each rank checks ITS share of one copy (downloads it
                       first for S3, with bounded retries of transient errors)
      _agree           all ranks' reports → one verdict (`cairn.checkpoint.verdict`)
      _reject          a proven-corrupt copy of this job is quarantined (moved
                       aside, locally and/or in S3); anything else is kept
      _use             the first verified copy is installed and loaded with DCP,
                       which reshards to the current world size

Nothing here deletes a step. A copy that cannot be read (EACCES on one
rank, a manifest of a newer format, an absent file) is skipped and kept; a
copy whose bytes differ from its manifest (size, CRC32C) is moved aside
under `<root>/.cairn/quarantine/` (`cairn.checkpoint.aside`). Transport is
not verification: when S3 keeps failing after the bounded retries the
restore fails with TransportError instead of falling back to an older step.
Every skipped step is reported (log, `restore_fallback` event,
`RestoreResult.skipped`), every quarantine too (`quarantined` event).

Foreign checkpoints (`resume.uri`, or an explicit `resume.step` that names a
plain DCP folder) go through the same fetch → agree → load, with
`cairn.checkpoint.foreign` for DCP metadata checks and key mapping.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import shutil
import typing

import pydantic
import torch.distributed as dist
from torch.distributed.checkpoint import state_dict_loader

from cairn.api import checkpointspec
from cairn.api import manifest as manifest_mod
from cairn.checkpoint import (
    aside,
    errors,
    events,
    foreign,
    layout,
    options,
    remote,
    startup,
    state,
)
from cairn.checkpoint import coordinator as coordinator_mod
from cairn.checkpoint import fetch as fetch_mod
from cairn.checkpoint import verdict as verdict_mod

if typing.TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RestoreResult:
    step: int
    source: typing.Literal["local", "s3"]
    skipped: tuple[tuple[int, str], ...] = ()
    """Newer steps that could not be loaded: (step, reason). They are kept
    (or, when proven corrupt, quarantined), never deleted."""
    skipped_state: tuple[str, ...] = ()
    """State objects not restored (world size changed, or not in an import)."""
    world_size: int = 1
    """World size that wrote the loaded step (0: unknown, a plain DCP import)."""
    imported: bool = False
    """A checkpoint this job did not write (resume.uri, another job's step,
    a plain DCP folder)."""
    uri: str | None = None
    """Where an S3 import came from."""
    quarantined: tuple[str, ...] = ()
    """Where proven-corrupt copies were moved (paths / S3 keys)."""


def state_key(name: str, obj: object, rank: int) -> str:
    """The checkpoint key of a Stateful (per-rank objects get their rank). Pure."""
    return f"{name}/rank-{rank}" if state.is_per_rank(obj) else name


def restore(
    *,
    opts: options.CheckpointOptions,
    coordinator: coordinator_mod.Coordinator,
    process_group: dist.ProcessGroup | None,
    s3_client: S3Client | None,
    objects: typing.Mapping[str, state.Stateful],
    step: int | None,
    callbacks: typing.Sequence[events.ProgressCallback],
    namespace: str,
    uri: str | None = None,
    key_map: foreign.KeyMap | None = None,
) -> RestoreResult | None:
    """Load the newest verified committed step (or `step`, or `uri`) into `objects`.

    Returns None when there is nothing to resume from. Raises
    ConfigurationError when an explicit target cannot be loaded,
    TransportError when S3 kept failing, CheckpointError when committed
    steps exist but none verifies.
    """
    shared = startup.probe_shared(
        directory=opts.directory,
        coordinator=coordinator,
        namespace=namespace,
        timeout=opts.timeout_seconds,
    )
    ctx = fetch_mod.Context(
        opts=opts,
        coordinator=coordinator,
        process_group=process_group,
        s3_client=s3_client,
        callbacks=tuple(callbacks),
        namespace=namespace,
        shared=shared,
        explicit=step is not None or uri is not None,
        key_map=key_map,
    )
    copies = _plan(ctx, step=step, uri=uri)
    failed: dict[int, list[str]] = {}
    quarantined: list[str] = []
    for index, copy in enumerate(copies):
        key = f"{namespace}/copy-{index}"
        fetched = fetch_mod.fetch(ctx, copy)
        found = _agree(ctx, key, fetched.report)
        if found.status == "ok":
            result = _use(ctx, copy, fetched, key=key, objects=objects, uri=uri)
            skipped = _report_skipped(ctx, failed, loaded=copy.step)
            return dataclasses.replace(result, skipped=skipped, quarantined=tuple(quarantined))
        log.warning("checkpoint %s not loadable (%s): %s", copy.label, found.status, found.reason)
        moved = _reject(ctx, copy, fetched, found, key=key)
        kept = f"quarantined to {', '.join(moved)}" if moved else "kept"
        failed.setdefault(copy.step, []).append(
            f"{copy.source} {found.status} ({kept}): {found.reason}"
        )
        quarantined.extend(moved)
    skipped = _report_skipped(ctx, failed, loaded=None)
    if ctx.explicit:
        target = uri if uri is not None else f"step {step}"
        raise errors.ConfigurationError(
            f"resume target {target} cannot be loaded: "
            + "; ".join(reason for _, reason in skipped)
        )
    if skipped:
        raise errors.CheckpointError(
            "no committed checkpoint step verified: "
            + "; ".join(f"step {s}: {r}" for s, r in skipped)
        )
    return None


# -- plan: which copies, in which order (rank 0 decides, everyone follows) ----------


def _plan(ctx: fetch_mod.Context, *, step: int | None, uri: str | None) -> list[verdict_mod.Copy]:
    key = f"{ctx.namespace}/plan"
    if ctx.rank == 0:
        try:
            copies = [_plan_uri(ctx, uri)] if uri is not None else _plan_steps(ctx, step)
        except Exception as exc:
            ctx.coordinator.broadcast(key, _error_doc(exc))
            raise
        ctx.coordinator.broadcast(key, {"copies": [c.to_json() for c in copies]})
        return copies
    plan = ctx.coordinator.wait_for(key, timeout=ctx.timeout)
    _raise_error_doc(plan, where="resume planning on rank 0")
    return [verdict_mod.Copy.from_json(doc) for doc in plan["copies"]]


def _plan_steps(ctx: fetch_mod.Context, step: int | None) -> list[verdict_mod.Copy]:
    """Copies of this job's committed steps, newest first: local, then S3."""
    opts = ctx.opts
    kinds = {
        n: layout.classify(folder, job_uid=opts.job_uid)
        for n, folder in layout.step_dirs(opts.directory).items()
    }
    remote_steps: set[int] = set()
    if ctx.s3_client is not None and opts.s3 is not None:
        client, s3opts = ctx.s3_client, opts.s3
        listed = remote.retrying(
            lambda: remote.committed_steps(client, s3opts), what="listing remote steps"
        )
        remote_steps = set(listed)
    if step is not None:
        return _plan_explicit(ctx, step, kinds=kinds, remote_steps=remote_steps)
    for n, kind in sorted(kinds.items(), reverse=True):
        if kind not in ("committed", "partial_own"):
            log.warning("checkpoint folder step %d is %s: kept, not a resume candidate", n, kind)
    local = {n for n, kind in kinds.items() if kind == "committed"}
    copies: list[verdict_mod.Copy] = []
    for n in sorted(local | remote_steps, reverse=True):
        if n in local:
            copies.append(verdict_mod.Copy(step=n, source="local"))
        if n in remote_steps:
            copies.append(verdict_mod.Copy(step=n, source="s3"))
    return copies


def _plan_explicit(
    ctx: fetch_mod.Context, step: int, *, kinds: dict[int, layout.Kind], remote_steps: set[int]
) -> list[verdict_mod.Copy]:
    kind = kinds.get(step)
    copies: list[verdict_mod.Copy] = []
    if kind == "unreadable":
        folder = layout.step_dir(ctx.opts.directory, step)
        raise errors.ConfigurationError(
            f"requested resume step {step}: {folder} is unreadable here ({_why_unreadable(folder)})"
        )
    if kind == "committed":
        copies.append(verdict_mod.Copy(step=step, source="local"))
    elif kind == "foreign":
        plain = not (
            layout.step_dir(ctx.opts.directory, step) / manifest_mod.MANIFEST_NAME
        ).exists()
        copies.append(verdict_mod.Copy(step=step, source="local", own=False, plain_dcp=plain))
    if step in remote_steps:
        copies.append(verdict_mod.Copy(step=step, source="s3"))
    if not copies:
        raise errors.ConfigurationError(
            f"requested resume step {step} is not committed anywhere"
            f" (local: {kind or 'absent'}; S3: {'listed' if step in remote_steps else 'absent'})"
        )
    return copies


def _why_unreadable(folder: pathlib.Path) -> str:
    try:
        layout.read_manifest(folder)
    except (errors.CheckpointError, ValueError, OSError) as exc:  # newer format, invalid, EACCES
        return str(exc)
    return "manifest of another step"


def _plan_uri(ctx: fetch_mod.Context, uri: str) -> verdict_mod.Copy:
    """What is at resume.uri: a Cairn step folder or a plain DCP checkpoint."""
    client, s3opts = fetch_mod.s3(ctx)
    bucket, prefix = checkpointspec.split_s3_uri(uri)
    raw = remote.retrying(
        lambda: remote.get_bytes_or_none(client, bucket, f"{prefix}/{manifest_mod.MANIFEST_NAME}"),
        what=f"reading {uri}",
    )
    if raw is not None:
        try:
            found = manifest_mod.parse_manifest(raw)
        except (pydantic.ValidationError, ValueError) as exc:
            raise errors.ConfigurationError(f"{uri}/manifest.json cannot be used: {exc}") from exc
        return verdict_mod.Copy(
            step=found.step, source="s3", own=False, bucket=bucket, folder_prefix=prefix
        )
    sizes = remote.retrying(
        lambda: remote.list_sizes(client, bucket, prefix), what=f"listing {uri}"
    )
    if foreign.DCP_METADATA not in sizes:
        raise errors.ConfigurationError(
            f"{uri} holds neither a Cairn manifest.json nor a DCP .metadata"
            f" ({len(sizes)} objects under it): not a checkpoint"
        )
    folder = fetch_mod.import_dir(ctx)
    remote.retrying(
        lambda: remote.download_files(
            client, s3opts, bucket=bucket, prefix=prefix, folder=folder, names=[".metadata"]
        ),
        what=f"reading {uri}/.metadata",
    )
    problems = foreign.verify_listing(sizes, foreign.read_metadata(folder))
    if problems:
        raise errors.ConfigurationError(f"{uri} is an incomplete DCP checkpoint: {problems[:5]}")
    return verdict_mod.Copy(
        step=0, source="s3", own=False, plain_dcp=True, bucket=bucket, folder_prefix=prefix
    )


def _error_doc(exc: BaseException) -> dict[str, typing.Any]:
    return {"error": str(exc) or repr(exc), "type": type(exc).__name__}


def _raise_error_doc(doc: typing.Mapping[str, typing.Any], *, where: str) -> None:
    """Raise on this rank what another rank raised (same type for the known ones)."""
    if not doc.get("error"):
        return
    kinds: dict[str, type[errors.CheckpointError]] = {
        "ConfigurationError": errors.ConfigurationError,
        "TransportError": errors.TransportError,
        "RemoteError": errors.RemoteError,
    }
    raise kinds.get(doc.get("type", ""), errors.CheckpointError)(f"{where}: {doc['error']}")


# -- agree: every rank acts on the same verdict ----------------------------------------


def _agree(ctx: fetch_mod.Context, key: str, report: verdict_mod.Report) -> verdict_mod.Verdict:
    """All ranks' reports → one verdict; S3 failures fail the restore everywhere."""
    ctx.coordinator.publish(f"{key}/verified", report.to_json())
    reports = ctx.coordinator.gather(f"{key}/verified", timeout=ctx.timeout)
    found = verdict_mod.judge([verdict_mod.Report.from_json(doc) for doc in reports])
    if found.status == "transport":
        raise errors.TransportError(
            f"restore failed, S3 kept failing (not falling back): {found.reason}"
        )
    if found.status == "refused":
        raise errors.RemoteError(f"restore failed, S3 refused a request: {found.reason}")
    return found


def _barrier(ctx: fetch_mod.Context, key: str) -> None:
    ctx.coordinator.publish(key, {"ok": True})
    ctx.coordinator.gather(key, timeout=ctx.timeout)


# -- reject: keep what is not proven corrupt; quarantine what is ---------------------------


def _reject(
    ctx: fetch_mod.Context,
    copy: verdict_mod.Copy,
    fetched: fetch_mod.Fetched,
    found: verdict_mod.Verdict,
    *,
    key: str,
) -> list[str]:
    """Quarantine a proven-corrupt copy of this job; drop our own download."""
    moved: list[str] = []
    if found.status == "corrupt" and _ours(ctx, copy, fetched):
        reason = f"corrupt: {found.reason}"
        if copy.source == "local":
            mine = ctx.rank == 0 if ctx.shared else fetched.report.status == "corrupt"
            if mine and fetched.folder is not None:
                moved.append(str(_quarantine_local(ctx, fetched.folder, copy.step, reason)))
        elif ctx.rank == 0:
            moved.extend(_quarantine_remote(ctx, copy.step, reason))
    if fetched.downloaded and fetched.folder is not None and (ctx.rank == 0 or not ctx.shared):
        shutil.rmtree(fetched.folder, ignore_errors=True)  # our own download, never a step
    # Every rank learns what any rank moved (and none goes on before).
    ctx.coordinator.publish(f"{key}/settled", {"moved": moved})
    reports = ctx.coordinator.gather(f"{key}/settled", timeout=ctx.timeout)
    return sorted({str(path) for report in reports for path in report["moved"]})


def _ours(ctx: fetch_mod.Context, copy: verdict_mod.Copy, fetched: fetch_mod.Fetched) -> bool:
    """A step of this job in its own namespace (only those are ever moved)."""
    if not copy.own or copy.folder_prefix is not None or fetched.manifest is None:
        return False
    return layout.owns(fetched.manifest.job_uid, job_uid=ctx.opts.job_uid)


def _quarantine_local(
    ctx: fetch_mod.Context, folder: pathlib.Path, step: int, reason: str
) -> pathlib.Path:
    moved = aside.move_aside_local(
        ctx.opts.directory, folder, kind="quarantine", tag=ctx.tag, reason=reason
    )
    ctx.emit("quarantined", step, f"local copy moved to {moved}: {reason}")
    return moved


def _quarantine_remote(ctx: fetch_mod.Context, step: int, reason: str) -> list[str]:
    client, s3opts = fetch_mod.s3(ctx)
    try:
        moved = aside.move_aside_remote(
            client, s3opts, step, kind="quarantine", tag=ctx.tag, reason=reason
        )
    except errors.CheckpointError as exc:
        # The corrupt copy stays where it is; the next restore finds it corrupt again.
        log.warning("could not quarantine step %d in S3: %s", step, exc)
        return []
    ctx.emit("quarantined", step, f"S3 copy moved to s3://{s3opts.bucket}/{moved}: {reason}")
    return [f"s3://{s3opts.bucket}/{moved}"]


def _report_skipped(
    ctx: fetch_mod.Context, failed: dict[int, list[str]], *, loaded: int | None
) -> tuple[tuple[int, str], ...]:
    """Steps none of whose copies loaded, newest first; each one an event."""
    skipped = tuple(
        (step, "; ".join(reasons))
        for step, reasons in sorted(failed.items(), reverse=True)
        if step != loaded
    )
    for step, reason in skipped:
        log.warning("checkpoint step %d failed verification, falling back: %s", step, reason)
        ctx.emit("restore_fallback", step, reason)
    return skipped


# -- use: install a verified download, load it -----------------------------------------------


def _use(
    ctx: fetch_mod.Context,
    copy: verdict_mod.Copy,
    fetched: fetch_mod.Fetched,
    *,
    key: str,
    objects: typing.Mapping[str, state.Stateful],
    uri: str | None,
) -> RestoreResult:
    folder = fetched.folder
    assert folder is not None  # an "ok" verdict always has a folder
    if fetched.downloaded and _ours(ctx, copy, fetched):
        folder = _install(ctx, copy, fetched, key=key)
    if copy.plain_dcp:
        assert fetched.meta is not None
        imported = foreign.load(
            folder,
            meta=fetched.meta,
            objects=objects,
            user_map=ctx.key_map,
            process_group=ctx.process_group,
        )
        step = copy.step if imported.step is None else imported.step
        result = RestoreResult(
            step=step,
            source=copy.source,
            skipped_state=imported.not_imported,
            world_size=0,
            imported=True,
            uri=uri,
        )
    else:
        assert fetched.manifest is not None
        result = _load(folder=folder, manifest=fetched.manifest, objects=objects, ctx=ctx)
        imported_step = not _ours(ctx, copy, fetched)
        result = dataclasses.replace(result, source=copy.source, imported=imported_step, uri=uri)
    if fetched.downloaded:
        # Every rank passes this barrier (a node-local rank may have installed
        # its download while another loaded from its temporary folder).
        _barrier(ctx, f"{key}/loaded")
        if folder != layout.step_dir(ctx.opts.directory, copy.step) and (
            ctx.rank == 0 or not ctx.shared
        ):
            shutil.rmtree(folder, ignore_errors=True)  # our own download, not a step
    ctx.emit(
        "restored",
        result.step,
        f"from {copy.label}" + (" (imported)" if result.imported else ""),
        nbytes=fetched.manifest.total_bytes if fetched.manifest else 0,
    )
    return result


def _install(
    ctx: fetch_mod.Context, copy: verdict_mod.Copy, fetched: fetch_mod.Fetched, *, key: str
) -> pathlib.Path:
    """Commit a verified download of this job's step locally (rename), if the
    step folder is free; returns the folder to load from."""
    assert fetched.folder is not None and fetched.manifest is not None
    final = layout.step_dir(ctx.opts.directory, copy.step)
    if not ctx.shared:
        return _commit_download(fetched.folder, final, fetched.manifest)
    if ctx.rank == 0:
        try:
            where = _commit_download(fetched.folder, final, fetched.manifest)
        except Exception as exc:
            ctx.coordinator.broadcast(f"{key}/installed", _error_doc(exc))
            raise
        ctx.coordinator.broadcast(f"{key}/installed", {"folder": str(where)})
        return where
    doc = ctx.coordinator.wait_for(f"{key}/installed", timeout=ctx.timeout)
    _raise_error_doc(doc, where="installing the download on rank 0")
    return pathlib.Path(doc["folder"])


def _commit_download(
    tmp: pathlib.Path, final: pathlib.Path, manifest: manifest_mod.Manifest
) -> pathlib.Path:
    if final.exists() or final.is_symlink():
        return tmp  # a copy we skipped (unreadable here) stays untouched
    layout.mark_uploaded(tmp)
    try:
        layout.commit_folder(tmp, final, manifest)
    except errors.FencedError as exc:
        log.warning("verified download of step %d not committed locally: %s", manifest.step, exc)
        return tmp
    return final


def _load(
    *,
    folder: pathlib.Path,
    manifest: manifest_mod.Manifest,
    objects: typing.Mapping[str, state.Stateful],
    ctx: fetch_mod.Context,
) -> RestoreResult:
    """DCP-load a verified Cairn step into objects (collective over the group)."""
    same_world = manifest.world_size == ctx.world
    template: dict[str, typing.Any] = {}
    skipped_state: list[str] = []
    for name, obj in objects.items():
        if state.is_per_rank(obj) and not same_world:
            # Rank r of a different world has no state of its own; DCP can
            # reshard tensors, not meaning.
            skipped_state.append(name)
            continue
        template[state_key(name, obj, ctx.rank)] = obj.state_dict()
    # Device-specific state (CUDA RNG) saved on another device: not requested.
    present = state.checkpoint_keys(folder)
    for name, obj in objects.items():
        state.drop_absent_optional(
            template, key=state_key(name, obj, ctx.rank), obj=obj, present=present
        )
    state_dict_loader.load(
        template,
        checkpoint_id=folder,
        process_group=ctx.process_group,
        no_dist=ctx.process_group is None,
    )
    for name, obj in objects.items():
        key = state_key(name, obj, ctx.rank)
        if key in template:
            obj.load_state_dict(template[key])
    if skipped_state:
        log.warning(
            "world size changed (%d -> %d): per-rank state %s not restored",
            manifest.world_size,
            ctx.world,
            skipped_state,
        )
    return RestoreResult(
        step=manifest.step,
        source="local",
        skipped_state=tuple(skipped_state),
        world_size=manifest.world_size,
    )
