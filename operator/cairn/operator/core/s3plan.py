"""Plan step of the S3 pass: verification, retention, the status patch, when to pass.

Pure: ``s3observe`` reads the prefix into an ``Observation`` (step folders ->
objects with size and, where the store returns one, its full-object CRC32C;
per step its manifest, or in the operator's pass its verdict already judged,
``Checked``, so no parsed manifest outlives its step); ``plan_job`` turns it, the job's remote retention and
the steps that must stay into a ``RemotePlan``; ``storage_update`` gives the
``status.storage`` merge patch and the Events; ``s3apply`` carries them out;
``s3pass`` runs the three in order. ``pass_wanted`` says whether a job's
prefix is looked at at all (live jobs every interval, a finished job once).

Verification of a step: its manifest object exists and parses, its ``step``
matches the folder, it is this job's own (``cairn.api.manifest.authenticate``:
signed with a key of the job's keyring, the job's manifest-key Secret, and
naming the job's UID; a job without a keyring Secret, created before it
existed, is judged by UID alone), and every file it lists exists with the listed size and,
where the store reported a full-object CRC32C (``head_object`` with
``ChecksumMode=ENABLED``), the listed CRC32C. Multipart uploads only carry a
composite checksum (a CRC of the part CRCs, ``...==-N``), which cannot be
compared with a whole-file CRC32C; those files are checked by size only and
the verdict says so (``method="size"``).

Retention: the shared ``cairn.api.retention.plan_remote`` over the *verified*
steps (keepLast newest plus keepEvery milestones), then these are never
deleted: the newest verified step, the step the job resumed from (status
``resumedFrom`` and ``spec.checkpoint.resume.step``), a step with a manifest
that fails verification or authentication (kept for inspection and
reported: ``corruptSteps``, or ``foreignSteps`` for a step that is not this
job's own), and a step
without a manifest that may still be uploading (newer than the newest
manifest, in flight, or not older than the writer's last local commit). A
step folder without a manifest older than the newest verified step is an
abandoned partial and is deleted. A rotated step's deletion also takes this
job's attempt-scoped objects its manifest does not list (leftovers of an
attempt killed mid-upload, which that rule would delete in the next pass,
if one came). Each deletion lists the manifest first
(``retention.deletion_order``), so a half-deleted step is never mistaken for
a committed one. Nothing is deleted unless ``retention.remote`` is set.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import datetime
import re
import sys
from collections.abc import Mapping
from typing import Any, Literal

from cairn.api import checkpointspec, jobstatus, retention, trainingjob
from cairn.api import manifest as manifest_mod
from cairn.operator.core import clock, k8stypes

Method = Literal["crc32c", "size", "crc32c+hmac", "size+hmac"]


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
class Checked:
    """A step judged by an earlier pass, unchanged since (``s3observe``'s verdict cache):
    its verdict and, for a verified step, the paths its manifest lists (what a
    retention deletion of the step removes). Stands in for the manifest."""

    verdict: Verdict
    paths: frozenset[str] = frozenset()


ManifestRead = manifest_mod.Manifest | ManifestError | Checked
"""What the observe step has for a step's ``manifest.json``."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Observation:
    """What ``s3observe.observe`` saw under the prefix: the plan's S3 input."""

    listing: Mapping[int, StepObjects]
    """Every ``step-<N>`` folder's objects."""
    manifests: Mapping[int, ManifestRead]
    """The read result of each folder's ``manifest.json``, where there is one (or
    its verdict, ``Checked``, when ``s3observe`` judged the step itself)."""
    aside_steps: frozenset[int] = frozenset()
    """Steps with a manifest moved aside under ``<prefix>/.cairn/`` (superseded,
    quarantined, foreign): their data objects stay in ``step-<N>/`` and are
    referenced from there, so they are never abandoned partials."""


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
    foreign: bool = False
    """Not this job's own (authentication failed): kept, reported apart from corrupt steps."""


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
    *,
    step: int,
    objects: StepObjects,
    manifest: ManifestRead,
    job_uid: str | None = None,
    keyring: manifest_mod.Keyring | None = None,
) -> Verdict:
    """Is the manifest this job's own, and do the step's objects match it? Pure."""
    if isinstance(manifest, Checked):
        return manifest.verdict
    if isinstance(manifest, ManifestError):
        return Verdict(step=step, verified=False, reason=f"manifest unreadable: {manifest.message}")
    if manifest.step != step:
        return Verdict(
            step=step,
            verified=False,
            reason=f"manifest says step {manifest.step}, folder is step {step}",
        )
    own = manifest_mod.authenticate(manifest, job_uid=job_uid, keyring=keyring)
    if not own.own:
        return Verdict(step=step, verified=False, foreign=True, reason=own.reason)
    size_only: list[str] = []
    for entry in manifest.files:
        # Data keys resolve through the manifest: attempt-scoped under
        # `data_prefix`, or directly under the step (older Cairn).
        found = objects.get(manifest.data_key(entry.path))
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
    if own.signed:
        method = "size+hmac" if size_only else "crc32c+hmac"
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


