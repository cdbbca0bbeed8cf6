"""Lineage: one linear history of committed steps per job, and rollback by branching.

A lineage id is `<uid8>-a<attempt>` of the attempt that started it; every
manifest records its lineage and (first step of a branch) its parent. The
rule, decided by rank 0 once per manager (after `restore()`, or at the first
save when there was none) by the pure `decide`:

- resuming from the NEWEST committed step of this job continues its lineage;
- resuming from anything else (an explicit older step, an import, a
  fallback past newer steps, or a fresh start over existing steps) starts a
  NEW lineage whose parent is the loaded step, and first SUPERSEDES every
  committed step of this job newer than the branch point: moved aside to
  `<root>/.cairn/superseded/<old lineage>/step-N` (and in S3 the manifest to
  `<prefix>/.cairn/superseded/<old lineage>/step-N/manifest.json`; the data
  objects stay at their attempt-scoped keys). Never deleted.

After that the main namespace is linear again: "latest = highest step"
holds for restore, rotation, the operator and the plugin. A branch record
(`.cairn/lineage.json`) is written before the moves and cleared after, in
S3 FIRST (`<prefix>/.cairn/lineage.json`), then on the volume; a start-up
that finds one (either: a node-local emptyDir comes back empty, so only the
S3 record survives a lost pod) finishes the pending supersedes before
anything picks "latest" (`finish_pending`). The record names each step to
move by its manifest identity (attempt, created_at), so finishing a stale
record can never move a newer step of the same number. `save(step)` with a
step at or below the lineage's latest committed step is refused
(`check_save`), never skipped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import pathlib
import typing

import botocore.exceptions

from cairn.api import manifest as manifest_mod
from cairn.checkpoint import aside, errors, events, faults, layout, options, remote, s3transport
from cairn.checkpoint import coordinator as coordinator_mod

if typing.TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

log = logging.getLogger(__name__)

RECORD = pathlib.PurePosixPath(aside.ASIDE_DIR) / "lineage.json"
LEGACY_LINEAGE = "legacy"
"""Aside tag of superseded steps whose manifest records no lineage (older Cairn)."""


def lineage_id(*, job_uid: str | None, attempt: int) -> str:
    """`<uid8>-a<attempt>`. Pure."""
    return f"{layout.uid8(job_uid)}-a{attempt}"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Decision:
    """What this manager's saves belong to, and what must move aside first."""

    lineage: str
    parent: manifest_mod.Parent | None
    supersede: tuple[int, ...]
    """Committed steps of this job newer than the branch point, oldest first."""
    latest: int | None
    """The lineage's latest committed step once the supersedes are done."""

    def to_json(self) -> dict[str, typing.Any]:
        return {
            "lineage": self.lineage,
            "parent": None if self.parent is None else self.parent.model_dump(mode="json"),
            "supersede": list(self.supersede),
            "latest": self.latest,
        }

    @classmethod
    def from_json(cls, doc: dict[str, typing.Any]) -> Decision:
        parent = doc.get("parent")
        return cls(
            lineage=str(doc["lineage"]),
            parent=None if parent is None else manifest_mod.Parent.model_validate(parent),
            supersede=tuple(int(s) for s in doc.get("supersede", ())),
            latest=doc.get("latest"),
        )


def decide(
    *,
    loaded: int | None,
    loaded_lineage: str | None,
    own_steps: typing.Collection[int],
    job_uid: str | None,
    attempt: int,
    imported: bool = False,
) -> Decision:
    """Continue the loaded step's lineage, or branch from it. Pure.

    `loaded`: the step restore loaded (None: fresh start); `own_steps`: this
    job's committed steps (local and remote) in the main namespace.
    `imported`: `loaded` came from a foreign checkpoint, not from this job:
    always a new lineage, and an own step of the same number is superseded
    too (else a restart before the first save would resume from it).
    """
    newest = max(own_steps, default=None)
    if loaded is not None and loaded == newest and not imported:
        lineage = loaded_lineage or lineage_id(job_uid=job_uid, attempt=attempt)
        return Decision(lineage=lineage, parent=None, supersede=(), latest=loaded)
    supersede = tuple(
        sorted(s for s in own_steps if loaded is None or s > loaded or (imported and s == loaded))
    )
    older = [s for s in own_steps if s not in supersede]
    parent = None if loaded is None else manifest_mod.Parent(step=loaded, lineage=loaded_lineage)
    latest = max([*older, *([] if loaded is None else [loaded])], default=None)
    return Decision(
        lineage=lineage_id(job_uid=job_uid, attempt=attempt),
        parent=parent,
        supersede=supersede,
        latest=latest,
    )


