"""Resume: pick the newest committed step, verify it, load it; fall back if corrupt.

Rank 0 lists candidates (local committed steps, else/also remote committed
steps) newest first and broadcasts them, so every rank tries the same steps
in the same order. For each candidate every rank verifies (and, for a
remote-only step, first downloads) its share of the files against the
manifest's sizes and CRC32C; the ranks agree through the coordinator. The
first step that verifies everywhere is loaded with DCP, which reshards to the
current world size. Each rejected step is reported (log + `restore_fallback`
event + `RestoreResult.skipped`) and, locally, deleted so that it is never
selected again (manifest first, like rotation).
"""

from __future__ import annotations

import dataclasses
import logging
import typing

import torch.distributed as dist
from torch.distributed.checkpoint import state_dict_loader

from cairn.api import manifest as manifest_mod
from cairn.checkpoint import coordinator as coordinator_mod
from cairn.checkpoint import errors, events, layout, options, remote, state

if typing.TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RestoreResult:
    step: int
    source: typing.Literal["local", "s3"]
    skipped: tuple[tuple[int, str], ...] = ()
    """Newer committed steps that failed verification: (step, reason)."""
    skipped_state: tuple[str, ...] = ()
    """Per-rank state not restored because the world size changed."""
    world_size: int = 1
    """World size that wrote the loaded step."""


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
) -> RestoreResult | None:
    """Load the newest verified committed step (or `step`) into `objects`.

    Returns None when there is nothing to resume from; raises CheckpointError
    when committed steps exist but none verifies.
    """
    coord = coordinator
    rank, world = coord.rank, coord.world_size
    timeout = opts.timeout_seconds
    if rank == 0:
        try:
            local_steps = layout.committed_steps(opts.directory)
            remote_steps = (
                remote.committed_steps(s3_client, opts.s3)
                if s3_client is not None and opts.s3 is not None
                else []
            )
            found = sorted(set(local_steps) | set(remote_steps), reverse=True)
            if step is not None:
                found = [step] if step in found else []
            coord.broadcast(
                f"{namespace}/plan",
                {"candidates": found, "local": local_steps, "remote": remote_steps},
            )
        except Exception as exc:
            coord.broadcast(f"{namespace}/plan", {"error": repr(exc)})
            raise
    plan = coord.wait_for(f"{namespace}/plan", timeout=timeout)
    if plan.get("error"):
        raise errors.CheckpointError(f"resume planning failed on rank 0: {plan['error']}")
    candidates: list[int] = plan["candidates"]
    local, remote_set = set(plan["local"]), set(plan["remote"])
    # Node-local volumes (emptyDir per pod): no rank sees another's files, so
    # each downloads a whole step; on a shared volume each downloads its share.
    shared = directory_shared(
        directory=opts.directory, coordinator=coord, namespace=namespace, timeout=timeout
    )
    if step is not None and not candidates:
        raise errors.CheckpointError(f"requested resume step {step} is not committed anywhere")

    # A step that fails verification locally may still be intact in S3.
    attempts: list[tuple[int, typing.Literal["local", "s3"]]] = []
    for candidate in candidates:
        if candidate in local:
            attempts.append((candidate, "local"))
        if candidate in remote_set:
            attempts.append((candidate, "s3"))
    skipped: list[tuple[int, str]] = []
    for candidate, source in attempts:
        key = f"{namespace}/step-{candidate}-{source}"
        folder = layout.step_dir(opts.directory, candidate)
        manifest: manifest_mod.Manifest | None = None
        try:
            if source == "local":
                manifest = layout.read_manifest(folder)
                share = manifest.files[rank::world]
            else:
                assert s3_client is not None and opts.s3 is not None
                manifest = remote.get_manifest(s3_client, opts.s3, candidate)
                share = manifest.files[rank::world] if shared else manifest.files
                folder.mkdir(parents=True, exist_ok=True)
                remote.download_files(
                    s3_client, opts.s3, step=candidate, folder=folder, entries=share
                )
            problems = layout.verify_files(folder, share)
            report = {"error": "; ".join(f"{p.path}: {p.reason}" for p in problems)}
        except (errors.CheckpointError, manifest_mod.UnsafePathError, OSError) as exc:
            report = {"error": str(exc)}
        coord.publish(f"{key}/verified", report)
        reports = coord.gather(f"{key}/verified", timeout=timeout)
        reasons = [rep["error"] for rep in reports if rep.get("error")]
        if reasons or manifest is None:
            reason = "; ".join(reasons) or "manifest unreadable"
            skipped.append((candidate, f"{source}: {reason}"))
            log.warning(
                "checkpoint step %d (%s) failed verification, falling back: %s",
                candidate,
                source,
                reason,
            )
            events.emit(
                callbacks,
                events.ProgressEvent(
                    phase="restore_fallback", step=candidate, rank=rank, message=reason
                ),
            )
            if rank == 0:
                # Never selected again; the S3 copy (if any) is tried next.
                if folder.is_dir():
                    layout.delete_step(folder)
                coord.broadcast(f"{key}/cleaned", {"ok": True})
            else:
                coord.wait_for(f"{key}/cleaned", timeout=timeout)
            continue
        if source == "s3" and (rank == 0 or not shared):
            # Verified download: commit it locally too (manifest last).
            layout.write_manifest_exclusive(folder, manifest)
            layout.mark_uploaded(folder)
        result = _load(
            folder=folder,
            manifest=manifest,
            objects=objects,
            rank=rank,
            world=world,
            process_group=process_group,
        )
        result = dataclasses.replace(result, source=source, skipped=tuple(skipped))
        events.emit(
            callbacks,
            events.ProgressEvent(
                phase="restored",
                step=candidate,
                rank=rank,
                bytes=manifest.total_bytes,
                message=f"from {source}"
                + (f"; skipped {[s for s, _ in skipped]}" if skipped else ""),
            ),
        )
        return result
    if skipped:
        raise errors.CheckpointError(
            "no committed checkpoint step verified: "
            + "; ".join(f"step {s}: {r}" for s, r in skipped)
        )
    return None


