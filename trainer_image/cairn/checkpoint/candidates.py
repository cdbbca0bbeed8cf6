"""Restore's observe step: which copies of which steps to try, newest first.

Rank 0 looks (its volume, and the S3 listing) and broadcasts the list;
every rank then tries the same copies in the same order
(`cairn.checkpoint.restore`):

    latest     every step `layout.classify` calls `committed` (this job's
               own: its manifest authenticates with the job's key and UID,
               `cairn.api.manifest.authenticate`), newest first: its local
               folder, then its S3 copy (authenticated again when fetched);
               foreign, unreadable and unknown folders are logged and never
               candidates. With the memory tier on, the memory copy of the
               newest step every rank holds in memory comes first
               (`memrestore.memory_step`), unless a newer step exists
    explicit   `resume.step`: that step only (a plain DCP folder too:
               imported); a Cairn manifest that does not authenticate, an
               absent step or one of a newer format is a ConfigurationError
    uri        `resume.uri`: a Cairn step folder (manifest.json) or a plain
               DCP checkpoint (`.metadata`, verified by listing)
"""

from __future__ import annotations

import logging
import pathlib

import pydantic

from cairn.api import checkpointspec
from cairn.api import manifest as manifest_mod
from cairn.checkpoint import errors, foreign, layout, memrestore, remote, s3transport
from cairn.checkpoint import fetch as fetch_mod
from cairn.checkpoint import verdict as verdict_mod

log = logging.getLogger(__name__)


def plan(ctx: fetch_mod.Context, *, step: int | None, uri: str | None) -> list[verdict_mod.Copy]:
    """Collective: rank 0 lists the copies to try and broadcasts them (or its error)."""
    key = f"{ctx.namespace}/plan"
    if ctx.memory is not None:
        # Every rank says what its memory holds; rank 0 plans the memory copy.
        ctx.coordinator.publish(f"{key}/memory", memrestore.held(ctx.memory))
    if ctx.rank == 0:
        try:
            copies = [_uri(ctx, uri)] if uri is not None else _steps(ctx, step)
            if uri is None and step is None:
                copies = _memory_first(ctx, copies)
        except Exception as exc:
            ctx.coordinator.broadcast(key, errors.to_doc(exc))
            raise
        ctx.coordinator.broadcast(key, {"copies": [c.to_json() for c in copies]})
        return copies
    found = ctx.coordinator.wait_for(key, timeout=ctx.timeout)
    errors.raise_doc(found, where="resume planning on rank 0")
    return [verdict_mod.Copy.from_json(doc) for doc in found["copies"]]


def _steps(ctx: fetch_mod.Context, step: int | None) -> list[verdict_mod.Copy]:
    """Copies of this job's committed steps, newest first: local, then S3."""
    opts = ctx.opts
    kinds = {
        n: layout.classify(folder, job_uid=opts.job_uid, keyring=opts.manifest_keyring)
        for n, folder in layout.step_dirs(opts.directory).items()
    }
    remote_steps: set[int] = set()
    if ctx.s3_client is not None and opts.s3 is not None:
        client, s3opts = ctx.s3_client, opts.s3
        listed = s3transport.retrying(
            lambda: remote.committed_steps(client, s3opts), what="listing remote steps"
        )
        remote_steps = set(listed)
    if step is not None:
        return _explicit(ctx, step, kinds=kinds, remote_steps=remote_steps)
    for n, kind in sorted(kinds.items(), reverse=True):
        if kind not in ("committed", "partial_own"):
            log.warning("checkpoint folder step %d is %s: kept, not a resume candidate", n, kind)
    local = {n for n, kind in kinds.items() if kind == "committed"}
    copies: list[verdict_mod.Copy] = []
    for n in sorted(local | remote_steps, reverse=True):
        if n in local:
            copies.append(verdict_mod.Copy(step=n, source="local"))
        if n in remote_steps:
            copies.append(verdict_mod.Copy(step=n, source="s3"))
    return copies


def _memory_first(ctx: fetch_mod.Context, copies: list[verdict_mod.Copy]) -> list[verdict_mod.Copy]:
    """The memory copy of the newest step every rank holds in memory (own or
    its peer's replica) goes first, unless a newer step exists elsewhere."""
    if ctx.memory is None:
        return copies
    held = ctx.coordinator.gather(f"{ctx.namespace}/plan/memory", timeout=ctx.timeout)
    step = memrestore.memory_step(held, stride=ctx.memory.stride)
    newest = max((c.step for c in copies), default=None)
    if step is None or (newest is not None and newest > step):
        return copies
    return [verdict_mod.Copy(step=step, source="memory"), *copies]


