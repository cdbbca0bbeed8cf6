"""Restore's fetch step: one rank checks its share of one copy of a step.

`fetch()` looks at a local step folder, or downloads this rank's share of an
S3 copy into an attempt-scoped temporary folder (bounded retries of
transient S3 errors, `cairn.checkpoint.s3transport.retrying`), and verifies it:
sizes and CRC32C against a Cairn manifest, or the sizes DCP's `.metadata`
needs for a plain DCP checkpoint. It never raises for what it finds; the
finding is a `verdict.Report` that every rank then agrees on
(`cairn.checkpoint.restore`). Reads and downloads only: nothing here moves
or deletes anything but files of its own download.

This rank's share of a Cairn step: on a shared volume a slice of the
manifest's files (every rank checks some, together all); on a node-local
volume the files THIS rank's load reads (`load.needed_files`: its DCP load
plan against `.metadata`, which every node-local volume holds), so a rank
never checks or fetches another rank's files it does not read. An S3 copy
on a node-local volume is assembled: files of this rank's committed local
folder that verify are hard-linked in, only the others are downloaded
(`Fetched.downloaded_files` names them).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import typing

import pydantic
import torch.distributed as dist
from torch.distributed.checkpoint import metadata as dcp_metadata

from cairn.api import manifest as manifest_mod
from cairn.checkpoint import (
    aside,
    errors,
    events,
    foreign,
    layout,
    load,
    memtier,
    options,
    peerread,
    remote,
    s3transport,
    state,
)
from cairn.checkpoint import coordinator as coordinator_mod
from cairn.checkpoint import verdict as verdict_mod

if typing.TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Context:
    """What every step of one restore needs; the same on every rank."""

    opts: options.CheckpointOptions
    coordinator: coordinator_mod.Coordinator
    process_group: dist.ProcessGroup | None
    s3_client: S3Client | None
    callbacks: tuple[events.ProgressCallback, ...]
    namespace: str
    shared: bool
    """All ranks see one directory; else each rank has its own (node-local)."""
    explicit: bool
    """The job named its target (resume.step / resume.uri): it must load or
    the job fails with a ConfigurationError; no fallback."""
    key_map: foreign.KeyMap | None = None
    objects: typing.Mapping[str, state.Stateful] = dataclasses.field(default_factory=dict)
    """What will be loaded: on a node-local volume it says which files this rank reads."""
    sha256: str | None = None
    """`resume.sha256` of an explicit target: its `.metadata` must have this
    SHA-256 (checked before it is read)."""
    memory: memtier.MemoryTier | None = None
    """The in-memory tier (None when off): restore tries its copy first
    (`cairn.checkpoint.memrestore`)."""

    @property
    def rank(self) -> int:
        return self.coordinator.rank

    @property
    def world(self) -> int:
        return self.coordinator.world_size

    @property
    def timeout(self) -> float:
        return self.opts.timeout_seconds

    @property
    def tag(self) -> str:
        """`<uid8>-<attempt token>`: names what this attempt (and Ray group) moves aside or downloads."""
        return f"{layout.uid8(self.opts.job_uid)}-{layout.attempt_token(self.opts.attempt, self.opts.group)}"

    def share(self, names: typing.Sequence[str]) -> list[str]:
        """This rank's part of a copy: a slice on a shared volume, all of it otherwise."""
        return list(names[self.rank :: self.world]) if self.shared else list(names)

    def emit(self, phase: events.Phase, step: int, message: str, nbytes: int = 0) -> None:
        event = events.ProgressEvent(
            phase=phase, step=step, rank=self.rank, message=message, bytes=nbytes
        )
        events.emit(self.callbacks, event)


