"""The local on-disk layout of checkpoints and the one "committed" predicate.

    <root>/.cairn-fence            highest attempt id that started (fencing)
    <root>/step-000000120/         one folder per step, zero-padded
        __0_0.distcp ...           DCP data files, one per rank (and thread)
        .metadata                  DCP metadata (rank 0)
        manifest.json              commit record, written LAST by rank 0
        .uploaded                  local marker: the remote manifest exists

`is_committed()` is the only predicate that discovery, resume and rotation
use. Everything that writes here is durable before it is visible: files are
fsynced, then renamed or linked into place, then the folder is fsynced.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import shutil
import typing

import pydantic
from awscrt import checksums

from cairn.api import manifest as manifest_mod
from cairn.checkpoint import errors

FENCE_NAME = ".cairn-fence"
UPLOADED_MARKER = ".uploaded"
_CHUNK = 8 * 1024 * 1024


def step_dir(root: pathlib.Path, step: int) -> pathlib.Path:
    return root / manifest_mod.step_dir_name(step)


def step_dirs(root: pathlib.Path) -> dict[int, pathlib.Path]:
    """Every `step-<N>` folder under root (committed or not), by step."""
    found: dict[int, pathlib.Path] = {}
    if not root.is_dir():
        return found
    for child in root.iterdir():
        step = manifest_mod.parse_step_dir_name(child.name)
        if step is not None and child.is_dir() and not child.is_symlink():
            found[step] = child
    return found


def read_manifest(folder: pathlib.Path) -> manifest_mod.Manifest:
    """Parse `folder/manifest.json`; raises CheckpointError if absent or invalid."""
    path = folder / manifest_mod.MANIFEST_NAME
    if path.is_symlink():
        raise errors.CheckpointError(f"{path} is a symlink; refused")
    try:
        return manifest_mod.parse_manifest(path.read_bytes())
    except (OSError, pydantic.ValidationError) as exc:
        raise errors.CheckpointError(f"{path}: no valid manifest: {exc}") from exc


def is_committed(folder: pathlib.Path) -> bool:
    """THE commit predicate: a valid manifest for this folder's step is present.

    A folder without one is an abandoned partial (or still being written) and
    is never loaded, counted, or kept by rotation.
    """
    step = manifest_mod.parse_step_dir_name(folder.name)
    if step is None:
        return False
    try:
        return read_manifest(folder).step == step
    except errors.CheckpointError:
        return False


def committed_steps(root: pathlib.Path) -> list[int]:
    """Committed steps under root, oldest first."""
    return sorted(step for step, folder in step_dirs(root).items() if is_committed(folder))


def fsync_dir(folder: pathlib.Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_crc32c(path: pathlib.Path) -> tuple[int, str]:
    """(size, CRC32C as 8 hex digits) of a file, read in chunks."""
    crc = 0
    size = 0
    with path.open("rb", buffering=0) as stream:
        while chunk := stream.read(_CHUNK):
            crc = checksums.crc32c(chunk, crc)
            size += len(chunk)
    return size, f"{crc:08x}"


def entry_for(folder: pathlib.Path, name: str, *, rank: int) -> manifest_mod.FileEntry:
    size, crc = file_crc32c(folder / name)
    return manifest_mod.FileEntry(path=name, size=size, crc32c=crc, rank=rank)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Problem:
    path: str
    reason: str


def safe_target(folder: pathlib.Path, relative: str) -> pathlib.Path:
    """The path of a manifest entry inside folder; refuses escapes and symlinks."""
    manifest_mod.check_relative_path(relative)
    target = folder / relative
    current = folder
    for part in pathlib.PurePosixPath(relative).parts:
        current = current / part
        if current.is_symlink():
            raise manifest_mod.UnsafePathError(f"{relative!r}: {current} is a symlink")
    if not target.resolve().is_relative_to(folder.resolve()):
        raise manifest_mod.UnsafePathError(f"{relative!r} resolves outside {folder}")
    return target


def verify_files(
    folder: pathlib.Path, entries: tuple[manifest_mod.FileEntry, ...]
) -> list[Problem]:
    """Check sizes and CRC32C of the given manifest entries; [] when all match."""
    problems: list[Problem] = []
    for entry in entries:
        try:
            target = safe_target(folder, entry.path)
        except manifest_mod.UnsafePathError as exc:
            problems.append(Problem(path=entry.path, reason=str(exc)))
            continue
        if not target.is_file():
            problems.append(Problem(path=entry.path, reason="missing"))
            continue
        if target.stat().st_size != entry.size:
            problems.append(
                Problem(
                    path=entry.path,
                    reason=f"size {target.stat().st_size} != manifest {entry.size}",
                )
            )
            continue
        _, crc = file_crc32c(target)
        if crc != entry.crc32c:
            problems.append(
                Problem(path=entry.path, reason=f"crc32c {crc} != manifest {entry.crc32c}")
            )
    return problems


def write_manifest_exclusive(folder: pathlib.Path, manifest: manifest_mod.Manifest) -> None:
    """Publish the manifest durably and only if none exists (the local commit).

    Written to a temporary file, fsynced, then hard-linked into place: link
    fails if `manifest.json` exists, so a commit never overwrites another
    (possibly newer) one. Then the folder is fsynced.
    """
    final = folder / manifest_mod.MANIFEST_NAME
    tmp = folder / f".{manifest_mod.MANIFEST_NAME}.tmp-{os.getpid()}"
    with tmp.open("wb") as stream:
        stream.write(manifest_mod.dump_manifest(manifest))
        stream.flush()
        os.fsync(stream.fileno())
    try:
        os.link(tmp, final)
    except FileExistsError as exc:
        raise errors.FencedError(f"{final} already exists; refusing to overwrite") from exc
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(folder)


def read_fence(root: pathlib.Path) -> int:
    """Highest attempt id that started writing under root (-1 if none)."""
    try:
        return int((root / FENCE_NAME).read_text().strip())
    except FileNotFoundError:
        return -1
    except ValueError as exc:
        raise errors.CheckpointError(f"{root / FENCE_NAME} is not an integer") from exc


def raise_fence(root: pathlib.Path, attempt: int) -> None:
    """Record that `attempt` started; refuses if a newer attempt already did.

    From here on, commits of older attempts are refused (`check_fence`).
    """
    current = read_fence(root)
    if current > attempt:
        raise errors.FencedError(f"attempt {attempt} started after newer attempt {current}")
    if current == attempt:
        return
    tmp = root / f"{FENCE_NAME}.tmp-{os.getpid()}"
    tmp.write_text(f"{attempt}\n")
    with tmp.open("rb") as stream:
        os.fsync(stream.fileno())
    tmp.replace(root / FENCE_NAME)
    fsync_dir(root)


def check_fence(root: pathlib.Path, attempt: int) -> None:
    """Refuse (FencedError) when a newer attempt than ours has started."""
    current = read_fence(root)
    if current > attempt:
        raise errors.FencedError(
            f"attempt {attempt} may not commit: attempt {current} has started (fenced)"
        )


def delete_step(
    folder: pathlib.Path, *, after_manifest: typing.Callable[[], None] | None = None
) -> int:
    """Delete a step folder, manifest first; returns bytes freed.

    After the manifest is gone (and the folder fsynced) the step is no
    longer committed, so an interruption leaves an abandoned partial.
    """
    freed = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())
    with contextlib.suppress(FileNotFoundError):
        (folder / manifest_mod.MANIFEST_NAME).unlink()
        fsync_dir(folder)
    if after_manifest is not None:
        after_manifest()
    shutil.rmtree(folder, ignore_errors=True)
    return freed


def is_uploaded(folder: pathlib.Path) -> bool:
    return (folder / UPLOADED_MARKER).is_file()


def mark_uploaded(folder: pathlib.Path) -> None:
    (folder / UPLOADED_MARKER).write_text("")
    fsync_dir(folder)
