"""Start-up of a checkpoint volume: fence, classify, clean only what is provably ours.

Runs when a `CheckpointManager` starts, on every volume once (rank 0 on a
shared volume, every rank on node-local ones), before rotation:

    fence     raise the local fence file to (job UID, attempt)
    lineage   finish supersedes a crashed branch left pending (`lineage`)
    classify  every `step-<N>` and temporary step folder (`layout.classify`)
    clean     delete temporary folders of THIS job's earlier attempts (and
              own partials); report every foreign, unreadable or unknown
              folder (log + `kept` event), never delete it

`survey` is pure over the observed kinds, so the rule "only `partial_own` is
deleted" is one line a test can hold in view.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import shutil
import typing

from cairn.api import manifest as manifest_mod
from cairn.checkpoint import coordinator as coordinator_mod
from cairn.checkpoint import events, layout
from cairn.checkpoint import fence as fence_mod

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Found:
    """One folder under the root as start-up sees it."""

    folder: pathlib.Path
    step: int
    kind: layout.Kind
    attempt: int | None = None
    """Attempt of a temporary folder (from its name); None for `step-<N>`."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Survey:
    delete: tuple[Found, ...]
    kept: tuple[Found, ...]
    """Folders that are not this job's to delete: reported, left in place."""


def observe(
    root: pathlib.Path, *, job_uid: str | None, keyring: manifest_mod.Keyring | None = None
) -> list[Found]:
    """Every step folder and temporary step folder under root, classified."""
    found = [
        Found(
            folder=folder,
            step=step,
            kind=layout.classify(folder, job_uid=job_uid, keyring=keyring),
        )
        for step, folder in sorted(layout.step_dirs(root).items())
    ]
    for folder, (step, _, attempt) in sorted(layout.tmp_dirs(root).items()):
        kind = layout.classify(folder, job_uid=job_uid)
        found.append(Found(folder=folder, step=step, kind=kind, attempt=attempt))
    return found


def survey(found: typing.Sequence[Found], *, attempt: int) -> Survey:
    """What start-up deletes and what it reports. Pure.

    Deleted: own partials, except a temporary folder of this very attempt or
    a later one (a newer attempt may be writing it right now). Kept and
    reported: foreign, unreadable, unknown.
    """
    delete = tuple(
        f for f in found if f.kind == "partial_own" and (f.attempt is None or f.attempt < attempt)
    )
    kept = tuple(f for f in found if f.kind in ("foreign", "unreadable", "unknown"))
    return Survey(delete=delete, kept=kept)


def prepare(
    root: pathlib.Path,
    *,
    job_uid: str | None,
    attempt: int,
    rank: int,
    callbacks: typing.Sequence[events.ProgressCallback],
    group: int = 0,
    members: str | None = None,
    keyring: manifest_mod.Keyring | None = None,
) -> Survey:
    """Fence, classify and clean one volume (see module docstring)."""
    root.mkdir(parents=True, exist_ok=True)
    fence_mod.raise_local(root, job_uid=job_uid, attempt=attempt, group=group, members=members)
    result = survey(observe(root, job_uid=job_uid, keyring=keyring), attempt=attempt)
    for item in result.delete:
        log.info("removing abandoned partial of this job: %s", item.folder)
        if item.attempt is None:
            layout.delete_step(item.folder)
        else:
            shutil.rmtree(item.folder, ignore_errors=True)
    for item in result.kept:
        message = (
            f"{item.folder.name} is {item.kind} (not written by this job, or not readable "
            "by this version): kept, never deleted"
        )
        log.warning("checkpoint root %s: %s", root, message)
        events.emit(
            callbacks,
            events.ProgressEvent(phase="kept", step=item.step, rank=rank, message=message),
        )
    return result


def probe_shared(
    *,
    directory: pathlib.Path,
    coordinator: coordinator_mod.Coordinator,
    namespace: str,
    timeout: float,
) -> bool:
    """Collective: whether every rank sees the same checkpoint directory (shared volume).

    Each rank drops a probe file, the ranks meet, and each reports whether it
    sees every probe; one rank that does not makes it False (node-local).
    """
    rank, world = coordinator.rank, coordinator.world_size
    directory.mkdir(parents=True, exist_ok=True)
    tag = namespace.replace("/", "_")
    probe = directory / f".cairn-probe-{tag}-{rank}"
    probe.write_text(str(rank))
    coordinator.publish(f"{namespace}/probe", {"ok": True})
    coordinator.gather(f"{namespace}/probe", timeout=timeout)
    sees_all = all((directory / f".cairn-probe-{tag}-{r}").exists() for r in range(world))
    coordinator.publish(f"{namespace}/probe-seen", {"all": sees_all})
    reports = coordinator.gather(f"{namespace}/probe-seen", timeout=timeout)
    probe.unlink(missing_ok=True)
    return all(report.get("all") for report in reports)
