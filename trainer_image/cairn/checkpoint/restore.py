"""Resume: observe the copies → fetch and verify a share → decide → act.

    restore()          one call on every rank, in the same order; reads as
                       observe → decide → act for each copy, newest first:
      candidates.plan  observe (rank 0): the copies to try, newest step
                       first (the memory copy when the tier is on, the
                       local folder, then the S3 copy of each step),
                       broadcast; an explicit target that does not
                       exist or is of a newer format is a ConfigurationError
      fetch            observe (every rank): ITS share of one copy
                       (`cairn.checkpoint.fetch`; downloads what it lacks
                       from S3, with bounded retries of transient errors;
                       a memory copy: `cairn.checkpoint.memrestore`, own
                       memory else the peer's replica, CRC32C-checked)
      vet              observe (every rank), once a copy verified: its DCP
                       metadata and bytes entries are data, never code
                       (`cairn.checkpoint.vet`); agreed like the fetch
      _agree           decide: all ranks' reports → one verdict and one
                       action (`verdict.judge`, `verdict.action`: pure)
      _use / _reject   act: load the first verified copy with DCP (which
                       reshards; `cairn.checkpoint.load`), or quarantine a
                       proven-corrupt copy of this job and try the next; a
                       memory copy whose data files a rank reads from its
                       peer while loading (`cairn.checkpoint.peerread`)
                       fails the load on every rank when one of them does
                       not match its manifest: that copy is skipped like
                       one that failed its fetch, and the next copy is
                       loaded (every tensor written again)
      _give_up         decide once every copy failed (`verdict.give_up`:
                       pure): a ConfigurationError for an explicit target,
                       a CheckpointError when committed steps all failed,
                       None (fresh start) when there was nothing

Nothing here deletes a step. A copy that cannot be read (EACCES on one
rank, a manifest of a newer format, an absent file, metadata or bytes
entries that are not plain data) is skipped and kept; a
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

import torch.distributed as dist

from cairn.api import manifest as manifest_mod
from cairn.checkpoint import (
    aside,
    candidates,
    errors,
    events,
    faults,
    foreign,
    layout,
    load,
    memrestore,
    memtier,
    options,
    peerread,
    safedcp,
    startup,
    state,
)
from cairn.checkpoint import coordinator as coordinator_mod
from cairn.checkpoint import fetch as fetch_mod
from cairn.checkpoint import verdict as verdict_mod
from cairn.checkpoint import vet as vet_mod

if typing.TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RestoreResult:
    step: int
    source: verdict_mod.Source
    tier: memrestore.Tier | None = None
    """Where the loaded bytes came from, the same on every rank: memory (every
    rank its own memory copy), peer (some rank its peer's replica), local, s3
    (None: not recorded; `source` says local or s3)."""
    tiers: tuple[str, ...] = ()
    """A memory restore: each rank's tier (memory or peer), by rank."""
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
    downloaded: tuple[str, ...] = ()
    """Files THIS rank downloaded from S3 for the copies it tried."""


state_key = load.state_key


@dataclasses.dataclass(kw_only=True, slots=True)
class _Tried:
    """What the copies tried so far left behind (this rank's view)."""

    failed: dict[int, list[str]] = dataclasses.field(default_factory=dict)
    quarantined: list[str] = dataclasses.field(default_factory=list)
    downloaded: list[str] = dataclasses.field(default_factory=list)
    statuses: dict[int, set[verdict_mod.Status]] = dataclasses.field(default_factory=dict)

    def skip(self, copy: verdict_mod.Copy, found: verdict_mod.Verdict, moved: list[str]) -> None:
        self.statuses.setdefault(copy.step, set()).add(found.status)
        kept = f"quarantined to {', '.join(moved)}" if moved else "kept"
        self.failed.setdefault(copy.step, []).append(
            f"{copy.source} {found.status} ({kept}): {found.reason}"
        )
        self.quarantined.extend(moved)


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
    sha256: str | None = None,
    memory: memtier.MemoryTier | None = None,
) -> RestoreResult | None:
    """Load the newest verified committed step (or `step`, or `uri`) into `objects`.

    `sha256` (`resume.sha256`) pins the `.metadata` of the explicit target.

    Returns None when there is nothing to resume from. Raises
    ConfigurationError when an explicit target cannot be loaded,
    TransportError when S3 kept failing, CheckpointError when committed
    steps exist but none verifies.
    """
    base = fetch_mod.Context(
        opts=opts,
        coordinator=coordinator,
        process_group=process_group,
        s3_client=s3_client,
        callbacks=tuple(callbacks),
        namespace=namespace,
        shared=startup.probe_shared(
            directory=opts.directory,
            coordinator=coordinator,
            namespace=namespace,
            timeout=opts.timeout_seconds,
        ),
        explicit=step is not None or uri is not None,
        key_map=key_map,
        objects=objects,
        sha256=sha256 if step is not None or uri is not None else None,
        memory=memory,
    )
    tried = _Tried()
    for index, copy in enumerate(candidates.plan(base, step=step, uri=uri)):
        key = f"{namespace}/copy-{index}"
        ctx = memrestore.context_for(base, copy)  # a memory copy is per rank
        fetched = _fetch(ctx, copy)
        faults.pause_point("restore", rank=ctx.rank, step=copy.step)  # fetched, not loaded
        tried.downloaded.extend(fetched.downloaded_files)
        found = _agree(ctx, key, fetched.report)
        if found.status == "ok":
            # Verified bytes are not yet safe ones: metadata and bytes entries
            # must be data (never run), or the copy is skipped and kept.
            fetched = vet_mod.vet(ctx, copy, fetched)
            found = _agree(ctx, f"{key}/vetted", fetched.report)
        if verdict_mod.action(found.status, ours=_ours(ctx, copy, fetched)) == "load":
            try:
                result = _use(ctx, copy, fetched, key=key, objects=objects, uri=uri)
            except (peerread.PeerReplicaError, safedcp.UnsafeCheckpointError) as exc:
                if copy.source != "memory":
                    raise
                # Raised on every rank alike (DCP gathers the failures). The
                # tensors hold some of its bytes now; the step stays in
                # `tried.failed`, so the next copy loads or restore raises:
                # never a fresh start on them.
                found = verdict_mod.Verdict(status="incomplete", reason=f"loading: {exc}")
                if fetched.streamed is not None:
                    ctx.emit("memory_failed", copy.step, f"peer replica refused: {exc}")
                log.warning("checkpoint %s failed while loading: %s", copy.label, exc)
                _drop_streamed_head(ctx, fetched)
                tried.skip(copy, found, _reject(ctx, copy, fetched, found, key=key))
                continue
            return dataclasses.replace(
                result,
                skipped=_report_skipped(ctx, tried.failed, loaded=copy.step),
                quarantined=tuple(tried.quarantined),
                downloaded=tuple(tried.downloaded),
            )
        log.warning("checkpoint %s not loadable (%s): %s", copy.label, found.status, found.reason)
        tried.skip(copy, found, _reject(ctx, copy, fetched, found, key=key))
    _give_up(base, tried, target=uri if uri is not None else step)
    return None


