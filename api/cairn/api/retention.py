"""Retention policies for checkpoint steps, local and remote.

Pure decision functions shared by the trainer (which rotates the local
checkpoint folder after each commit) and the operator (which applies remote
retention to the S3 prefix). Callers observe the world (which step folders
exist, which are committed, uploaded or in flight), call a policy here, and
apply the returned plan themselves. Nothing here touches a filesystem or a
network.

Safety rules that no option can turn off:
- the newest committed step is never deleted;
- a step that is in flight (being staged, written, committed or uploaded) is
  never deleted;
- with upload on, a committed step that is not uploaded yet is never deleted
  locally (it may be the only durable copy soon);
- a folder that is not provably an abandoned partial of this job (foreign,
  unreadable, unknown) is never passed here as deletable: only records with
  `own_partial=True` are deleted as partials;
- a deletion removes the manifest first (see `deletion_order`), so a
  half-deleted step is never taken for a committed one.

When protected steps alone exceed `keep_last` or `max_bytes` (an upload
backlog while S3 is down), the plan keeps them and says so in
`LocalPlan.over_budget`; the caller reports it instead of growing silently.
"""

from __future__ import annotations

import dataclasses

from cairn.api import manifest as manifest_mod

MIN_LOCAL_KEEP_LAST = 2
"""The newest step may still be writing, so one committed step is not enough."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StepRecord:
    """What the caller observed about one step folder (local or remote)."""

    step: int
    committed: bool
    """`is_committed()` held: a complete manifest is present."""
    bytes: int = 0
    """Bytes of the step on the observed volume (the sizes of the files present)."""
    uploaded: bool = False
    """The remote manifest exists (remote commit)."""
    own_partial: bool = False
    """Not committed, and provably an abandoned write of this job (deletable)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LocalPlan:
    """Steps to delete locally; committed ones oldest first, then partials."""

    delete_committed: tuple[int, ...]
    delete_partial: tuple[int, ...]
    kept: tuple[int, ...]
    """Committed steps that stay, newest first."""
    over_budget: tuple[int, ...] = ()
    """Kept steps beyond `keep_last`/`max_bytes`, kept only because they are
    protected (in flight or not uploaded yet), oldest first."""
    kept_bytes: int = 0
    """Bytes of the kept committed steps."""


def plan_local(
    *,
    steps: list[StepRecord],
    in_flight: frozenset[int],
    keep_last: int,
    max_bytes: int | None,
    upload_enabled: bool,
) -> LocalPlan:
    """Decide which local step folders to delete. Pure.

    Keeps the newest `keep_last` committed steps, then drops older ones from
    that set while the kept total exceeds `max_bytes`. Protected steps (newest
    committed, in flight, not yet uploaded with upload on) are kept even when
    that leaves more than `keep_last` steps or more than `max_bytes`: running
    out of budget is better than losing the only copy; such steps are listed
    in `over_budget`. Records marked `own_partial` that are not in flight are
    abandoned partials of this job and are deleted; any other uncommitted
    record (foreign, unreadable, unknown) is kept.
    """
    if keep_last < MIN_LOCAL_KEEP_LAST:
        raise ValueError(f"keep_last must be >= {MIN_LOCAL_KEEP_LAST}, got {keep_last}")
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive or None, got {max_bytes}")
    committed = sorted((s for s in steps if s.committed), key=lambda s: s.step, reverse=True)
    newest = committed[0].step if committed else None

    def protected(record: StepRecord) -> bool:
        return (
            record.step == newest
            or record.step in in_flight
            or (upload_enabled and not record.uploaded)
        )

    kept: list[StepRecord] = []
    deleted: list[int] = []
    over: list[int] = []
    total = 0
    for record in committed:
        over_count = len(kept) >= keep_last
        over_bytes = max_bytes is not None and total + record.bytes > max_bytes
        if over_count or over_bytes:
            if not protected(record):
                deleted.append(record.step)
                continue
            if record.step != newest:
                over.append(record.step)
        kept.append(record)
        total += record.bytes
    partial = sorted(
        s.step for s in steps if not s.committed and s.own_partial and s.step not in in_flight
    )
    return LocalPlan(
        delete_committed=tuple(sorted(deleted)),
        delete_partial=tuple(partial),
        kept=tuple(r.step for r in kept),
        over_budget=tuple(sorted(over)),
        kept_bytes=total,
    )


def plan_remote(
    *,
    steps: list[StepRecord],
    keep_last: int,
    keep_every: int | None,
) -> tuple[int, ...]:
    """Committed remote steps to delete, oldest first. Pure.

    Keeps the newest `keep_last` committed steps plus every milestone step
    (`step % keep_every == 0`). Uncommitted remote prefixes (no manifest) are
    not touched here: an upload may be in progress; the operator ages them
    out separately.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    if keep_every is not None and keep_every <= 0:
        raise ValueError(f"keep_every must be positive or None, got {keep_every}")
    committed = sorted((s.step for s in steps if s.committed), reverse=True)
    newest_kept = set(committed[:keep_last])
    deleted = [
        step
        for step in committed
        if step not in newest_kept and not (keep_every is not None and step % keep_every == 0)
    ]
    return tuple(sorted(deleted))


def split_manifests(paths: list[str]) -> tuple[list[str], list[str]]:
    """The manifests among ``paths`` (deleted first) and the rest, sorted. Pure.

    The one manifest-first rule: once a step's manifest is gone the step is no
    longer committed, so a deletion interrupted half-way leaves an abandoned
    partial, never a corrupt "committed" step.
    """
    head = [p for p in paths if p.rsplit("/", 1)[-1] == manifest_mod.MANIFEST_NAME]
    return head, sorted(p for p in paths if p not in head)


def deletion_order(paths: list[str]) -> list[str]:
    """Order in which to delete a step's files: manifest first, then the rest. Pure."""
    head, rest = split_manifests(paths)
    return head + rest
