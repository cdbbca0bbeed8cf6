"""The kill trials' `quarantine` phase: corrupt a committed local copy, then follow it.

Before such an attempt the trial corrupts (flips a byte in, or truncates)
one data shard of the copy the resume will try first, on one rank's volume,
so that the restore proves it corrupt and moves it aside
(`cairn.checkpoint.aside`); the kill lands between the reason file and the
rename. From then on the corrupt copy is followed, attempt after attempt,
until it is found moved aside: it must never vanish unread (`where` says
"gone"), and while it stays in place it is the one committed folder that is
allowed to fail verification (the restore must skip it, never load it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import random
import typing

from cairn.api import manifest as manifest_mod
from cairn.checkpoint import aside, layout

Where = typing.Literal["in_place", "quarantined", "gone"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Corrupted:
    """One corrupted copy: which volume, which step, which file, its new bytes."""

    rank: int
    step: int
    path: str
    """The shard's path relative to the step folder."""
    digest: str
    """sha256 of the corrupted bytes (a moved copy is found by them)."""
    how: str


def pick(
    chain: pathlib.Path, *, rank: int, remote_steps: set[int], job_uid: str
) -> tuple[int, int] | None:
    """(rank, step): the local copy the next resume tries first.

    Rank 0 plans the resume from its own volume and the bucket, newest step
    first, local copy before S3 copy; so that copy is local only when the
    newest step is committed on pod-0. It is taken on `rank`'s volume when
    committed there too, else on pod-0's. None: the first copy is S3's (or
    there is none), nothing local to corrupt; or that copy is the job's only
    one (no copy in S3, no other step on every volume): corrupting it would
    leave nothing to resume from, and the restore rightly fails then
    (CheckpointError, the copy kept) instead of falling back.
    """
    on_zero = set(layout.committed_steps(chain / "pod-0", job_uid=job_uid))
    first = max(on_zero | remote_steps, default=None)
    if first is None or first not in on_zero:
        return None
    everywhere = set.intersection(
        *(set(layout.committed_steps(pod, job_uid=job_uid)) for pod in chain.glob("pod-*"))
    )
    if not remote_steps and not everywhere - {first}:
        return None
    if first in layout.committed_steps(chain / f"pod-{rank}", job_uid=job_uid):
        return rank, first
    return 0, first


def corrupt(root: pathlib.Path, *, rank: int, step: int, rng: random.Random) -> Corrupted:
    """Flip one byte of, or truncate, one of `rank`'s shards of `step` under root.

    The shard is replaced by a new file (rename), so no other link to its
    inode changes; its size or CRC32C no longer matches the manifest.
    """
    folder = layout.step_dir(root, step)
    entries = layout.read_manifest(folder).files_of_rank(rank)
    shards = sorted(e.path for e in entries if e.path.endswith(".distcp") and e.size > 1)
    path = rng.choice(shards or sorted(e.path for e in entries if e.size > 1))
    target = folder / path
    data = bytearray(target.read_bytes())
    how = rng.choice(("flip", "truncate"))
    if how == "flip":
        data[rng.randrange(len(data))] ^= 0xFF
    else:
        del data[rng.randrange(len(data)) :]
    tmp = target.with_name(f".{target.name}.corrupt-{os.getpid()}")
    tmp.write_bytes(bytes(data))
    os.replace(tmp, target)
    return Corrupted(
        rank=rank, step=step, path=path, digest=hashlib.sha256(data).hexdigest(), how=how
    )


def _holds(folder: pathlib.Path, copy: Corrupted) -> bool:
    shard = folder / copy.path
    return shard.is_file() and hashlib.sha256(shard.read_bytes()).hexdigest() == copy.digest


def where(root: pathlib.Path, copy: Corrupted) -> Where:
    """In its step folder, moved aside as quarantine (with its reason), or gone."""
    if _holds(layout.step_dir(root, copy.step), copy):
        return "in_place"
    name = manifest_mod.step_dir_name(copy.step)
    base = root / aside.ASIDE_DIR / "quarantine"
    for folder in (*base.glob(f"*/{name}"), *base.glob(f"*/{name}.*")):
        reason = folder.with_name(f"{folder.name}{aside.REASON_SUFFIX}")
        if (
            folder.is_dir()
            and _holds(folder, copy)
            and reason.is_file()
            and reason.read_text().startswith("kind: quarantine\n")
        ):
            return "quarantined"
    return "gone"


def reason_without_folder(root: pathlib.Path, copy: Corrupted) -> bool:
    """A quarantine reason file for this step beside no moved folder: a kill
    between the reason file and the rename left it (the pause point's spot)."""
    name = manifest_mod.step_dir_name(copy.step)
    base = root / aside.ASIDE_DIR / "quarantine"
    for reason in base.glob(f"*/{name}*{aside.REASON_SUFFIX}"):
        folder = reason.with_name(reason.name.removesuffix(aside.REASON_SUFFIX))
        if not folder.exists():
            return True
    return False