def check_save(step: int, *, latest: int | None, lineage: str) -> None:
    """Refuse a save at or below the lineage's latest committed step (Orbax semantics)."""
    if latest is not None and step <= latest:
        raise errors.CheckpointError(
            f"save({step}) refused: step {latest} is already committed in lineage {lineage}; "
            "a lineage only moves forward (resume from an older step to branch)"
        )


def own_remote_steps(
    client: S3Client,
    s3opts: options.S3Options,
    *,
    job_uid: str | None,
    keyring: manifest_mod.Keyring | None = None,
) -> dict[int, manifest_mod.Manifest]:
    """This job's remote committed steps -> their manifest (manifests of others skipped)."""
    found: dict[int, manifest_mod.Manifest] = {}
    for step in remote.committed_steps(client, s3opts):
        key = f"{remote.step_prefix(s3opts, step)}/{manifest_mod.MANIFEST_NAME}"
        body = s3transport.retrying(
            functools.partial(
                remote.get_bytes_or_none, client, s3opts.bucket, key, within=s3opts.stall_seconds
            ),
            what=f"reading s3://{s3opts.bucket}/{key}",
        )
        if body is None:
            continue
        try:
            doc = manifest_mod.parse_manifest(body)
        except ValueError as exc:  # unreadable: not ours to move
            log.warning("remote step %d not considered for the lineage: %s", step, exc)
            continue
        if layout.own_manifest(doc, job_uid=job_uid, keyring=keyring):
            found[step] = doc
    return found


def own_local_steps(
    root: pathlib.Path, *, job_uid: str | None, keyring: manifest_mod.Keyring | None = None
) -> dict[int, manifest_mod.Manifest]:
    """This job's local committed (authentic) steps -> their manifest."""
    found: dict[int, manifest_mod.Manifest] = {}
    for step in layout.committed_steps(root, job_uid=job_uid, keyring=keyring):
        with contextlib.suppress(errors.CheckpointError):
            found[step] = layout.read_manifest(layout.step_dir(root, step))
    return found


Expect = dict[str, dict[str, typing.Any]]
"""step (as a JSON key) -> the identity of the manifest a branch supersedes."""


def identities(decision: Decision, found: typing.Mapping[int, manifest_mod.Manifest]) -> Expect:
    """The manifest identity (attempt, created_at) of each step to supersede. Pure."""
    return {
        str(step): {"attempt": found[step].attempt, "created_at": found[step].created_at}
        for step in decision.supersede
        if step in found
    }


def to_move(
    decision: Decision, found: typing.Mapping[int, manifest_mod.Manifest], expect: Expect
) -> dict[int, str]:
    """Steps to move aside -> their aside tag (old lineage). Pure.

    Only a step whose manifest is still the one the branch named: a step
    committed later under the same number (by the new lineage, after the
    moves) is never moved by a stale record.
    """
    moves: dict[int, str] = {}
    for step in decision.supersede:
        manifest, wanted = found.get(step), expect.get(str(step))
        if manifest is None or wanted is None:
            continue
        if manifest.attempt != wanted["attempt"] or manifest.created_at != wanted["created_at"]:
            continue
        moves[step] = manifest.lineage or LEGACY_LINEAGE
    return moves


def local_supersede(decision: Decision, local_steps: typing.Collection[int]) -> Decision:
    """The decision as one node-local rank applies it to its own volume. Pure.

    Besides the steps rank 0 named, a step on this volume newer than the
    lineage's latest is not in the linear history (rank 0 no longer has it,
    e.g. after a branch finished from the S3 record while this volume kept
    old-lineage folders): moved aside too, else this rank's next commit of
    that number would collide with it.
    """
    stray = {s for s in local_steps if decision.latest is None or s > decision.latest}
    if stray <= set(decision.supersede):
        return decision
    return dataclasses.replace(decision, supersede=tuple(sorted(stray | set(decision.supersede))))


def _write_record(root: pathlib.Path, doc: dict[str, typing.Any] | None) -> None:
    path = root / RECORD
    if doc is None:
        path.unlink(missing_ok=True)
        if path.parent.is_dir():
            layout.fsync_dir(path.parent)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("w") as stream:
        stream.write(json.dumps(doc))
        stream.flush()
        os.fsync(stream.fileno())
    tmp.replace(path)
    layout.fsync_dir(path.parent)


