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

Compatibility: readers accept unknown fields of the same major
`format_version` (a newer Cairn may add optional facts) and refuse a newer
major version with `UnsupportedManifestVersionError`, a specific error that
callers keep apart from garbage: such a step is kept, never deleted. The
optional identity fields (`job_uid`, `lineage`, `parent`, `data_prefix`) are
absent from manifests written by older Cairn; such a manifest belongs to the
job that reads it and its data objects sit directly under `step-<N>/`.
"""

from __future__ import annotations

import json
import re
import typing

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


class UnsupportedManifestVersionError(ValueError):
    """A manifest of a newer major format version: readable by a newer Cairn only.

    Not garbage: a step with such a manifest is kept (and reported), never
    deleted or overwritten.
    """

    def __init__(self, version: object) -> None:
        super().__init__(
            f"manifest format_version {version!r} is newer than the supported {FORMAT_VERSION}"
            " (written by a newer Cairn); the step is kept, not loaded"
        )
        self.version = version


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

    # Unknown fields of the same major version are accepted (and kept).
    model_config = pydantic.ConfigDict(frozen=True, extra="allow")

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


class Parent(pydantic.BaseModel):
    """The step a lineage branched from (the step its first attempt loaded)."""

    model_config = pydantic.ConfigDict(frozen=True, extra="allow")

    step: int = pydantic.Field(ge=0)
    lineage: str | None = None


class Manifest(pydantic.BaseModel):
    """The commit record of one checkpoint step (`step-<N>/manifest.json`)."""

    # Unknown fields of the same major version are accepted (and kept), so a
    # newer Cairn can add optional facts without older readers discarding steps.
    model_config = pydantic.ConfigDict(frozen=True, extra="allow")

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
    job_uid: str | None = None
    """UID of the TrainingJob that wrote the step; None: an older Cairn (this job's)."""
    lineage: str | None = None
    """Lineage id `<uid8>-a<attempt>` of the attempt that started the lineage."""
    parent: Parent | None = None
    """Where the lineage branched from (None: it started fresh or continues)."""
    data_prefix: str | None = None
    """S3 sub-prefix of the data objects under `step-<N>/` (attempt-scoped);
    None: keys directly under `step-<N>/` (older Cairn)."""

    @pydantic.field_validator("format_version")
    @classmethod
    def _known_version(cls, value: int) -> int:
        if value > FORMAT_VERSION:
            raise UnsupportedManifestVersionError(value)
        return value

    @pydantic.field_validator("data_prefix")
    @classmethod
    def _one_component(cls, value: str | None) -> str | None:
        if value is not None and ("/" in check_relative_path(value) or value == MANIFEST_NAME):
            raise UnsafePathError(f"data_prefix {value!r} must be one path component")
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

    def data_key(self, path: str) -> str:
        """Key of a listed file relative to `step-<N>/` in S3. Pure."""
        return f"{self.data_prefix}/{path}" if self.data_prefix else path


def parse_manifest(data: bytes | str) -> Manifest:
    """Parse and validate manifest JSON. Pure.

    Raises UnsupportedManifestVersionError for a newer major `format_version`
    (checked before the schema, whose fields a newer version may change),
    pydantic.ValidationError (a ValueError) for anything else invalid.
    """
    version = _peek_version(data)
    if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
        raise UnsupportedManifestVersionError(version)
    return Manifest.model_validate_json(data)


def _peek_version(data: bytes | str) -> object:
    try:
        doc: typing.Any = json.loads(data)
    except ValueError:
        return None  # invalid JSON: the schema validation reports it
    return doc.get("format_version") if isinstance(doc, dict) else None


def dump_manifest(manifest: Manifest) -> bytes:
    """Canonical JSON bytes of a manifest. Pure."""
    return manifest.model_dump_json(indent=2).encode() + b"\n"
