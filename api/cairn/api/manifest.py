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
optional identity fields (`lineage`, `parent`, `data_prefix`) are absent
from manifests written by older Cairn; such data objects sit directly under
`step-<N>/`.

Authenticity (docs/security.md, "Authenticated manifests"): anyone who can
write a step folder can also compute its sizes and CRC32C, so those prove
integrity, not origin. Rank 0 signs each manifest with the job's secret key
(`sign`: HMAC-SHA256 over `canonical_bytes`, every field but the signature);
`authenticate` is the one rule for "this manifest is this job's own": with a
`Keyring` the signature must verify with one of its keys and `job_uid` must be
the job's; without one (library use, no key configured) `job_uid` must be
the job's, and a manifest without `job_uid` is foreign. Only `hmac`/`hashlib`
here: the key is drawn by the operator (`secrets`) and read by the trainer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import re
import typing
from collections.abc import Mapping

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


SIGNATURE_ALG = "hmac-sha256"
"""The one signature algorithm: HMAC-SHA256 over `canonical_bytes`."""
KEY_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
MIN_KEY_BYTES = 16


class Signature(pydantic.BaseModel):
    """Who vouches for a manifest: an HMAC of its canonical bytes with a job key."""

    model_config = pydantic.ConfigDict(frozen=True, extra="allow")

    alg: str
    """`hmac-sha256`; anything else does not verify (kept as a string so a
    newer algorithm makes a step foreign here, not unreadable)."""
    key_id: str = pydantic.Field(pattern=KEY_ID_PATTERN)
    """Which key of the job's keyring signed (rotation keeps older ids)."""
    mac: str = pydantic.Field(pattern=r"^[0-9a-f]{64}$")
    """HMAC-SHA256, 64 lowercase hex digits."""


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
    """UID of the TrainingJob that wrote the step; None (an older Cairn, or a
    forgery): never this job's own when the job has a UID (`authenticate`)."""
    lineage: str | None = None
    """Lineage id `<uid8>-a<attempt>` of the attempt that started the lineage."""
    parent: Parent | None = None
    """Where the lineage branched from (None: it started fresh or continues)."""
    data_prefix: str | None = None
    """S3 sub-prefix of the data objects under `step-<N>/` (attempt-scoped);
    None: keys directly under `step-<N>/` (older Cairn)."""
    tiers: tuple[str, ...] | None = pydantic.Field(default=None, max_length=8)
    """The in-pod tiers the writer keeps the step in ("memory", "peer",
    "volume"; `cairn.checkpoint.tiers`); None: not recorded (an older Cairn,
    or an import; None keeps older signatures valid, `canonical_bytes`).
    Informational: restore checks each tier's bytes itself."""
    signature: Signature | None = None
    """`sign`'s HMAC over every other field; None: unsigned (no key configured)."""

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


# -- authenticity ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Keyring:
    """A job's manifest keys by id, and the id new manifests are signed with.

    The operator keeps it in the job's Secret (`keyring.json`, see
    `parse_keyring`); rotation adds a key and makes it current while the
    older ones still verify (`rotated`). The repr never shows a key.
    """

    current: str
    keys: Mapping[str, bytes] = dataclasses.field(repr=False)

    def __post_init__(self) -> None:
        for key_id, key in self.keys.items():
            if not re.match(KEY_ID_PATTERN, key_id):
                raise ValueError(f"Keyring: key id {key_id!r} must match {KEY_ID_PATTERN}")
            if len(key) < MIN_KEY_BYTES:
                raise ValueError(f"Keyring: key {key_id!r} is shorter than {MIN_KEY_BYTES} bytes")
        if self.current not in self.keys:
            raise ValueError(f"Keyring: current key id {self.current!r} is not among the keys")

    def __repr__(self) -> str:
        return f"Keyring(current={self.current!r}, ids={sorted(self.keys)!r})"


