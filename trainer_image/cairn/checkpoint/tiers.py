"""Which tiers keep a committed step, decided at its commit. Pure.

Every save commits to the volume; with the memory tier on, its own-memory
copy and (replicas 1) a peer's replica follow it (`memtier`). S3 gets every
committed step unless `upload_interval_steps` (spec
`checkpoint.upload.intervalSteps`) thins the uploads: then only the saves of
steps divisible by it are owed an upload, and so is a final (SIGTERM) save,
which may be the last chance to leave the pods. A clean end of training
also promotes the newest local-only step (`manager.close`,
`upload_backlog.promote_newest`): the last checkpoint of a finished job is in S3.

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


def local_only(step: int, *, opts: options.CheckpointOptions, final: bool) -> bool:
    """Whether a step committed now gets the local-only marker: the job uploads,
    but not this step (`upload_owed`). Without S3 no step is marked. Pure."""
    return opts.s3 is not None and not upload_owed(
        step, every=opts.upload_interval_steps, final=final
    )


def in_pod(opts: options.CheckpointOptions) -> tuple[Tier, ...]:
    """The in-pod tiers a committed step is kept in, recorded in its manifest. Pure."""
    if opts.memory_dir is None:
        return ("volume",)
    if opts.memory_replicas >= 1:
        return ("memory", "peer", "volume")
    return ("memory", "volume")