def _explicit(
    ctx: fetch_mod.Context, step: int, *, kinds: dict[int, layout.Kind], remote_steps: set[int]
) -> list[verdict_mod.Copy]:
    kind = kinds.get(step)
    copies: list[verdict_mod.Copy] = []
    if kind == "unreadable":
        folder = layout.step_dir(ctx.opts.directory, step)
        raise errors.ConfigurationError(
            f"requested resume step {step}: {folder} is unreadable here ({_why_unreadable(folder)})"
        )
    if kind == "committed":
        copies.append(verdict_mod.Copy(step=step, source="local"))
    elif kind == "foreign":
        folder = layout.step_dir(ctx.opts.directory, step)
        plain = not (folder / manifest_mod.MANIFEST_NAME).exists()
        if not plain:
            raise errors.ConfigurationError(
                f"requested resume step {step}: {folder} is not this job's own"
                f" ({_why_not_own(ctx, folder)}); not loaded"
            )
        copies.append(verdict_mod.Copy(step=step, source="local", own=False, plain_dcp=True))
    if step in remote_steps:
        copies.append(verdict_mod.Copy(step=step, source="s3"))
    if not copies:
        raise errors.ConfigurationError(
            f"requested resume step {step} is not committed anywhere"
            f" (local: {kind or 'absent'}; S3: {'listed' if step in remote_steps else 'absent'})"
        )
    return copies


def _why_not_own(ctx: fetch_mod.Context, folder: pathlib.Path) -> str:
    checked = manifest_mod.authenticate(
        layout.read_manifest(folder), job_uid=ctx.opts.job_uid, keyring=ctx.opts.manifest_keyring
    )
    return checked.reason


def _why_unreadable(folder: pathlib.Path) -> str:
    try:
        layout.read_manifest(folder)
    except (errors.CheckpointError, ValueError, OSError) as exc:  # newer format, invalid, EACCES
        return str(exc)
    return "manifest of another step"


def _uri(ctx: fetch_mod.Context, uri: str) -> verdict_mod.Copy:
    """What is at resume.uri: a Cairn step folder or a plain DCP checkpoint."""
    client, s3opts = fetch_mod.s3(ctx)
    bucket, prefix = checkpointspec.split_s3_uri(uri)
    raw = s3transport.retrying(
        lambda: remote.get_bytes_or_none(
            client, bucket, f"{prefix}/{manifest_mod.MANIFEST_NAME}", within=s3opts.stall_seconds
        ),
        what=f"reading {uri}",
    )
    if raw is not None:
        try:
            found = manifest_mod.parse_manifest(raw)
        except (pydantic.ValidationError, ValueError) as exc:
            raise errors.ConfigurationError(f"{uri}/manifest.json cannot be used: {exc}") from exc
        return verdict_mod.Copy(
            step=found.step, source="s3", own=False, bucket=bucket, folder_prefix=prefix
        )
    sizes = s3transport.retrying(
        lambda: remote.list_sizes(client, bucket, prefix, within=s3opts.stall_seconds),
        what=f"listing {uri}",
    )
    if foreign.DCP_METADATA not in sizes:
        raise errors.ConfigurationError(
            f"{uri} holds neither a Cairn manifest.json nor a DCP .metadata"
            f" ({len(sizes)} objects under it): not a checkpoint"
        )
    folder = fetch_mod.import_dir(ctx)
    s3transport.retrying(
        lambda: remote.download_files(
            client, s3opts, bucket=bucket, prefix=prefix, folder=folder, names=[".metadata"]
        ),
        what=f"reading {uri}/.metadata",
    )
    problems = foreign.verify_listing(sizes, foreign.read_metadata(folder, sha256=ctx.sha256))
    if problems:
        raise errors.ConfigurationError(f"{uri} is an incomplete DCP checkpoint: {problems[:5]}")
    return verdict_mod.Copy(
        step=0, source="s3", own=False, plain_dcp=True, bucket=bucket, folder_prefix=prefix
    )