def directory_shared(
    *,
    directory: typing.Any,
    coordinator: coordinator_mod.Coordinator,
    namespace: str,
    timeout: float,
) -> bool:
    """Whether every rank sees the same checkpoint directory (a shared volume).

    Each rank drops a probe file, the ranks agree on a barrier, and each
    reports whether it sees all probes; one rank that does not makes it False.
    """
    import pathlib

    rank, world = coordinator.rank, coordinator.world_size
    root = pathlib.Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    tag = namespace.replace("/", "_")
    probe = root / f".cairn-probe-{tag}-{rank}"
    probe.write_text(str(rank))
    coordinator.publish(f"{namespace}/probe", {"ok": True})
    coordinator.gather(f"{namespace}/probe", timeout=timeout)
    sees_all = all((root / f".cairn-probe-{tag}-{r}").exists() for r in range(world))
    coordinator.publish(f"{namespace}/probe-seen", {"all": sees_all})
    reports = coordinator.gather(f"{namespace}/probe-seen", timeout=timeout)
    probe.unlink(missing_ok=True)
    return all(report.get("all") for report in reports)


def _load(
    *,
    folder: typing.Any,
    manifest: manifest_mod.Manifest,
    objects: typing.Mapping[str, state.Stateful],
    rank: int,
    world: int,
    process_group: dist.ProcessGroup | None,
) -> RestoreResult:
    same_world = manifest.world_size == world
    template: dict[str, typing.Any] = {}
    skipped_state: list[str] = []
    for name, obj in objects.items():
        if state.is_per_rank(obj) and not same_world:
            # Rank r of a different world has no state of its own; DCP can
            # reshard tensors, not meaning.
            skipped_state.append(name)
            continue
        template[state_key(name, obj, rank)] = obj.state_dict()
    state_dict_loader.load(
        template,
        checkpoint_id=folder,
        process_group=process_group,
        no_dist=process_group is None,
    )
    for name, obj in objects.items():
        key = state_key(name, obj, rank)
        if key in template:
            obj.load_state_dict(template[key])
    if skipped_state:
        log.warning(
            "world size changed (%d -> %d): per-rank state %s not restored",
            manifest.world_size,
            world,
            skipped_state,
        )
    return RestoreResult(
        step=manifest.step,
        source="local",
        skipped_state=tuple(skipped_state),
        world_size=manifest.world_size,
    )