def parse_keyring(data: bytes | str) -> Keyring:
    """`{"current": id, "keys": {id: hex}}` -> Keyring; ValueError without the key bytes. Pure."""
    try:
        doc = json.loads(data)
        keys = {str(k): bytes.fromhex(v) for k, v in doc["keys"].items()}
        current = doc["current"]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(
            f"keyring is not {{current, keys: {{id: hex}}}}: {type(exc).__name__}"
        ) from None
    if not isinstance(current, str):
        raise ValueError("keyring: current must be a key id string")
    return Keyring(current=current, keys=keys)


def dump_keyring(keyring: Keyring) -> bytes:
    """The keyring file's bytes (the inverse of `parse_keyring`). Pure."""
    doc = {
        "current": keyring.current,
        "keys": {k: v.hex() for k, v in sorted(keyring.keys.items())},
    }
    return json.dumps(doc, sort_keys=True).encode()


def rotated(keyring: Keyring, *, key_id: str, key: bytes) -> Keyring:
    """`keyring` with `key` added under a new `key_id` and made current. Pure.

    Older keys stay: steps they signed still verify; new steps are signed
    with the new key."""
    if key_id in keyring.keys:
        raise ValueError(f"key id {key_id!r} is already in the keyring")
    return Keyring(current=key_id, keys={**keyring.keys, key_id: key})


def _drop_none(value: typing.Any) -> typing.Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


def canonical_bytes(manifest: Manifest) -> bytes:
    """The bytes a signature covers: every field except `signature`. Pure.

    Deterministic JSON (sorted keys, no spaces, ASCII) of the whole model,
    unknown fields included; None values are left out so that an optional
    field added later (defaulting to None) leaves older signatures valid.
    """
    doc = _drop_none(manifest.model_dump(mode="json", exclude={"signature"}))
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _mac(manifest: Manifest, key: bytes) -> str:
    return hmac.new(key, canonical_bytes(manifest), hashlib.sha256).hexdigest()


def sign(manifest: Manifest, keyring: Keyring) -> Manifest:
    """`manifest` with a signature by the keyring's current key (replacing any). Pure."""
    unsigned = manifest.model_copy(update={"signature": None})
    mac = _mac(unsigned, keyring.keys[keyring.current])
    signature = Signature(alg=SIGNATURE_ALG, key_id=keyring.current, mac=mac)
    return unsigned.model_copy(update={"signature": signature})


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Authenticity:
    """Whether a manifest is this job's own, and why not."""

    own: bool
    signed: bool = False
    """True when a keyring verified the signature."""
    reason: str = ""
    """Why it is not this job's own (for logs, status and events; never a key)."""


def verify(manifest: Manifest, keyring: Keyring) -> Authenticity:
    """Does the signature verify with one of the keyring's keys? Pure, constant-time compare."""
    sig = manifest.signature
    if sig is None:
        return Authenticity(own=False, reason="manifest is not signed")
    if sig.alg != SIGNATURE_ALG:
        return Authenticity(own=False, reason=f"unknown signature algorithm {sig.alg!r}")
    key = keyring.keys.get(sig.key_id)
    if key is None:
        return Authenticity(own=False, reason=f"signed with key id {sig.key_id!r}, not this job's")
    if not hmac.compare_digest(_mac(manifest, key), sig.mac):
        return Authenticity(own=False, reason=f"signature (key id {sig.key_id!r}) does not verify")
    return Authenticity(own=True, signed=True)


def authenticate(
    manifest: Manifest, *, job_uid: str | None, keyring: Keyring | None
) -> Authenticity:
    """THE rule for "this manifest is this job's own". Pure.

    With a keyring: the signature must verify with one of its keys, and the
    manifest's `job_uid` must be `job_uid` (when the job has one). Without a
    keyring (no key configured: library use, outside Kubernetes): unsigned
    and signed manifests alike are judged by `job_uid` alone, which must be
    present and equal; a job without a UID takes every manifest as its own.
    """
    if keyring is not None:
        checked = verify(manifest, keyring)
        if not checked.own:
            return checked
    if job_uid is not None and manifest.job_uid != job_uid:
        who = "no job UID" if manifest.job_uid is None else f"job UID {manifest.job_uid}"
        return Authenticity(own=False, reason=f"manifest records {who}, not this job's {job_uid}")
    return Authenticity(own=True, signed=keyring is not None)
