"""A manager's start on its checkpoint volumes: each volume prepared once.

Rank 0 checks the S3 prefix's owner and prepares its volume (fence file,
clean-up of this job's partial folders: `startup.prepare`; a crashed
lineage branch finished: `lineage.finish_pending`; rotation), then tells the
other ranks the outcome. On node-local volumes (emptyDir per pod) every
rank then prepares its own. A failure on rank 0 reaches every rank as a
CheckpointError naming it, so no rank trains on an unprepared volume.

On node-local volumes the ranks then say which committed steps they hold
(one gather): a step rank 0 still owes S3 that another rank's volume no
longer has (its pod was replaced in place, docs/operator.md, "A lost pod
replaced in place") can never be uploaded, since every rank uploads its own
files. Rank 0 marks its copy local-only (`retire_orphans`): never planned
again, rotated like an uploaded step. Without this the new rank waited
for its copy of that step (up to `timeout_seconds`) in every upload round,
and newer steps behind it, the final one included, were never uploaded.
"""

from __future__ import annotations

import dataclasses
import logging
import typing

from cairn.api import s3owner
from cairn.checkpoint import coordinator as coordinator_mod
from cairn.checkpoint import (
    errors,
    events,
    layout,
    lineage,
    options,
    remote,
    rotation,
    startup,
    upload_backlog,
)

if typing.TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Volumes:
    """What a rank needs to know about its checkpoint volume and store."""

    opts: options.CheckpointOptions
    rank: int
    shared: bool
    """Every rank sees one directory (probed once, `startup.probe_shared`)."""
    s3: S3Client | None
    callbacks: typing.Sequence[events.ProgressCallback]

    def lineage_volume(self) -> lineage.Volume:
        """This rank's view for `lineage` (rank 0 also reaches S3)."""
        opts = self.opts
        return lineage.Volume(
            root=opts.directory,
            job_uid=opts.job_uid,
            keyring=opts.manifest_keyring,
            attempt=opts.attempt,
            rank=self.rank,
            client=self.s3 if self.rank == 0 else None,
            s3opts=opts.s3 if self.rank == 0 else None,
        )


def probe(
    opts: options.CheckpointOptions,
    *,
    coordinator: coordinator_mod.Coordinator,
    s3: S3Client | None,
    callbacks: typing.Sequence[events.ProgressCallback],
) -> Volumes:
    """Probe (collective, once per manager) whether the volume is shared."""
    shared = startup.probe_shared(
        directory=opts.directory,
        coordinator=coordinator,
        namespace="volume-probe",
        timeout=opts.timeout_seconds,
    )
    return Volumes(opts=opts, rank=coordinator.rank, shared=shared, s3=s3, callbacks=callbacks)


def init(volumes: Volumes, *, coordinator: coordinator_mod.Coordinator) -> None:
    """Each volume once (rank 0's first): fence, pending branch, clean-up, rotation."""
    opts = volumes.opts
    if volumes.rank == 0:
        try:
            if volumes.s3 is not None and opts.s3 is not None and opts.job_uid:
                remote.check_prefix_owner(
                    volumes.s3, opts.s3, job_uid=opts.job_uid, claim_as=_owner_record(opts)
                )
            prepare(volumes)
        except BaseException as exc:
            coordinator.broadcast("init", {"error": repr(exc)})
            raise
        coordinator.broadcast("init", {"ok": True})
    else:
        result = coordinator.wait_for("init", timeout=opts.timeout_seconds)
        if result.get("error"):
            raise errors.CheckpointError(f"checkpoint root init failed: {result['error']}")
        if rotation.rotates_here(rank=volumes.rank, shared=volumes.shared):
            # Node-local volume: this rank's own volume is its to prepare.
            prepare(volumes)
    if not volumes.shared and coordinator.world_size > 1:
        retire_orphans(volumes, coordinator=coordinator)


HELD_KEY = "held-steps"


def orphans(pending: typing.Sequence[int], held: typing.Sequence[typing.Any]) -> list[int]:
    """The steps rank 0 owes S3 that some rank does not hold (`held`: every
    rank's report, ``{"steps": [...]}``; anything malformed holds nothing). Pure."""

    def steps(report: typing.Any) -> set[int]:
        found = report.get("steps") if isinstance(report, dict) else None
        if not isinstance(found, list):
            return set()
        return {s for s in found if isinstance(s, int) and not isinstance(s, bool)}

    everywhere = set.intersection(*(steps(r) for r in held)) if held else set()
    return sorted(s for s in pending if s not in everywhere)


def retire_orphans(volumes: Volumes, *, coordinator: coordinator_mod.Coordinator) -> list[int]:
    """Collective on node-local volumes: every rank reports its committed steps;
    rank 0 marks the steps it owes S3 that some rank lacks local-only (see the
    module docstring). Returns the steps retired (rank 0; [] elsewhere).
    A job without S3 owes no upload: every rank returns at once (the same
    options on every rank, so none waits in the gather)."""
    opts = volumes.opts
    if opts.s3 is None:
        return []
    mine = layout.committed_steps(
        opts.directory, job_uid=opts.job_uid, keyring=opts.manifest_keyring
    )
    coordinator.publish(HELD_KEY, {"steps": mine})
    if volumes.rank != 0:
        return []
    held = coordinator.gather(HELD_KEY, timeout=opts.timeout_seconds)
    pending = upload_backlog.pending_steps(
        opts.directory, job_uid=opts.job_uid, keyring=opts.manifest_keyring
    )
    retired = orphans(pending, held)
    for step in retired:
        folder = layout.step_dir(opts.directory, step)
        layout.mark_local_only(folder)
        layout.fsync_dir(folder)
        log.warning(
            "step %d is owed an upload but not every rank holds its files any more (a pod "
            "was replaced): kept on this volume, never uploaded",
            step,
        )
    return retired


def _owner_record(opts: options.CheckpointOptions) -> s3owner.Owner | None:
    """This job as the prefix's owner record, when the pod env names it fully."""
    if not (opts.job_uid and opts.job_namespace and opts.job_name):
        return None
    return s3owner.Owner(uid=opts.job_uid, namespace=opts.job_namespace, name=opts.job_name)


def prepare(volumes: Volumes) -> None:
    """One volume: fence file and clean-up, a pending branch finished, rotation."""
    opts = volumes.opts
    startup.prepare(
        opts.directory,
        job_uid=opts.job_uid,
        attempt=opts.attempt,
        rank=volumes.rank,
        callbacks=volumes.callbacks,
        group=opts.group,
        members=opts.group_members,
        keyring=opts.manifest_keyring,
    )
    lineage.finish_pending(volumes.lineage_volume(), callbacks=volumes.callbacks)
    rotation.rotate(opts, rank=volumes.rank, in_flight=frozenset(), callbacks=volumes.callbacks)
