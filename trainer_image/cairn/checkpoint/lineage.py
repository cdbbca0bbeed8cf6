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
`<root>/.cairn/lineage.json` is written before the moves and cleared after,
so a start-up that finds pending supersedes finishes them first
(`finish_pending`). `save(step)` with a step at or below the lineage's
latest committed step is refused (`check_save`), never skipped.
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

from cairn.api import manifest as manifest_mod
from cairn.checkpoint import aside, errors, events, layout, options, remote
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
    client: S3Client, s3opts: options.S3Options, *, job_uid: str | None
) -> dict[int, str | None]:
    """This job's remote committed steps -> their lineage (manifests of others skipped)."""
    found: dict[int, str | None] = {}
    for step in remote.committed_steps(client, s3opts):
        key = f"{remote.step_prefix(s3opts, step)}/{manifest_mod.MANIFEST_NAME}"
        body = remote.retrying(
            functools.partial(remote.get_bytes_or_none, client, s3opts.bucket, key),
            what=f"reading s3://{s3opts.bucket}/{key}",
        )
        if body is None:
            continue
        try:
            doc = manifest_mod.parse_manifest(body)
        except ValueError as exc:  # unreadable: not ours to move
            log.warning("remote step %d not considered for the lineage: %s", step, exc)
            continue
        if layout.owns(doc.job_uid, job_uid=job_uid):
            found[step] = doc.lineage
    return found


def own_local_steps(root: pathlib.Path, *, job_uid: str | None) -> dict[int, str | None]:
    """This job's local committed steps -> their lineage."""
    found: dict[int, str | None] = {}
    for step in layout.committed_steps(root, job_uid=job_uid):
        with contextlib.suppress(errors.CheckpointError):
            found[step] = layout.read_manifest(layout.step_dir(root, step)).lineage
    return found


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


def supersede_local(
    root: pathlib.Path,
    decision: Decision,
    *,
    job_uid: str | None,
    rank: int,
    callbacks: typing.Sequence[events.ProgressCallback],
) -> None:
    """Move this volume's superseded steps aside (rename; never deleted)."""
    mine = own_local_steps(root, job_uid=job_uid)
    reason = f"superseded by lineage {decision.lineage} (branched from {decision.parent})"
    for step in decision.supersede:
        if step not in mine:
            continue
        aside.move_aside_local(
            root,
            layout.step_dir(root, step),
            kind="superseded",
            tag=mine[step] or LEGACY_LINEAGE,
            reason=reason,
        )
        events.emit(
            callbacks,
            events.ProgressEvent(phase="superseded", step=step, rank=rank, message=reason),
        )


def supersede_remote(
    client: S3Client, s3opts: options.S3Options, decision: Decision, *, job_uid: str | None
) -> None:
    """Move the superseded steps' manifests aside in S3 (data objects stay)."""
    if not decision.supersede:
        return
    mine = own_remote_steps(client, s3opts, job_uid=job_uid)
    for step in decision.supersede:
        if step not in mine:
            continue
        aside.move_aside_remote(
            client,
            s3opts,
            step,
            kind="superseded",
            tag=mine[step] or LEGACY_LINEAGE,
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


def apply_branch(
    volume: Volume,
    decision: Decision,
    *,
    callbacks: typing.Sequence[events.ProgressCallback],
) -> None:
    """Branch record first, then S3 (rank 0), then this volume, then clear the record.

    An interruption anywhere leaves the record; `finish_pending` at the next
    start-up completes the moves before anything picks "latest".
    """
    if not decision.supersede:
        return
    _write_record(volume.root, {"job_uid": volume.job_uid, "pending": decision.to_json()})
    if volume.client is not None and volume.s3opts is not None:
        supersede_remote(volume.client, volume.s3opts, decision, job_uid=volume.job_uid)
    supersede_local(
        volume.root, decision, job_uid=volume.job_uid, rank=volume.rank, callbacks=callbacks
    )
    _write_record(volume.root, None)


def finish_pending(
    volume: Volume, *, callbacks: typing.Sequence[events.ProgressCallback]
) -> Decision | None:
    """A crashed branch left supersedes pending: finish them before anything picks "latest"."""
    record = read_record(volume.root)
    if record is None:
        return None
    pending = record.get("pending")
    if not layout.owns(record.get("job_uid"), job_uid=volume.job_uid) or not isinstance(
        pending, dict
    ):
        return None  # another job's record: not ours to act on
    decision = Decision.from_json(pending)
    log.warning("finishing the supersedes of an interrupted branch: %s", decision)
    apply_branch(volume, decision, callbacks=callbacks)
    return decision


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
            own = own_local_steps(volume.root, job_uid=volume.job_uid)
            if volume.client is not None and volume.s3opts is not None:
                try:
                    remote_own = own_remote_steps(
                        volume.client, volume.s3opts, job_uid=volume.job_uid
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
                loaded_lineage=None if loaded is None or imported else own.get(loaded),
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
        apply_branch(volume, decision, callbacks=callbacks)
    return decision