@dataclasses.dataclass(kw_only=True, slots=True)
class Fetched:
    report: verdict_mod.Report
    folder: pathlib.Path | None = None
    manifest: manifest_mod.Manifest | None = None
    meta: dcp_metadata.Metadata | None = None
    downloaded: bool = False
    """`folder` is this attempt's temporary folder (not a committed step)."""
    downloaded_files: tuple[str, ...] = ()
    """Files this rank fetched from S3 (the rest of the folder came from its volume)."""
    tiers: tuple[str, ...] = ()
    """A memory copy: where each rank's share came from (memory or peer), by rank."""
    streamed: peerread.PeerFiles | None = None
    """A memory copy from the peer: this rank's data files, which the load reads
    from the peer's replica (`folder` holds only `.metadata` and the manifest)."""


def s3(ctx: Context) -> tuple[S3Client, options.S3Options]:
    if ctx.s3_client is None or ctx.opts.s3 is None:
        raise errors.ConfigurationError(
            "resume from S3 needs checkpoint.upload (its endpoint and credentials are used)"
        )
    return ctx.s3_client, ctx.opts.s3


def import_dir(ctx: Context) -> pathlib.Path:
    """`<root>/.cairn/import/<uid8>-a<attempt>`: where this attempt downloads an import.

    Folders an earlier attempt of this job left there (it died while
    importing) are provably its own downloads and are removed.
    """
    parent = ctx.opts.directory / aside.ASIDE_DIR / "import"
    folder = parent / ctx.tag
    if not folder.is_dir() and parent.is_dir():
        ours = f"{layout.uid8(ctx.opts.job_uid)}-a"
        for old in parent.iterdir():
            if old.name.startswith(ours) and old.is_dir() and not old.is_symlink():
                shutil.rmtree(old, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


# -- fetch: this rank's share of one copy -------------------------------------------


def fetch(ctx: Context, copy: verdict_mod.Copy) -> Fetched:
    """Check (after downloading, for S3) this rank's share of `copy`. Never raises
    for what it finds: the finding is the report every rank agrees on."""
    try:
        if copy.source == "local":
            return _fetch_local(ctx, copy)
        if copy.plain_dcp:
            return _fetch_remote_plain(ctx, copy)
        return _fetch_remote(ctx, copy)
    except errors.TransportError as exc:
        return Fetched(report=_report(ctx, "transport", str(exc)))
    except remote.MissingObjectError as exc:
        return Fetched(report=_report(ctx, "incomplete", str(exc)))
    except errors.RemoteError as exc:
        return Fetched(report=_report(ctx, "refused", str(exc)))
    except (errors.CheckpointError, pydantic.ValidationError, ValueError, OSError) as exc:
        # EACCES on one rank, a manifest of a newer format or an invalid one,
        # an unsafe path: nothing proven about the data; the copy is kept.
        return Fetched(report=_report(ctx, "unreadable", f"{type(exc).__name__}: {exc}"))


def _report(ctx: Context, status: verdict_mod.Status, detail: str = "") -> verdict_mod.Report:
    return verdict_mod.Report(status=status, detail=detail[:2000], rank=ctx.rank)


def _report_problems(ctx: Context, problems: typing.Sequence[layout.Problem]) -> verdict_mod.Report:
    return _report(ctx, verdict_mod.status_of_problems(problems), verdict_mod.describe(problems))


def _fetch_local(ctx: Context, copy: verdict_mod.Copy) -> Fetched:
    folder = layout.step_dir(ctx.opts.directory, copy.step)
    if not folder.is_dir():
        return Fetched(report=_report(ctx, "incomplete", f"{folder} is absent on this rank"))
    if copy.plain_dcp:
        meta = foreign.read_metadata(folder, sha256=ctx.sha256)
        missing = foreign.verify_folder(folder, meta)
        status: verdict_mod.Status = "incomplete" if missing else "ok"
        return Fetched(
            report=_report(ctx, status, "; ".join(missing[:5])), folder=folder, meta=meta
        )
    manifest = layout.read_manifest(folder)
    checked = _authentic(ctx, manifest)
    if copy.own and not checked.own:  # swapped since planning: never loaded as ours
        return Fetched(report=_report(ctx, "foreign", checked.reason), folder=folder)
    if ctx.shared:
        problems = layout.verify_files(folder, manifest.files[ctx.rank :: ctx.world])
        return Fetched(report=_report_problems(ctx, problems), folder=folder, manifest=manifest)
    # Node-local: `.metadata` first (it says which files this rank reads).
    problems = layout.verify_files(folder, _metadata_entry(manifest))
    if not problems:
        problems = layout.verify_files(folder, _needed_entries(ctx, folder, manifest))
    return Fetched(report=_report_problems(ctx, problems), folder=folder, manifest=manifest)


def _authentic(ctx: Context, manifest: manifest_mod.Manifest) -> manifest_mod.Authenticity:
    return manifest_mod.authenticate(
        manifest, job_uid=ctx.opts.job_uid, keyring=ctx.opts.manifest_keyring
    )


def _metadata_entry(manifest: manifest_mod.Manifest) -> tuple[manifest_mod.FileEntry, ...]:
    return tuple(e for e in manifest.files if e.path == load.METADATA)


def _needed_entries(
    ctx: Context, folder: pathlib.Path, manifest: manifest_mod.Manifest
) -> tuple[manifest_mod.FileEntry, ...]:
    """Node-local: the manifest entries of the files this rank's load reads
    (`folder` holds a verified `.metadata`)."""
    meta = load.read_metadata(folder, manifest=manifest, sha256=ctx.sha256)
    tmpl = load.template(
        ctx.objects,
        rank=ctx.rank,
        same_world=manifest.world_size == ctx.world,
        # An optional key the checkpoint lacks (CUDA RNG) is not requested.
        present=meta.state_dict_metadata.keys(),
    )
    part = load.own_part(tmpl, rank=ctx.rank, node_local=ctx.world > 1)
    names = load.needed_files(meta, part) | {load.METADATA}
    entries = tuple(e for e in manifest.files if e.path in names)
    unlisted = names - {e.path for e in entries}
    if unlisted:
        raise errors.CheckpointError(f"files read by the load are not in the manifest: {unlisted}")
    return entries


def _fetch_remote(ctx: Context, copy: verdict_mod.Copy) -> Fetched:
    """Fetch this rank's share of a Cairn step from S3 into a temporary folder."""
    client, s3opts = s3(ctx)
    bucket = copy.bucket or s3opts.bucket
    prefix = copy.folder_prefix or remote.step_prefix(s3opts, copy.step)
    folder = layout.tmp_step_dir(
        ctx.opts.directory,
        copy.step,
        job_uid=ctx.opts.job_uid,
        attempt=ctx.opts.attempt,
        group=ctx.opts.group,
    )
    folder.mkdir(parents=True, exist_ok=True)
    layout.write_writer_marker(folder, job_uid=ctx.opts.job_uid, attempt=ctx.opts.attempt)
    key = f"{prefix}/{manifest_mod.MANIFEST_NAME}"
    fetched: list[str] = []

    def obtain(
        found: manifest_mod.Manifest, entries: typing.Sequence[manifest_mod.FileEntry]
    ) -> None:
        """Into `folder`: verified local files linked, the rest downloaded."""
        local = _reusable_local(ctx, copy, found)
        missing = [e for e in entries if not _link_verified(local, folder, e)]
        remote.download_files(
            client,
            s3opts,
            bucket=bucket,
            prefix=remote.data_prefix(prefix, found),
            folder=folder,
            names=[e.path for e in missing],
        )
        fetched.extend(e.path for e in missing if e.path not in fetched)

    def manifest_then_share() -> manifest_mod.Manifest | None:
        raw = remote.get_bytes_or_none(client, bucket, key, within=s3opts.stall_seconds)
        if raw is None:
            raise remote.MissingObjectError(f"s3://{bucket}/{key} is gone")
        found = manifest_mod.parse_manifest(raw)
        checked = _authentic(ctx, found)
        if copy.own and not checked.own:
            # Another job's (or a forged) step in our prefix: never loaded
            # implicitly; an explicit resume.step naming it is refused.
            not_own[:] = [checked.reason]
            return None
        wanted[:] = found.files[ctx.rank :: ctx.world] if ctx.shared else _metadata_entry(found)
        obtain(found, wanted)
        if not ctx.shared and not layout.verify_files(folder, tuple(wanted)):
            # Node-local: the verified `.metadata` says what this rank reads
            # (a bad one is reported by the verification below).
            wanted[:] = _needed_entries(ctx, folder, found)
            obtain(found, wanted)
        return found

    wanted: list[manifest_mod.FileEntry] = []
    not_own: list[str] = []
    manifest = s3transport.retrying(manifest_then_share, what=f"restoring {copy.label}")
    if manifest is None:
        why = "; ".join(not_own) or "not this job's own"
        return Fetched(report=_report(ctx, "foreign", why), folder=folder, downloaded=True)
    problems = layout.verify_files(folder, tuple(wanted))
    return Fetched(
        report=_report_problems(ctx, problems),
        folder=folder,
        manifest=manifest,
        downloaded=True,
        downloaded_files=tuple(fetched),
    )


def _reusable_local(
    ctx: Context, copy: verdict_mod.Copy, remote_manifest: manifest_mod.Manifest
) -> pathlib.Path | None:
    """This rank's committed folder of the same step and commit, if any: its
    verified files need no download."""
    if copy.folder_prefix is not None:
        return None
    folder = layout.step_dir(ctx.opts.directory, copy.step)
    try:
        local = layout.read_manifest(folder)
    except errors.CheckpointError:
        return None
    same = (local.attempt, local.created_at, local.job_uid) == (
        remote_manifest.attempt,
        remote_manifest.created_at,
        remote_manifest.job_uid,
    )
    return folder if same else None


def _link_verified(
    local: pathlib.Path | None, folder: pathlib.Path, entry: manifest_mod.FileEntry
) -> bool:
    """Hard-link `entry` from the local committed folder into `folder` if it
    is there and verifies (the committed file is never written to)."""
    if local is None:
        return False
    target = layout.safe_target(folder, entry.path)
    if target.exists():
        return not layout.verify_files(folder, (entry,))
    if layout.verify_files(local, (entry,)):
        return False
    try:
        os.link(layout.safe_target(local, entry.path), target)
    except OSError:
        return False  # another filesystem, or not permitted: download instead
    return True


def _fetch_remote_plain(ctx: Context, copy: verdict_mod.Copy) -> Fetched:
    """Download this rank's share of a plain DCP checkpoint (resume.uri)."""
    client, s3opts = s3(ctx)
    bucket, prefix = copy.bucket or s3opts.bucket, copy.folder_prefix or ""
    folder = import_dir(ctx)

    def download(names: list[str]) -> None:
        s3transport.retrying(
            lambda: remote.download_files(
                client, s3opts, bucket=bucket, prefix=prefix, folder=folder, names=names
            ),
            what=f"importing {copy.label}",
        )

    if not ctx.shared and ctx.rank != 0:
        download([foreign.DCP_METADATA])  # rank 0 fetched it while planning
    meta = foreign.read_metadata(folder, sha256=ctx.sha256)
    sizes = foreign.required_sizes(meta)
    names = ctx.share(sorted(sizes))
    download(names)
    mine = {n: (folder / n).stat().st_size for n in names if (folder / n).is_file()}
    short = [p for p in foreign.verify_listing(mine, meta) if p.split(":")[0] in names]
    status: verdict_mod.Status = "incomplete" if short else "ok"
    found = _report(ctx, status, "; ".join(short[:5]))
    return Fetched(report=found, folder=folder, meta=meta, downloaded=True)