def protected_steps(
    job: trainingjob.TrainingJob, status: jobstatus.TrainingJobStatus
) -> frozenset[int]:
    """Steps retention never deletes: what the job resumed from or will resume from. Pure."""
    keep: set[int] = set()
    ckpts = status.checkpoints
    if ckpts is not None and ckpts.resumed_from is not None:
        keep.add(ckpts.resumed_from.step)
    if job.spec.checkpoint.resume.step is not None:
        keep.add(job.spec.checkpoint.resume.step)
    return frozenset(keep)


_DATA_PREFIX = re.compile(r"^a\d+(?:g\d+)?-([0-9A-Za-z-]{1,8})/")
"""``a<attempt>-<uid8>/`` or, for a later rank group of an attempt (an in-place
restart), ``a<attempt>g<group>-<uid8>/`` (`layout.attempt_token`). Before
2026-11-29 only the first form was recognised: a fenced group's leftovers
in a rotated step stayed behind as a manifest-less folder (an e2e run's
listing kept a folder that `status.storage.remoteSteps` did not name), and
in a manifest-less folder another job's group-scoped objects were taken for
this job's unprefixed ones."""


def _attempt_uid8(path: str) -> str | None:
    """The job UID prefix of attempt-scoped data (``a<attempt>[g<group>]-<uid8>/…``);
    None for an object directly under ``step-<N>/``. Pure."""
    match = _DATA_PREFIX.match(path)
    return None if match is None else match.group(1)


def _own_partial(path: str, own_uid8: str | None) -> bool:
    """Whether an object of a manifest-less step folder is this job's to delete. Pure.

    Attempt-scoped data (``a<attempt>[g<group>]-<uid8>/…``) belongs to the job whose
    UID starts with ``uid8``; another job's (a zombie of a deleted job, an
    import) is not ours and is kept. Objects directly under ``step-<N>/``
    (Cairn before attempt-scoped keys) are this job's, as they always were.
    """
    uid8 = _attempt_uid8(path)
    return uid8 is None or own_uid8 is None or uid8 == own_uid8


def plan_job(
    *,
    job: trainingjob.TrainingJob,
    status: jobstatus.TrainingJobStatus,
    observation: Observation,
    keyring: manifest_mod.Keyring | None = None,
) -> RemotePlan:
    """``plan`` with the job's retention, identity and keyring, and the writer's
    reported progress. Pure."""
    ckpts = status.checkpoints
    in_flight = frozenset(f.step for f in (ckpts.in_flight or ())) if ckpts else frozenset()
    last_committed = (
        ckpts.last_committed.step if ckpts is not None and ckpts.last_committed else None
    )
    return plan(
        listing=observation.listing,
        manifests=observation.manifests,
        remote=job.spec.checkpoint.retention.remote,
        protected=protected_steps(job, status),
        in_flight=in_flight,
        last_committed=last_committed,
        aside=observation.aside_steps,
        own_uid8=job.metadata.uid[:8] or None,
        job_uid=job.metadata.uid or None,
        keyring=keyring,
    )


def plan(
    *,
    listing: Mapping[int, StepObjects],
    manifests: Mapping[int, ManifestRead],
    remote: checkpointspec.RemoteRetention | None,
    protected: frozenset[int] = frozenset(),
    in_flight: frozenset[int] = frozenset(),
    last_committed: int | None = None,
    aside: frozenset[int] = frozenset(),
    own_uid8: str | None = None,
    job_uid: str | None = None,
    keyring: manifest_mod.Keyring | None = None,
) -> RemotePlan:
    """Verify every step with a manifest and decide what retention deletes. Pure.

    ``listing``: every ``step-<N>`` folder under the prefix. ``manifests``:
    the read result for each step whose folder holds ``manifest.json``.
    ``protected``: steps never deleted (resumed-from). ``in_flight`` and
    ``last_committed``: the writer's reported in-flight steps and last local
    commit; a manifest-less folder at or above either may still be uploading.
    ``job_uid`` and ``keyring``: who this job is; only its own (authentic)
    steps are verified and so ever count for retention. None for both: every
    manifest is taken as the job's (a caller without identity).
    """
    name = manifest_mod.MANIFEST_NAME
    with_manifest = sorted(step for step, objs in listing.items() if name in objs)
    verdicts = tuple(
        verify_step(
            step=step,
            objects=listing[step],
            manifest=_read(manifests, step),
            job_uid=job_uid,
            keyring=keyring,
        )
        for step in with_manifest
    )
    verified = [v for v in verdicts if v.verified]
    newest_verified = verified[-1] if verified else None
    keep = set(protected)
    if newest_verified is not None:
        keep.add(newest_verified.step)
    deletions = _retention_deletions(
        listing=listing,
        manifests=manifests,
        remote=remote,
        verified=verified,
        keep=keep,
        aside=aside,
        own_uid8=own_uid8,
    )
    if newest_verified is not None and remote is not None:
        # Manifest-less folders below the newest verified step: our own partial uploads.
        skip = keep | aside | in_flight
        uploading_from = sys.maxsize if last_committed is None else last_committed
        below = min(newest_verified.step, with_manifest[-1] + 1, uploading_from)
        for step in sorted(s for s in listing if name not in listing[s]):
            paths = tuple(sorted(p for p in listing[step] if _own_partial(p, own_uid8)))
            if step < below and step not in skip and paths:
                deletions.append(StepDeletion(step=step, paths=paths, partial=True))
    gone = {d.step for d in deletions}
    return RemotePlan(
        verdicts=verdicts,
        newest_verified=newest_verified,
        deletions=tuple(deletions),
        kept=tuple(s for s in with_manifest if s not in gone),
    )


