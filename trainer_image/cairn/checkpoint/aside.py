"""Moving checkpoint steps aside: the one alternative to deleting them.

A step that must leave the main namespace but is not proven garbage (a
corrupt step of this job, a step of a superseded lineage, a step of another
job that would collide) is moved, never deleted:

    local:  <root>/step-N                      ->  <root>/.cairn/<kind>/<tag>/step-N
            (and <root>/.cairn/<kind>/<tag>/step-N.reason.txt says why)
    S3:     <prefix>/step-N/manifest.json      ->  <prefix>/.cairn/<kind>/<tag>/step-N/manifest.json
            (and <prefix>/.cairn/<kind>/<tag>/step-N.reason.txt says why)

Locally the folder is renamed (same filesystem: it lives under the root), so
nothing is copied and an interruption leaves it either in place or moved. In
S3 the manifest object is copied byte for byte (someone else's manifest is
never re-dumped) and only then deleted from the main namespace; the data
objects stay where they are (their keys are listed by the moved manifest).
A step without its manifest in the main namespace is no longer committed, so
discovery, resume and rotation no longer see it.

The reason file sits next to the moved step rather than inside it, so
nothing is ever added to a step's own files (a moved-back step is exactly
what was committed). Names never collide: when the destination
is taken (the same step moved aside twice), a suffix `.1`, `.2`... is added.

Side effects only on the given root / bucket; called by restore
(quarantine) and by the lineage and start-up code (superseded, foreign).

Bounded (`plan_prune`, pure; `prune` acts, from every rotation): per
volume, the newest `keep` folders of each kind stay; older ones are
deleted only when they are provably THIS job's and either proven corrupt
(`quarantine`) or a step this job committed, read and then abandoned by a
rollback (`superseded`). `foreign` folders (another job's, or what Cairn
could not read) and anything whose tag does not name this job are never
deleted, however many there are.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import shutil
import time
import typing

import botocore.exceptions

from cairn.api import manifest as manifest_mod
from cairn.checkpoint import errors, layout, options, remote

if typing.TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

log = logging.getLogger(__name__)

Kind = typing.Literal["quarantine", "superseded", "foreign"]
KINDS: tuple[Kind, ...] = ("quarantine", "superseded", "foreign")
ASIDE_DIR = ".cairn"
"""Folder under the checkpoint root (and key prefix under the S3 prefix)."""
REASON_SUFFIX = ".reason.txt"
_MAX_SUFFIX = 1000


def _check(kind: str, tag: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"aside kind must be one of {KINDS}, got {kind!r}")
    # The tag becomes one path component / key segment.
    manifest_mod.check_relative_path(tag)
    if "/" in tag:
        raise ValueError(f"aside tag must be one path component, got {tag!r}")


def aside_dir(root: pathlib.Path, *, kind: Kind, tag: str) -> pathlib.Path:
    """`<root>/.cairn/<kind>/<tag>`: where steps of this kind and tag go. Pure."""
    _check(kind, tag)
    return root / ASIDE_DIR / kind / tag


def _free_name(parent: pathlib.Path, name: str) -> str:
    """`name`, or `name.<i>` for the smallest i whose folder and reason are both free."""
    for index in range(_MAX_SUFFIX):
        candidate = name if index == 0 else f"{name}.{index}"
        if (
            not (parent / candidate).exists()
            and not (parent / f"{candidate}{REASON_SUFFIX}").exists()
        ):
            return candidate
    raise errors.CheckpointError(f"{parent}: more than {_MAX_SUFFIX} copies of {name} set aside")


def _write_durably(path: pathlib.Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("wb") as stream:
        stream.write(data)
        stream.flush()
        os.fsync(stream.fileno())
    tmp.replace(path)


def _makedirs_durably(root: pathlib.Path, target: pathlib.Path) -> None:
    """mkdir -p target under root, fsyncing each parent that gained an entry."""
    missing: list[pathlib.Path] = []
    current = target
    while not current.exists() and current != root:
        missing.append(current)
        current = current.parent
    for folder in reversed(missing):
        folder.mkdir(exist_ok=True)
        layout.fsync_dir(folder.parent)


def move_aside_local(
    root: pathlib.Path,
    folder: pathlib.Path,
    *,
    kind: Kind,
    tag: str,
    reason: str,
    before_rename: typing.Callable[[], None] | None = None,
) -> pathlib.Path:
    """Rename `folder` (a direct child of root) to `<root>/.cairn/<kind>/<tag>/`.

    Writes `<name>.reason.txt` beside it first, renames, fsyncs both parents;
    returns the new path. Never deletes: on any error the folder stays where
    it was (or is fully moved) and the error is raised. `before_rename` runs
    between the reason file and the rename (the kill trials' pause point: a
    reason file beside no folder is what a crash there leaves).
    """
    root = pathlib.Path(root)
    folder = pathlib.Path(folder)
    if folder.parent.resolve() != root.resolve():
        raise ValueError(f"{folder} is not a direct child of {root}")
    if folder.is_symlink() or not folder.is_dir():
        raise errors.CheckpointError(f"{folder} is not a folder; nothing moved aside")
    target_parent = aside_dir(root, kind=kind, tag=tag)
    _makedirs_durably(root, target_parent)
    name = _free_name(target_parent, folder.name)
    target = target_parent / name
    _write_durably(target_parent / f"{name}{REASON_SUFFIX}", _reason_bytes(kind, folder, reason))
    if before_rename is not None:
        before_rename()
    # Directory rename: atomic, and os.rename onto an existing non-empty
    # folder fails, which _free_name already avoided.
    os.rename(folder, target)
    layout.fsync_dir(target_parent)
    layout.fsync_dir(root)
    log.warning("checkpoint folder %s moved aside to %s: %s", folder, target, reason)
    return target


def _reason_bytes(kind: str, source: object, reason: str) -> bytes:
    return f"kind: {kind}\nfrom: {source}\nreason: {reason}\n".encode()


def aside_prefix(opts: options.S3Options, *, kind: Kind, tag: str) -> str:
    """`<prefix>/.cairn/<kind>/<tag>` (no trailing slash). Pure."""
    _check(kind, tag)
    base = f"{opts.prefix}/{ASIDE_DIR}" if opts.prefix else ASIDE_DIR
    return f"{base}/{kind}/{tag}"


def move_aside_remote(
    client: S3Client,
    s3opts: options.S3Options,
    step: int,
    *,
    kind: Kind,
    tag: str,
    reason: str,
) -> str:
    """Move step's manifest object aside; returns the new manifest key.

    Copy the raw manifest bytes (plus a reason object), then delete the
    original manifest; data objects are untouched. Idempotent after an
    interruption: if the original is already gone but a copy exists in the
    aside prefix, that copy's key is returned. Raises RemoteError on S3
    errors (after botocore's bounded retries), CheckpointError when there is
    no manifest to move.
    """
    source = f"{remote.step_prefix(s3opts, step)}/{manifest_mod.MANIFEST_NAME}"
    parent = aside_prefix(s3opts, kind=kind, tag=tag)
    bucket = s3opts.bucket
    try:
        body = _get_or_none(client, bucket, source)
        if body is None:
            return _already_moved(client, s3opts, step, parent=parent, source=source)
        name = _free_key_name(client, bucket, parent, manifest_mod.step_dir_name(step), body)
        target = f"{parent}/{name}/{manifest_mod.MANIFEST_NAME}"
        client.put_object(
            Bucket=bucket,
            Key=f"{parent}/{name}{REASON_SUFFIX}",
            Body=_reason_bytes(kind, f"s3://{bucket}/{source}", reason),
        )
        client.put_object(Bucket=bucket, Key=target, Body=body)
        # Only a copy that reads back identical lets the original go.
        if _get_or_none(client, bucket, target) != body:
            raise errors.RemoteError(f"s3://{bucket}/{target} does not read back as copied")
        client.delete_object(Bucket=bucket, Key=source)
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
        raise errors.RemoteError(
            f"moving s3://{bucket}/{source} aside ({kind}) failed: {exc}"
        ) from exc
    log.warning(
        "checkpoint step %d in S3 moved aside to s3://%s/%s: %s", step, bucket, target, reason
    )
    return target


def _get_or_none(client: S3Client, bucket: str, key: str) -> bytes | None:
    try:
        return client.get_object(Bucket=bucket, Key=key)["Body"].read()
    except botocore.exceptions.ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        if code in ("NoSuchKey", "404") or status == 404:
            return None
        raise


def _free_key_name(client: S3Client, bucket: str, parent: str, name: str, body: bytes) -> str:
    """`name` or `name.<i>`: the first slot that is free or already holds `body`."""
    for index in range(_MAX_SUFFIX):
        candidate = name if index == 0 else f"{name}.{index}"
        existing = _get_or_none(
            client, bucket, f"{parent}/{candidate}/{manifest_mod.MANIFEST_NAME}"
        )
        if existing is None or existing == body:
            return candidate
    raise errors.CheckpointError(
        f"s3://{bucket}/{parent}: more than {_MAX_SUFFIX} copies of {name} set aside"
    )


def _already_moved(
    client: S3Client, s3opts: options.S3Options, step: int, *, parent: str, source: str
) -> str:
    """The key of the newest copy moved aside earlier (the original is gone)."""
    name = manifest_mod.step_dir_name(step)
    found: str | None = None
    for index in range(_MAX_SUFFIX):
        candidate = name if index == 0 else f"{name}.{index}"
        key = f"{parent}/{candidate}/{manifest_mod.MANIFEST_NAME}"
        if _get_or_none(client, s3opts.bucket, key) is None:
            break
        found = key
    if found is None:
        raise errors.CheckpointError(
            f"s3://{s3opts.bucket}/{source} does not exist; nothing moved aside"
        )
    return found


# -- bounded: pruning what was moved aside ------------------------------------------

PRUNABLE: tuple[Kind, ...] = ("quarantine", "superseded")
"""Kinds whose old folders may be deleted (this job's only); `foreign` never."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Entry:
    """One folder moved aside on this volume."""

    kind: Kind
    tag: str
    folder: pathlib.Path
    moved_at: float
    """When it was moved (its reason file's mtime; the folder's own if absent)."""


def observe(root: pathlib.Path) -> list[Entry]:
    """Every folder under `<root>/.cairn/<kind>/<tag>/` (symlinks skipped)."""
    found: list[Entry] = []
    for kind in KINDS:
        base = root / ASIDE_DIR / kind
        if not base.is_dir():
            continue
        for tag_dir in sorted(base.iterdir()):
            if tag_dir.is_symlink() or not tag_dir.is_dir():
                continue
            for folder in sorted(tag_dir.iterdir()):
                if folder.is_symlink() or not folder.is_dir():
                    continue
                reason = folder.with_name(f"{folder.name}{REASON_SUFFIX}")
                try:
                    moved_at = (reason if reason.is_file() else folder).stat().st_mtime
                except OSError:
                    continue  # vanished or unreadable: nothing to decide about
                found.append(Entry(kind=kind, tag=tag_dir.name, folder=folder, moved_at=moved_at))
    return found


def plan_prune(
    entries: typing.Sequence[Entry], *, job_uid: str | None, keep: int
) -> tuple[Entry, ...]:
    """What to delete: per kind, beyond the newest `keep`, this job's prunable ones. Pure.

    This job's = the tag is one of this job's attempts (`<uid8>-a<n>`: the
    quarantining attempt, or the superseded lineage); a `legacy` lineage, a
    tag of another job (a re-created job on an old volume) and `foreign`
    folders are never deleted.
    """
    own = f"{layout.uid8(job_uid)}-a"
    delete: list[Entry] = []
    for kind in PRUNABLE:
        of_kind = sorted(
            (e for e in entries if e.kind == kind),
            key=lambda e: (e.moved_at, str(e.folder)),
            reverse=True,
        )
        delete.extend(e for e in of_kind[keep:] if e.tag.startswith(own))
    return tuple(delete)


def prune(root: pathlib.Path, *, job_uid: str | None, keep: int) -> list[pathlib.Path]:
    """Delete what `plan_prune` allows (folder, then its reason file), and this
    job's orphaned reason files (`orphan_reasons`); returns the folders."""
    deleted: list[pathlib.Path] = []
    for entry in plan_prune(observe(root), job_uid=job_uid, keep=keep):
        shutil.rmtree(entry.folder, ignore_errors=True)
        entry.folder.with_name(f"{entry.folder.name}{REASON_SUFFIX}").unlink(missing_ok=True)
        log.info("removed %s folder %s (beyond the newest %d kept)", entry.kind, entry.folder, keep)
        deleted.append(entry.folder)
    for orphan in orphan_reasons(root, job_uid=job_uid):
        orphan.unlink(missing_ok=True)
        log.info("removed %s: a reason file beside no folder (a crash before its move)", orphan)
    return deleted


ORPHAN_GRACE_SECONDS = 600.0
"""A reason file younger than this may belong to a move in flight (written,
not yet renamed): left alone."""


def orphan_reasons(
    root: pathlib.Path,
    *,
    job_uid: str | None,
    now: float | None = None,
    grace: float = ORPHAN_GRACE_SECONDS,
) -> list[pathlib.Path]:
    """Reason files of this job's prunable kinds with no folder beside them.

    `move_aside_local` writes the reason file before its rename, so a crash
    between the two leaves one (the next attempt quarantines under its own
    tag): without this they would pile up, one per such crash. Only this
    job's tags (as `plan_prune`), only files older than `grace`; a file
    whose folder exists is the folder's, and `foreign` is never touched.
    """
    own = f"{layout.uid8(job_uid)}-a"
    current = time.time() if now is None else now
    found: list[pathlib.Path] = []
    for kind in PRUNABLE:
        base = root / ASIDE_DIR / kind
        if not base.is_dir():
            continue
        for tag_dir in sorted(base.iterdir()):
            if not tag_dir.name.startswith(own) or tag_dir.is_symlink() or not tag_dir.is_dir():
                continue
            for reason in sorted(tag_dir.glob(f"*{REASON_SUFFIX}")):
                folder = reason.with_name(reason.name[: -len(REASON_SUFFIX)])
                try:
                    old = current - reason.lstat().st_mtime > grace
                except OSError:
                    continue
                if old and reason.is_file() and not reason.is_symlink() and not folder.exists():
                    found.append(reason)
    return found
