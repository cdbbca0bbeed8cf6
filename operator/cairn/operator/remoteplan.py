"""What the operator decides about a job's S3 prefix: verification and retention.

Pure: a listing of the prefix (step folders -> objects with size and, where
the store returns one, its full-object CRC32C), the parsed manifests, the
job's remote retention and the steps that must stay in, a ``RemotePlan`` out.
``s3store`` does the I/O; ``handlers`` applies the plan.

Verification of a step: its manifest object exists and parses, its ``step``
matches the folder, and every file it lists exists with the listed size and,
where the store reported a full-object CRC32C (``head_object`` with
``ChecksumMode=ENABLED``), the listed CRC32C. Multipart uploads only carry a
composite checksum (a CRC of the part CRCs, ``...==-N``), which cannot be
compared with a whole-file CRC32C; those files are checked by size only and
the verdict says so (``method="size"``).

Retention: the shared ``cairn.api.retention.plan_remote`` over the *verified*
steps (keepLast newest plus keepEvery milestones), then these are never
deleted: the newest verified step, the step the job resumed from (status
``resumedFrom`` and ``spec.checkpoint.resume.step``), a step with a manifest
that fails verification (kept for inspection and reported), and a step
without a manifest that may still be uploading (newer than the newest
manifest, in flight, or not older than the writer's last local commit). A
step folder without a manifest older than the newest verified step is an
abandoned partial and is deleted. Each deletion lists the manifest first
(``retention.deletion_order``), so a half-deleted step is never mistaken for
a committed one. Nothing is deleted unless ``retention.remote`` is set.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import datetime
from collections.abc import Mapping
from typing import Any, Literal

from cairn.api import checkpointspec, jobstatus, retention
from cairn.api import manifest as manifest_mod

Method = Literal["crc32c", "size"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RemoteObject:
    """One object under a step folder, as the store reported it."""

    size: int
    crc32c: str | None = None
    """Full-object CRC32C as 8 lowercase hex digits; None when the store gave
    none or only a composite (multipart) checksum."""


StepObjects = Mapping[str, RemoteObject]
"""A step folder's objects by path relative to the folder."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ManifestError:
    """The manifest object exists but could not be read or parsed."""

    message: str


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Verdict:
    """The verification of one step that has a manifest object."""

    step: int
    verified: bool
    method: Method | None = None
    """How the files were compared (``size``: at least one had no full-object CRC32C)."""
    reason: str = ""
    """Why verification failed, or which files were checked by size only."""
    files: int = 0
    bytes: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StepDeletion:
    """Delete these objects of one step folder, in this order (manifest first)."""

    step: int
    paths: tuple[str, ...]
    partial: bool
    """True for an abandoned partial (no manifest)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RemotePlan:
    verdicts: tuple[Verdict, ...]
    """One per step with a manifest object, oldest first."""
    newest_verified: Verdict | None
    deletions: tuple[StepDeletion, ...]
    """Committed steps oldest first, then abandoned partials."""
    kept: tuple[int, ...]
    """Committed (manifest present) steps that stay, oldest first."""

    @property
    def verified_steps(self) -> tuple[int, ...]:
        return tuple(v.step for v in self.verdicts if v.verified)

    @property
    def failed(self) -> tuple[Verdict, ...]:
        return tuple(v for v in self.verdicts if not v.verified)

    @property
    def deleted_steps(self) -> tuple[int, ...]:
        return tuple(d.step for d in self.deletions)


def crc32c_hex_from_s3(value: str | None, checksum_type: str | None = None) -> str | None:
    """S3's base64 ``ChecksumCRC32C`` as 8 hex digits, or None if not a full-object one.

    A composite checksum (``ChecksumType=COMPOSITE`` or a ``-<parts>`` suffix)
    is a checksum of part checksums and is not comparable with a file's CRC32C.
    """
    if not value or checksum_type == "COMPOSITE" or "-" in value:
        return None
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return None
    if len(raw) != 4:
        return None
    return raw.hex()


def verify_step(
    *, step: int, objects: StepObjects, manifest: manifest_mod.Manifest | ManifestError
) -> Verdict:
    """Do the step's objects match its manifest? Pure."""
    if isinstance(manifest, ManifestError):
        return Verdict(step=step, verified=False, reason=f"manifest unreadable: {manifest.message}")
    if manifest.step != step:
        return Verdict(
            step=step,
            verified=False,
            reason=f"manifest says step {manifest.step}, folder is step {step}",
        )
    size_only: list[str] = []
    for entry in manifest.files:
        found = objects.get(entry.path)
        if found is None:
            return Verdict(step=step, verified=False, reason=f"{entry.path} is missing")
        if found.size != entry.size:
            return Verdict(
                step=step,
                verified=False,
                reason=f"{entry.path} has {found.size} bytes, manifest says {entry.size}",
            )
        if found.crc32c is None:
            size_only.append(entry.path)
        elif found.crc32c != entry.crc32c:
            return Verdict(
                step=step,
                verified=False,
                reason=f"{entry.path} has CRC32C {found.crc32c}, manifest says {entry.crc32c}",
            )
    method: Method = "size" if size_only else "crc32c"
    reason = ""
    if size_only:
        reason = f"{len(size_only)} of {len(manifest.files)} files checked by size only (no full-object CRC32C in the store)"
    return Verdict(
        step=step,
        verified=True,
        method=method,
        reason=reason,
        files=len(manifest.files),
        bytes=manifest.total_bytes,
    )