def _read(manifests: Mapping[int, ManifestRead], step: int) -> ManifestRead:
    return manifests.get(step, ManifestError(message="not read"))


def _retention_deletions(
    *,
    listing: Mapping[int, StepObjects],
    manifests: Mapping[int, ManifestRead],
    remote: checkpointspec.RemoteRetention | None,
    verified: list[Verdict],
    keep: set[int],
    aside: frozenset[int],
    own_uid8: str | None,
) -> list[StepDeletion]:
    """``keepLast``/``keepEvery`` over the verified steps, never a step in ``keep``;
    each deletion manifest first (``retention.deletion_order``), then this job's
    leftovers of other attempts in the folder (``_rotation_paths``)."""
    if remote is None or remote.keep_last is None:
        return []
    records = [retention.StepRecord(step=v.step, committed=True) for v in verified]
    doomed = retention.plan_remote(
        steps=records, keep_last=remote.keep_last, keep_every=remote.keep_every
    )
    return [
        StepDeletion(
            step=step,
            paths=_rotation_paths(
                listing[step], manifests[step], own_uid8=own_uid8, leftovers=step not in aside
            ),
            partial=False,
        )
        for step in doomed
        if step not in keep
    ]


def _rotation_paths(
    objects: StepObjects, manifest: ManifestRead, *, own_uid8: str | None, leftovers: bool
) -> tuple[str, ...]:
    """A rotated step's deletion: the manifest first, the keys it lists, then
    (with ``leftovers``) this job's attempt-scoped objects (``a<k>-<own_uid8>/…``)
    it does not list, sorted. No leftovers without ``own_uid8`` (a caller
    without identity) or for a step whose superseded manifest under
    ``.cairn/`` still lists them. Pure.

    Why: an attempt killed between its ranks' data uploads and the manifest
    (a rank SIGKILLed mid-upload) leaves its objects in the folder, and the
    next attempt commits the same step beside them. Deleting only what the
    manifest lists left a manifest-less folder of ours behind, an abandoned
    partial that the next pass deleted, if one came: after a job's last
    rotation there may be none. Those objects are exactly what that next pass
    would delete, so the rotation deletes them now, after the manifest
    (a half-done deletion still leaves no manifest behind). Another job's
    attempt-scoped objects and unprefixed ones stay, as the manifest-less
    rule decides them.
    """
    listed = _listed_keys(objects, manifest)
    unlisted = sorted(set(objects) - set(listed)) if leftovers and own_uid8 is not None else []
    return (
        *retention.deletion_order(listed),
        *(p for p in unlisted if _attempt_uid8(p) == own_uid8),
    )


def _listed_keys(objects: StepObjects, manifest: ManifestRead) -> list[str]:
    """The manifest and exactly the objects it lists (present ones). Pure.

    Objects of other attempts under the same step (a zombie's upload, a
    superseded lineage's data) are not this step's to delete.
    """
    if isinstance(manifest, Checked):
        listed: frozenset[str] | set[str] = manifest.paths
    elif isinstance(manifest, manifest_mod.Manifest):
        listed = manifest_data_keys(manifest)
    else:
        return list(objects)
    return [p for p in objects if p == manifest_mod.MANIFEST_NAME or p in listed]


def manifest_data_keys(manifest: manifest_mod.Manifest) -> set[str]:
    """The step-relative paths of the files a manifest lists. Pure."""
    return {manifest.data_key(entry.path) for entry in manifest.files}


