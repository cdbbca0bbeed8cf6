"""The checkpoint manifest: schema, step-folder naming and path safety.

Shared by the trainer (which writes `step-<N>/manifest.json` last, as the
commit record of a checkpoint step) and the operator (which reads uploaded
manifests for status, verification and remote retention). Everything here is
pure: no filesystem, no network, no torch, no boto3.

A manifest lists every file of the step with its size and CRC32C, so that a
reader can verify a step before loading it. Paths in a manifest are relative
POSIX paths inside the step folder; anything that could escape it (``..``,
absolute paths, backslashes, NUL) is refused at parse time, so a hostile or
corrupted manifest in a bucket can never make a download write outside the
step folder. Symlinks are a property of the filesystem, so the trainer checks
those where it touches files (see `cairn.checkpoint.layout`).
"""

from __future__ import annotations

import re

import pydantic

MANIFEST_NAME = "manifest.json"
"""File name of the commit record inside a step folder; written last."""

FORMAT_VERSION = 1
"""Bumped on incompatible manifest changes; readers refuse newer versions."""

STEP_DIGITS = 9
STEP_PREFIX = "step-"
_STEP_RE = re.compile(rf"^step-(\d{{{STEP_DIGITS},}})$")


class UnsafePathError(ValueError):
    """A manifest path that could escape the step folder."""


def step_dir_name(step: int) -> str:
    """Folder (and S3 key prefix) name of a step, zero-padded so names sort. Pure."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"{STEP_PREFIX}{step:0{STEP_DIGITS}d}"


def parse_step_dir_name(name: str) -> int | None:
    """The step of a `step-<N>` folder name, or None for any other name. Pure."""
    match = _STEP_RE.match(name)
    return int(match.group(1)) if match else None


def check_relative_path(path: str) -> str:
    """Return `path` if it is a safe relative POSIX path inside a folder. Pure.

    Raises UnsafePathError for empty paths, absolute paths, drive letters,
    backslashes, NUL bytes, and any `.`/`..` component.
    """
    if not path:
        raise UnsafePathError("empty path")
    if "\x00" in path:
        raise UnsafePathError(f"NUL byte in path {path!r}")
    if "\\" in path:
        raise UnsafePathError(f"backslash in path {path!r}")
    if path.startswith("/") or re.match(r"^[A-Za-z]:", path):
        raise UnsafePathError(f"absolute path {path!r}")
    parts = path.split("/")
    for part in parts:
        if part in ("", ".", ".."):
            raise UnsafePathError(f"path {path!r} has an empty, '.' or '..' component")
    return path


class FileEntry(pydantic.BaseModel):
    """One file of a checkpoint step."""

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid")

    path: str
    """Relative POSIX path inside the step folder."""
    size: int = pydantic.Field(ge=0)
    """Size in bytes."""
    crc32c: str = pydantic.Field(pattern=r"^[0-9a-f]{8}$")
    """CRC32C of the whole file, 8 lowercase hex digits (Castagnoli, as S3 uses)."""
    rank: int = pydantic.Field(ge=0)
    """The rank that wrote (and uploads) this file."""

    @pydantic.field_validator("path")
    @classmethod
    def _safe_path(cls, value: str) -> str:
        return check_relative_path(value)


class Manifest(pydantic.BaseModel):
    """The commit record of one checkpoint step (`step-<N>/manifest.json`)."""

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid")

    format_version: int = FORMAT_VERSION
    step: int = pydantic.Field(ge=0)
    world_size: int = pydantic.Field(ge=1)
    attempt: int = pydantic.Field(ge=0)
    """Attempt id of the writer; fencing refuses commits from older attempts."""
    created_at: float
    """Unix time when rank 0 committed."""
    files: tuple[FileEntry, ...]
    versions: dict[str, str] = pydantic.Field(default_factory=dict)
    """Versions of the software that wrote the step (torch, cairn, python)."""
    extra: dict[str, str | int | float] = pydantic.Field(default_factory=dict)
    """Small facts for status reporting (write seconds, tokens seen...)."""

    @pydantic.field_validator("format_version")
    @classmethod
    def _known_version(cls, value: int) -> int:
        if value > FORMAT_VERSION:
            raise ValueError(f"manifest format_version {value} is newer than {FORMAT_VERSION}")
        return value

    @pydantic.model_validator(mode="after")
    def _unique_paths(self) -> Manifest:
        paths = [entry.path for entry in self.files]
        if len(paths) != len(set(paths)):
            raise ValueError("manifest lists a file twice")
        if MANIFEST_NAME in paths:
            raise ValueError("manifest lists itself")
        return self

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files)

    def files_of_rank(self, rank: int) -> tuple[FileEntry, ...]:
        return tuple(entry for entry in self.files if entry.rank == rank)


def parse_manifest(data: bytes | str) -> Manifest:
    """Parse and validate manifest JSON; raises pydantic.ValidationError. Pure."""
    return Manifest.model_validate_json(data)


def dump_manifest(manifest: Manifest) -> bytes:
    """Canonical JSON bytes of a manifest. Pure."""
    return manifest.model_dump_json(indent=2).encode() + b"\n"