def _fetch(ctx: fetch_mod.Context, copy: verdict_mod.Copy) -> fetch_mod.Fetched:
    """Observe this rank's share of one copy: from memory, the volume or S3."""
    if copy.source == "memory":
        return memrestore.fetch(ctx, copy)
    return fetch_mod.fetch(ctx, copy)


def _drop_streamed_head(ctx: fetch_mod.Context, fetched: fetch_mod.Fetched) -> None:
    """The head files a peer restore fetched into memory: not a copy of anything."""
    if fetched.streamed is not None and fetched.folder is not None:
        shutil.rmtree(fetched.folder, ignore_errors=True)


def _tier(copy: verdict_mod.Copy, fetched: fetch_mod.Fetched) -> memrestore.Tier:
    if copy.source != "memory":
        return copy.source
    return "peer" if "peer" in fetched.tiers else "memory"


def _give_up(ctx: fetch_mod.Context, tried: _Tried, *, target: str | int | None) -> None:
    """No copy loaded: report every skipped step, then raise or start fresh."""
    skipped = _report_skipped(ctx, tried.failed, loaded=None)
    if not ctx.explicit:
        # Steps none of whose copies is this job's own (another job's, forged:
        # issue #19) are reported above, but never stand in the way of a fresh start.
        skipped = tuple((s, r) for s, r in skipped if tried.statuses.get(s) != {"foreign"})
    error = verdict_mod.give_up(skipped, explicit=ctx.explicit, target=target)
    if error is not None:
        raise error