def plan(
    *,
    listing: Mapping[int, StepObjects],
    manifests: Mapping[int, manifest_mod.Manifest | ManifestError],
    remote: checkpointspec.RemoteRetention | None,
    protected: frozenset[int] = frozenset(),
    in_flight: frozenset[int] = frozenset(),
    last_committed: int | None = None,
) -> RemotePlan:
    """Verify every step with a manifest and decide what retention deletes. Pure.

    ``listing``: every ``step-<N>`` folder under the prefix. ``manifests``:
    the read result for each step whose folder holds ``manifest.json``.
    ``protected``: steps never deleted (resumed-from). ``in_flight`` and
    ``last_committed``: the writer's reported in-flight steps and last local
    commit; a manifest-less folder at or above either may still be uploading.
    """
    name = manifest_mod.MANIFEST_NAME
    with_manifest = sorted(step for step, objs in listing.items() if name in objs)
    verdicts = tuple(
        verify_step(
            step=step,
            objects=listing[step],
            manifest=manifests.get(step, ManifestError(message="not read")),
        )
        for step in with_manifest
    )
    verified = [v for v in verdicts if v.verified]
    newest_verified = verified[-1] if verified else None
    if remote is None:
        return RemotePlan(
            verdicts=verdicts,
            newest_verified=newest_verified,
            deletions=(),
            kept=tuple(with_manifest),
        )
    keep = set(protected)
    if newest_verified is not None:
        keep.add(newest_verified.step)
    doomed: list[int] = []
    if remote.keep_last is not None:
        records = [retention.StepRecord(step=v.step, committed=True) for v in verified]
        doomed = [
            step
            for step in retention.plan_remote(
                steps=records, keep_last=remote.keep_last, keep_every=remote.keep_every
            )
            if step not in keep
        ]
    deletions = [
        StepDeletion(
            step=step, paths=tuple(retention.deletion_order(list(listing[step]))), partial=False
        )
        for step in doomed
    ]
    newest_manifest = with_manifest[-1] if with_manifest else None
    if newest_verified is not None:
        for step in sorted(s for s in listing if name not in listing[s]):
            maybe_uploading = (
                (newest_manifest is not None and step > newest_manifest)
                or step in in_flight
                or (last_committed is not None and step >= last_committed)
            )
            if step < newest_verified.step and step not in keep and not maybe_uploading:
                deletions.append(
                    StepDeletion(step=step, paths=tuple(sorted(listing[step])), partial=True)
                )
    gone = {d.step for d in deletions}
    return RemotePlan(
        verdicts=verdicts,
        newest_verified=newest_verified,
        deletions=tuple(deletions),
        kept=tuple(s for s in with_manifest if s not in gone),
    )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Notice:
    """A Kubernetes Event the operator posts about the prefix."""

    type: Literal["Normal", "Warning"]
    reason: str
    message: str


def _time(now: datetime.datetime) -> str:
    return now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def storage_update(
    *,
    previous: jobstatus.StorageStatus | None,
    result: RemotePlan | None,
    deleted: tuple[int, ...],
    error: str | None,
    now: datetime.datetime,
) -> tuple[dict[str, Any] | None, tuple[Notice, ...]]:
    """The ``status.storage`` merge patch (None: nothing changed) and the events. Pure.

    ``result`` is None when the prefix could not be read (``error`` says why);
    then only ``lastError`` changes. ``deleted`` are the steps whose deletion
    completed. Events: ``CheckpointVerified`` for a new newest verified step,
    ``VerificationFailed`` (Warning) for a step that newly failed,
    ``RetentionDeleted`` when steps were deleted.
    """
    before = previous or jobstatus.StorageStatus()
    patch: dict[str, Any] = {}
    notices: list[Notice] = []
    if error != before.last_error:
        patch["lastError"] = error
    if result is None:
        return (patch or None), ()
    newest = result.newest_verified
    if newest is not None and newest.step != before.verified_step:
        patch["verifiedStep"] = newest.step
        patch["verifiedTime"] = _time(now)
        patch["verifiedBy"] = newest.method
        how = "CRC32C" if newest.method == "crc32c" else "size only"
        notices.append(
            Notice(
                type="Normal",
                reason="CheckpointVerified",
                message=f"step {newest.step} verified in S3 ({newest.files} files, {newest.bytes} bytes, {how})"
                + (f": {newest.reason}" if newest.reason else ""),
            )
        )
    elif newest is not None and newest.method != before.verified_by:
        patch["verifiedBy"] = newest.method
    corrupt = [v.step for v in result.failed][-jobstatus.REMOTE_STEPS_LIMIT :]
    known_corrupt = set(before.corrupt_steps or ())
    for verdict in result.failed:
        if verdict.step not in known_corrupt:
            notices.append(
                Notice(
                    type="Warning",
                    reason="VerificationFailed",
                    message=f"step {verdict.step} failed verification: {verdict.reason}",
                )
            )
    if corrupt != list(before.corrupt_steps or []):
        patch["corruptSteps"] = corrupt or None
    remote_steps = list(result.kept)[-jobstatus.REMOTE_STEPS_LIMIT :]
    if remote_steps != list(before.remote_steps or []):
        patch["remoteSteps"] = remote_steps
    if deleted:
        patch["lastRetentionTime"] = _time(now)
        notices.append(
            Notice(
                type="Normal",
                reason="RetentionDeleted",
                message="deleted steps " + ", ".join(str(s) for s in deleted) + " from S3",
            )
        )
    return (patch or None), tuple(notices)