def checked(verdict: Verdict, manifest: ManifestRead) -> Checked:
    """What the verdict cache keeps of a judged step: the verdict, and the listed
    paths only for a verified step (only those are ever deleted). Pure."""
    if isinstance(manifest, Checked):
        return manifest
    if verdict.verified and isinstance(manifest, manifest_mod.Manifest):
        return Checked(verdict=verdict, paths=frozenset(manifest_data_keys(manifest)))
    return Checked(verdict=verdict)


def storage_update(
    *,
    previous: jobstatus.StorageStatus | None,
    result: RemotePlan | None,
    deleted: tuple[int, ...],
    error: str | None,
    now: datetime.datetime,
) -> tuple[dict[str, Any] | None, tuple[k8stypes.Event, ...]]:
    """The ``status.storage`` merge patch (None: nothing changed) and the events. Pure.

    ``result`` is None when the prefix could not be read (``error`` says why);
    then only ``lastError`` changes. ``deleted`` are the steps whose deletion
    completed. Events: ``CheckpointVerified`` for a new newest verified step,
    ``VerificationFailed`` (Warning) for a step that newly failed,
    ``RetentionDeleted`` when steps were deleted.
    """
    before = previous or jobstatus.StorageStatus()
    patch: dict[str, Any] = {}
    events: list[k8stypes.Event] = []
    if error != before.last_error:
        patch["lastError"] = error
    if result is None:
        return (patch or None), ()
    newest = result.newest_verified
    if newest is not None and newest.step != before.verified_step:
        patch["verifiedStep"] = newest.step
        patch["verifiedTime"] = clock.rfc3339(now)
        patch["verifiedBy"] = newest.method
        events.append(_verified_event(newest))
    elif newest is not None and newest.method != before.verified_by:
        patch["verifiedBy"] = newest.method
    corrupt = [v.step for v in result.failed if not v.foreign][-jobstatus.REMOTE_STEPS_LIMIT :]
    foreign = [v.step for v in result.failed if v.foreign][-jobstatus.REMOTE_STEPS_LIMIT :]
    known = set(before.corrupt_steps or ()) | set(before.foreign_steps or ())
    for verdict in result.failed:
        if verdict.step not in known:
            events.append(_failed_event(verdict))
    if corrupt != list(before.corrupt_steps or []):
        patch["corruptSteps"] = corrupt or None
    if foreign != list(before.foreign_steps or []):
        patch["foreignSteps"] = foreign or None
    remote_steps = list(result.kept)[-jobstatus.REMOTE_STEPS_LIMIT :]
    if remote_steps != list(before.remote_steps or []):
        patch["remoteSteps"] = remote_steps
    if deleted:
        patch["lastRetentionTime"] = clock.rfc3339(now)
        events.append(
            k8stypes.Event(
                type="Normal",
                reason="RetentionDeleted",
                message="deleted steps " + ", ".join(str(s) for s in deleted) + " from S3",
            )
        )
    return (patch or None), tuple(events)


def _verified_event(newest: Verdict) -> k8stypes.Event:
    how = {
        "crc32c": "CRC32C",
        "size": "size only",
        "crc32c+hmac": "CRC32C, signature",
        "size+hmac": "size only, signature",
    }[newest.method or "size"]
    return k8stypes.Event(
        type="Normal",
        reason="CheckpointVerified",
        message=f"step {newest.step} verified in S3 ({newest.files} files, {newest.bytes} bytes, {how})"
        + (f": {newest.reason}" if newest.reason else ""),
    )


def _failed_event(verdict: Verdict) -> k8stypes.Event:
    if verdict.foreign:
        return k8stypes.Event(
            type="Warning",
            reason="ForeignCheckpoint",
            message=f"step {verdict.step} in S3 is not this job's own ({verdict.reason}):"
            " kept, never deleted or loaded as latest",
        )
    return k8stypes.Event(
        type="Warning",
        reason="VerificationFailed",
        message=f"step {verdict.step} failed verification: {verdict.reason}",
    )


PassKind = Literal["periodic", "final"]


def pass_wanted(job: trainingjob.TrainingJob, *, final_done: int | None = None) -> PassKind | None:
    """Whether the S3 pass should look at this job's prefix. Pure.

    ``periodic``: a live job with ``upload`` (every interval, or when the
    writer reports a new upload). ``final``: a Succeeded or Failed job whose
    last pass has not yet run for its current ``metadata.generation``
    (``final_done``: the generation the last final pass ran for, None if none
    did): one more pass records what the job left in S3, then none until the
    spec changes. None: not ours (another controller, being deleted: onDelete
    handles it) or nothing to look at.
    """
    if not job.spec.managed_by_cairn or job.spec.checkpoint.upload is None:
        return None
    if job.metadata.deletion_timestamp is not None:
        return None
    if job.status.phase in jobstatus.TERMINAL_PHASES:
        return None if final_done == job.metadata.generation else "final"
    return "periodic"