# -- agree: every rank acts on the same verdict ----------------------------------------


def _agree(ctx: fetch_mod.Context, key: str, report: verdict_mod.Report) -> verdict_mod.Verdict:
    """All ranks' reports → one verdict; S3 failures fail the restore everywhere."""
    ctx.coordinator.publish(f"{key}/verified", report.to_json())
    reports = ctx.coordinator.gather(f"{key}/verified", timeout=ctx.timeout)
    found = verdict_mod.judge([verdict_mod.Report.from_json(doc) for doc in reports])
    # `verdict.action` is "fail" for these two: the network is never a reason to fall back.
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
    # A memory copy is never quarantined: it is this rank's cache, and its
    # failures are reported `incomplete` (the volume and S3 copies are apart).
    quarantine = verdict_mod.action(found.status, ours=_ours(ctx, copy, fetched)) == "quarantine"
    if quarantine and copy.source != "memory":
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
    return layout.own_manifest(
        fetched.manifest, job_uid=ctx.opts.job_uid, keyring=ctx.opts.manifest_keyring
    )


def _quarantine_local(
    ctx: fetch_mod.Context, folder: pathlib.Path, step: int, reason: str
) -> pathlib.Path:
    moved = aside.move_aside_local(
        ctx.opts.directory,
        folder,
        kind="quarantine",
        tag=ctx.tag,
        reason=reason,
        # mid-quarantine: the reason file is written, the folder not yet moved
        before_rename=lambda: faults.pause_point("quarantine", rank=ctx.rank, step=step),
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
            tier=_tier(copy, fetched),
            skipped_state=imported.not_imported,
            world_size=0,
            imported=True,
            uri=uri,
        )
    else:
        assert fetched.manifest is not None
        assert fetched.meta is not None  # vetted
        loaded = load.load(
            folder,
            manifest=fetched.manifest,
            meta=fetched.meta,
            objects=objects,
            rank=ctx.rank,
            world=ctx.world,
            node_local=not ctx.shared,
            process_group=ctx.process_group,
            streams=fetched.streamed,
        )
        _drop_streamed_head(ctx, fetched)
        result = RestoreResult(
            step=loaded.step,
            source=copy.source,
            tier=_tier(copy, fetched),
            tiers=fetched.tiers,
            skipped_state=loaded.skipped_state,
            world_size=loaded.world_size,
            imported=not _ours(ctx, copy, fetched),
            uri=uri,
        )
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
        f"from {copy.label}"
        + (f" [{result.tier}]" if copy.source == "memory" else "")
        + (" (imported)" if result.imported else ""),
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
            ctx.coordinator.broadcast(f"{key}/installed", errors.to_doc(exc))
            raise
        ctx.coordinator.broadcast(f"{key}/installed", {"folder": str(where)})
        return where
    doc = ctx.coordinator.wait_for(f"{key}/installed", timeout=ctx.timeout)
    errors.raise_doc(doc, where="installing the download on rank 0")
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
