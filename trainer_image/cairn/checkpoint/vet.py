"""Restore's vet step: a verified copy must be data, never code, before it loads.

Runs on every rank after all ranks agreed a copy's files verify (sizes and
CRC32C against its manifest, or the sizes a plain DCP folder's metadata
needs), so every rank's share is on disk; `cairn.checkpoint.restore` then
agrees on the vet reports like on the fetch reports:

    .metadata   read as data (`cairn.checkpoint.safedcp`): allow-listed
                classes only, pinned by `resume.sha256` for an explicit
                target; every file reference a plain path inside the folder
                and one of the manifest's files (a Cairn step) or of the files
                present (a plain DCP folder), no symlinks
    bytes       every bytes entry stored in this rank's share of the files
                loads with `torch.load(weights_only=True)`

Never raises for what it finds: a refusal is an `unreadable` report. The
copy is kept (its bytes match its manifest: nothing proves it corrupt, and
nothing is deleted that was not understood); an explicit target then fails
with a ConfigurationError naming the refused class, path or key, "latest"
skips the step and reports it.
"""

from __future__ import annotations

import dataclasses
import logging

from cairn.checkpoint import errors, foreign, load, safedcp
from cairn.checkpoint import fetch as fetch_mod
from cairn.checkpoint import verdict as verdict_mod

log = logging.getLogger(__name__)


def vet(
    ctx: fetch_mod.Context, copy: verdict_mod.Copy, fetched: fetch_mod.Fetched
) -> fetch_mod.Fetched:
    """`fetched` with this rank's vet report and the metadata it checked."""
    folder = fetched.folder
    if folder is None:
        return dataclasses.replace(fetched, report=_report(ctx, "unreadable", "no folder"))
    try:
        if copy.plain_dcp:
            allowed = foreign.present_files(folder)
        elif fetched.manifest is not None:
            allowed = load.manifest_files(fetched.manifest)
        else:
            return dataclasses.replace(fetched, report=_report(ctx, "unreadable", "no manifest"))
        meta = safedcp.read_metadata(folder, allowed=allowed, sha256=ctx.sha256)
        stored = sorted(p for p in safedcp.referenced_files(meta) if (folder / p).is_file())
        checked = safedcp.check_bytes(folder, meta, files=ctx.share(stored))
    except (errors.CheckpointError, OSError) as exc:
        log.warning("checkpoint %s refused: %s", copy.label, exc)
        return dataclasses.replace(
            fetched, report=_report(ctx, "unreadable", f"{type(exc).__name__}: {exc}")
        )
    log.debug("checkpoint %s: metadata and %d bytes entries are data", copy.label, checked)
    return dataclasses.replace(fetched, report=_report(ctx, "ok"), meta=meta)


def _report(
    ctx: fetch_mod.Context, status: verdict_mod.Status, detail: str = ""
) -> verdict_mod.Report:
    return verdict_mod.Report(status=status, detail=detail[:2000], rank=ctx.rank)
