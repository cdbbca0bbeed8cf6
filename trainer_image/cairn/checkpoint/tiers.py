"""Which tiers keep a committed step, decided at its commit. Pure.

Every save commits to the volume; with the memory tier on, its own-memory
copy and (replicas 1) a peer's replica follow it (`memtier`). S3 gets every
committed step unless `upload_interval_steps` (spec
`checkpoint.upload.intervalSteps`) thins the uploads: then only the saves of
steps divisible by it are owed an upload, and so is a final (SIGTERM) save,
which may be the last chance to leave the pods. A clean end of training
also promotes the newest local-only step (`manager.close`): the last
checkpoint of a finished job is in S3.

A step that is not owed an upload is marked local-only on its volume
(`layout.LOCAL_ONLY_MARKER`, written into the temporary folder before the
commit's rename, so it is committed with the step): uploads never plan it
and local retention rotates it like an uploaded one. Cheap saves every step
to memory and the volume, and S3 every M steps, is the point: the memory
tier restores in-place and peer restarts; S3 covers a lost job.

The manifest records the in-pod tiers (`Manifest.tiers`): where the job's
own pods keep the step. Whether S3 holds it is the object store's own fact
(`status.checkpoints.lastUploaded`), never a claim written before the upload.
"""

from __future__ import annotations

import typing

from cairn.checkpoint import options

Tier = typing.Literal["memory", "peer", "volume"]


def upload_owed(step: int, *, every: int | None, final: bool) -> bool:
    """Whether a step committed now is owed an upload. Pure.

    No interval: every step; else steps divisible by it, and a final save."""
    return every is None or final or step % every == 0


def owed(step: int, *, opts: options.CheckpointOptions, final: bool) -> bool:
    """`upload_owed` for this job's options: never without S3. Pure."""
    if opts.s3 is None:
        return False
    return upload_owed(step, every=opts.upload_interval_steps, final=final)


def in_pod(opts: options.CheckpointOptions) -> tuple[Tier, ...]:
    """The in-pod tiers a committed step is kept in, recorded in its manifest. Pure."""
    if opts.memory_dir is None:
        return ("volume",)
    if opts.memory_replicas >= 1:
        return ("memory", "peer", "volume")
    return ("memory", "volume")


def newest_to_promote(
    committed: typing.Iterable[tuple[int, bool]],
) -> int | None:
    """Of (step, local_only) pairs of committed steps: the newest step when it is
    local-only (a clean end uploads it), else None. Pure."""
    steps = sorted(committed)
    if not steps:
        return None
    step, local_only = steps[-1]
    return step if local_only else None