def read_record(root: pathlib.Path) -> dict[str, typing.Any] | None:
    try:
        doc = json.loads((root / RECORD).read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise errors.CheckpointError(f"{root / RECORD} cannot be read: {exc}") from exc
    return doc if isinstance(doc, dict) else None


def remote_record_key(s3opts: options.S3Options) -> str:
    """`<prefix>/.cairn/lineage.json`. Pure."""
    return f"{s3opts.prefix}/{RECORD}" if s3opts.prefix else str(RECORD)


def read_remote_record(client: S3Client, s3opts: options.S3Options) -> dict[str, typing.Any] | None:
    """The branch record in S3 (None when absent); RemoteError when S3 fails."""
    key = remote_record_key(s3opts)
    body = s3transport.retrying(
        functools.partial(
            remote.get_bytes_or_none, client, s3opts.bucket, key, within=s3opts.stall_seconds
        ),
        what=f"reading s3://{s3opts.bucket}/{key}",
    )
    if body is None:
        return None
    try:
        doc = json.loads(body)
    except ValueError as exc:
        raise errors.CheckpointError(f"s3://{s3opts.bucket}/{key} cannot be read: {exc}") from exc
    return doc if isinstance(doc, dict) else None


def _write_remote_record(
    client: S3Client, s3opts: options.S3Options, doc: dict[str, typing.Any] | None
) -> None:
    key = remote_record_key(s3opts)
    try:
        if doc is None:
            client.delete_object(Bucket=s3opts.bucket, Key=key)
        else:
            client.put_object(Bucket=s3opts.bucket, Key=key, Body=json.dumps(doc).encode())
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
        raise errors.RemoteError(f"branch record s3://{s3opts.bucket}/{key}: {exc}") from exc


def pending_of(
    record: typing.Mapping[str, typing.Any] | None, *, job_uid: str | None
) -> tuple[Decision, Expect | None] | None:
    """The pending branch of a record of this job (None: none, or another job's). Pure."""
    if record is None or not layout.owns(record.get("job_uid"), job_uid=job_uid):
        return None
    pending = record.get("pending")
    if not isinstance(pending, dict):
        return None
    expect = record.get("expect")
    return Decision.from_json(pending), expect if isinstance(expect, dict) else None


def _supersede_local(
    root: pathlib.Path,
    decision: Decision,
    moves: typing.Mapping[int, str],
    *,
    rank: int,
    callbacks: typing.Sequence[events.ProgressCallback],
) -> None:
    """Move this volume's superseded steps aside (rename; never deleted)."""
    reason = f"superseded by lineage {decision.lineage} (branched from {decision.parent})"
    for step, tag in sorted(moves.items()):
        aside.move_aside_local(
            root, layout.step_dir(root, step), kind="superseded", tag=tag, reason=reason
        )
        events.emit(
            callbacks,
            events.ProgressEvent(phase="superseded", step=step, rank=rank, message=reason),
        )


def _supersede_remote(
    client: S3Client,
    s3opts: options.S3Options,
    decision: Decision,
    moves: typing.Mapping[int, str],
) -> None:
    """Move the superseded steps' manifests aside in S3 (data objects stay)."""
    for step, tag in sorted(moves.items()):
        aside.move_aside_remote(
            client,
            s3opts,
            step,
            kind="superseded",
            tag=tag,
            reason=f"superseded by lineage {decision.lineage} (branched from {decision.parent})",
        )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Volume:
    """Where one rank applies a branch: its root, and S3 when it is rank 0."""

    root: pathlib.Path
    job_uid: str | None
    attempt: int
    rank: int
    client: S3Client | None = None
    s3opts: options.S3Options | None = None
    keyring: manifest_mod.Keyring | None = None
    """The job's manifest keys: only authentic steps are superseded (moved)."""


def apply_branch(
    volume: Volume,
    decision: Decision,
    *,
    callbacks: typing.Sequence[events.ProgressCallback],
    expect: Expect | None = None,
) -> None:
    """Record (S3 first, then the volume) → this volume's moves → S3's moves → clear.

    An interruption anywhere leaves a record where the next start-up looks:
    the S3 one survives a lost node-local volume, the local one an S3
    outage. `expect` (from a record being finished) names the manifests to
    move; a live branch takes them from what it sees now.
    """
    if not decision.supersede:
        return
    s3 = (volume.client, volume.s3opts) if volume.client and volume.s3opts else None
    local = own_local_steps(volume.root, job_uid=volume.job_uid, keyring=volume.keyring)
    remote_found = (
        own_remote_steps(*s3, job_uid=volume.job_uid, keyring=volume.keyring) if s3 else {}
    )
    if expect is None:
        expect = identities(decision, {**remote_found, **local})
    doc = {
        "job_uid": volume.job_uid,
        "attempt": volume.attempt,
        "pending": decision.to_json(),
        "expect": expect,
    }
    if s3:
        _write_remote_record(*s3, doc)
    _write_record(volume.root, doc)
    _supersede_local(
        volume.root,
        decision,
        to_move(decision, local, expect),
        rank=volume.rank,
        callbacks=callbacks,
    )
    branch_point = -1 if decision.parent is None else decision.parent.step
    faults.pause_point("supersede", rank=volume.rank, step=branch_point)
    if s3:
        _supersede_remote(*s3, decision, to_move(decision, remote_found, expect))
    _write_record(volume.root, None)
    if s3:
        _write_remote_record(*s3, None)


def finish_pending(
    volume: Volume, *, callbacks: typing.Sequence[events.ProgressCallback]
) -> list[Decision]:
    """Crashed branches left supersedes pending: finish them before anything picks "latest".

    Reads the volume's record and (rank 0) the S3 one. S3 unreadable: logged,
    the S3 record stays for the next start (restore, which lists S3 too,
    then fails visibly rather than choose from a half-branched prefix).
    """
    records = [read_record(volume.root)]
    if volume.client is not None and volume.s3opts is not None:
        try:
            records.append(read_remote_record(volume.client, volume.s3opts))
        except errors.RemoteError as exc:
            log.warning("branch record in S3 unreadable (%s): not finished now", exc)
            volume = dataclasses.replace(volume, client=None, s3opts=None)
    finished: list[Decision] = []
    seen: list[dict[str, typing.Any]] = []
    for record in records:
        pending = pending_of(record, job_uid=volume.job_uid)
        if record is None or pending is None or record in seen:
            continue  # none, another job's record, or the same record twice
        seen.append(record)
        decision, expect = pending
        log.warning("finishing the supersedes of an interrupted branch: %s", decision)
        apply_branch(volume, decision, callbacks=callbacks, expect=expect)
        finished.append(decision)
    return finished


def begin(
    *,
    coordinator: coordinator_mod.Coordinator,
    volume: Volume,
    shared: bool,
    loaded: int | None,
    key: str,
    timeout: float,
    callbacks: typing.Sequence[events.ProgressCallback],
    imported: bool = False,
) -> Decision:
    """Collective: rank 0 decides (and branches S3 and its volume), every rank learns it.

    On node-local volumes every other rank applies the branch to its own
    volume too, before its first save can collide with a superseded step.
    """
    if coordinator.rank == 0:
        try:
            own = own_local_steps(volume.root, job_uid=volume.job_uid, keyring=volume.keyring)
            if volume.client is not None and volume.s3opts is not None:
                try:
                    remote_own = own_remote_steps(
                        volume.client,
                        volume.s3opts,
                        job_uid=volume.job_uid,
                        keyring=volume.keyring,
                    )
                except errors.RemoteError as exc:
                    # S3 down must not stop a start (uploads queue in the
                    # backlog): decide from this volume; a step only in S3
                    # is then not superseded, and a later manifest put that
                    # collides with it is refused (FencedError), never lost.
                    log.warning("lineage: S3 unreadable (%s); deciding from this volume", exc)
                    remote_own = {}
                    volume = dataclasses.replace(volume, client=None, s3opts=None)
                own = {**remote_own, **own}
            decision = decide(
                loaded=loaded,
                loaded_lineage=None if loaded is None or imported else _lineage_of(own.get(loaded)),
                own_steps=own.keys(),
                job_uid=volume.job_uid,
                attempt=volume.attempt,
                imported=imported,
            )
            apply_branch(volume, decision, callbacks=callbacks)
        except BaseException as exc:
            coordinator.broadcast(key, {"error": repr(exc)})
            raise
        coordinator.broadcast(key, {"decision": decision.to_json()})
        log.info("checkpoint lineage: %s", decision)
        return decision
    result = coordinator.wait_for(key, timeout=timeout)
    if result.get("error"):
        raise errors.CheckpointError(f"lineage decision failed on rank 0: {result['error']}")
    decision = Decision.from_json(result["decision"])
    if not shared:
        local = own_local_steps(volume.root, job_uid=volume.job_uid, keyring=volume.keyring)
        apply_branch(volume, local_supersede(decision, local.keys()), callbacks=callbacks)
    return decision


def _lineage_of(manifest: manifest_mod.Manifest | None) -> str | None:
    return None if manifest is None else manifest.lineage
