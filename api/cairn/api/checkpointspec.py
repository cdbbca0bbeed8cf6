"""The ``spec.checkpoint`` models: interval, volume, retention, upload, resume.

Pure; part of the TrainingJob API (``cairn.api.trainingjob`` embeds
``CheckpointSpec``). The writer in the pods sees these values through the pod
environment (``cairn.api.podenv``); the operator applies ``retention.remote``
and ``onDelete`` in S3.
"""

import re
from typing import Literal, Self

import pydantic

from cairn.api import schema

AsyncMode = Literal["pinned", "thread", "off"]
OnDelete = Literal["Retain", "Delete"]
UploadOnFailure = Literal["Continue", "Fail"]


class PersistentVolumeClaimSource(schema.SpecModel):
    """A PVC shared by all ranks (ReadWriteMany for nodes > 1)."""

    claim_name: str = pydantic.Field(
        min_length=1, max_length=253, description="A PersistentVolumeClaim in the job's namespace."
    )
    sub_path: str | None = pydantic.Field(
        default=None, max_length=256, description="A folder inside the volume to mount instead."
    )


class EmptyDirSource(schema.SpecModel):
    """Node-local scratch; S3 upload is the durable tier."""

    medium: Literal["", "Memory"] | None = pydantic.Field(
        default=None, description='"" (node disk) or Memory (tmpfs, counts as memory).'
    )
    size_limit: schema.Quantity | None = pydantic.Field(
        default=None,
        description="The kubelet evicts a pod whose folder outgrows this (counted restart).",
        json_schema_extra=schema.cel(
            (schema.quantity_rule("self"), "sizeLimit must be a non-negative quantity")
        ),
    )

    @pydantic.field_validator("size_limit")
    @classmethod
    def _size_limit(cls, value: schema.Quantity | None) -> schema.Quantity | None:
        return None if value is None else schema.check_quantity(value, "sizeLimit")


class CheckpointVolume(schema.SpecModel):
    """Where checkpoint folders live inside the pods: exactly one source."""

    model_config = pydantic.ConfigDict(
        json_schema_extra=schema.cel(
            (
                "has(self.persistentVolumeClaim) != has(self.emptyDir)",
                "set exactly one of persistentVolumeClaim or emptyDir",
            ),
        )
    )

    persistent_volume_claim: PersistentVolumeClaimSource | None = None
    empty_dir: EmptyDirSource | None = None

    @pydantic.model_validator(mode="after")
    def _check(self) -> Self:
        if (self.persistent_volume_claim is None) == (self.empty_dir is None):
            raise ValueError("set exactly one of persistentVolumeClaim or emptyDir")
        return self


def split_s3_uri(uri: str) -> tuple[str, str]:
    """Pure: ``s3://bucket/prefix`` as (bucket, key prefix without leading or
    trailing slashes, '' for the bucket root)."""
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    return bucket, prefix.strip("/")


SYSTEM_DIRECTORIES: tuple[str, ...] = (
    "bin",
    "boot",
    "dev",
    "etc",
    "lib",
    "lib32",
    "lib64",
    "proc",
    "run",
    "sbin",
    "sys",
    "usr",
    "var/run",
)
"""Mounting over these (or below them) hides what the pod needs to run."""
_DOTDOT = "(^|/)[.][.](/|$)"
_SYSTEM = f"^/+({'|'.join(SYSTEM_DIRECTORIES)})(/.*)?$"
MOUNT_PATH_RULES: tuple[tuple[str, str], ...] = (
    (f"!self.matches('{_DOTDOT}')", "mountPath must not contain '..'"),
    ("!self.matches('^/+$')", "mountPath must not be /"),
    (f"!self.matches('{_SYSTEM}')", "mountPath must not be a system directory or below one"),
)


def mount_path_error(path: str) -> str | None:
    """Pure twin of MOUNT_PATH_RULES: the first rule ``path`` breaks, or None."""
    for pattern, message in (
        (_DOTDOT, MOUNT_PATH_RULES[0][1]),
        ("^/+$", MOUNT_PATH_RULES[1][1]),
        (_SYSTEM, MOUNT_PATH_RULES[2][1]),
    ):
        if re.search(pattern, path):
            return message
    return None


def _default_volume() -> CheckpointVolume:
    return CheckpointVolume(empty_dir=EmptyDirSource())


class LocalRetention(schema.SpecModel):
    """Rotation of committed steps on the checkpoint volume (done by the writer)."""

    keep_last: int = pydantic.Field(
        default=3,
        le=1000,
        description="Committed steps kept; >= 2 because the newest may still be writing.",
        json_schema_extra=schema.cel(
            ("self >= 2", "keepLast must be >= 2: the newest checkpoint may still be writing"),
        ),
    )
    max_bytes: int | None = pydantic.Field(
        default=None,
        ge=1,
        description="Byte budget for committed steps.",
        json_schema_extra={"format": "int64"},
    )

    @pydantic.field_validator("keep_last")
    @classmethod
    def _keep_last(cls, value: int) -> int:
        if value < 2:
            raise ValueError("keepLast must be >= 2: the newest checkpoint may still be writing")
        return value


class RemoteRetention(schema.SpecModel):
    """Retention in S3 (applied by the operator); unset fields keep everything."""

    keep_last: int | None = pydantic.Field(
        default=None, ge=1, le=100000, description="Newest committed steps kept in S3."
    )
    keep_every: int | None = pydantic.Field(
        default=None, ge=1, description="Keep every step that is a multiple of this (milestones)."
    )


class Retention(schema.SpecModel):
    """Which committed steps are kept, on the volume and in S3."""

    local: LocalRetention = pydantic.Field(
        default_factory=LocalRetention, json_schema_extra=schema.object_default(LocalRetention)
    )
    remote: RemoteRetention | None = None


MEMORY_SIZE_REQUIRED = "memory.sizeLimit is required when memory.enabled is true"
MEMORY_OVER_LIMIT = (
    "checkpoint.memory.sizeLimit must be less than resources.limits.memory "
    "(the memory-backed volume counts against the container's memory limit)"
)

_QUANTITY_SUFFIX: dict[str, float] = {
    "": 1,
    **{s: 1000**i for i, s in enumerate(("k", "M", "G", "T", "P", "E"), start=1)},
    **{s: 1024**i for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"), start=1)},
    "m": 1e-3,
    "u": 1e-6,
    "n": 1e-9,
}


def quantity_value(value: schema.Quantity) -> float:
    """A core/v1 quantity as a number (bytes for memory). Pure."""
    text = str(value)
    found = re.fullmatch(
        r"([+-]?(?:[0-9]+(?:[.][0-9]*)?|[.][0-9]+))([eE][+-]?[0-9]+|[a-zA-Z]*)", text
    )
    if found is None:
        raise ValueError(f"not a quantity: {text!r}")
    number, suffix = str(found.group(1)), str(found.group(2))
    if suffix in _QUANTITY_SUFFIX:
        return float(number) * _QUANTITY_SUFFIX[suffix]
    if re.fullmatch(r"[eE][+-]?[0-9]+", suffix):
        return float(number + suffix)
    raise ValueError(f"not a quantity: {text!r}")


class MemoryTier(schema.SpecModel):
    """The in-memory tier: each rank keeps its newest committed shard in a
    memory-backed volume (and a replica of its predecessor's, the same local
    rank of the previous pod).

    Memory cost per pod: about twice its ranks' shards (their own copies plus
    the replicas of the previous pod's) with replicas 1; counted against the
    container's memory limit."""

    model_config = pydantic.ConfigDict(
        json_schema_extra=schema.cel(
            (
                "!self.enabled || has(self.sizeLimit)",
                MEMORY_SIZE_REQUIRED,
                ".sizeLimit",
            ),
        )
    )

    enabled: bool = pydantic.Field(
        default=False,
        description="Keep the newest committed step in pod memory; restore tries it first.",
    )
    size_limit: schema.Quantity | None = pydantic.Field(
        default=None,
        description="Size of the memory-backed emptyDir (about 2x the pod's ranks' shards "
        "with replicas 1); required when enabled, less than resources.limits.memory.",
        json_schema_extra=schema.cel(
            (schema.quantity_rule("self"), "sizeLimit must be a non-negative quantity")
        ),
    )
    replicas: int = pydantic.Field(
        default=1,
        ge=0,
        le=1,
        description="Replicas of each rank's copy in another pod's memory (rank r -> "
        "r+procsPerNode mod N).",
    )

    @pydantic.field_validator("size_limit")
    @classmethod
    def _size_limit(cls, value: schema.Quantity | None) -> schema.Quantity | None:
        return None if value is None else schema.check_quantity(value, "sizeLimit")

    @pydantic.model_validator(mode="after")
    def _check(self) -> Self:
        if self.enabled and self.size_limit is None:
            raise ValueError(MEMORY_SIZE_REQUIRED)
        return self


class SecretRef(schema.SpecModel):
    """A Secret in the job's namespace; its values reach pods via secretKeyRef only."""

    name: str = pydantic.Field(min_length=1, max_length=253, description="The Secret's name.")
    access_key_id_key: str = pydantic.Field(
        default="AWS_ACCESS_KEY_ID", max_length=253, description="Key of the access key id."
    )
    secret_access_key_key: str = pydantic.Field(
        default="AWS_SECRET_ACCESS_KEY", max_length=253, description="Key of the secret key."
    )


class UploadSpec(schema.SpecModel):
    """The S3 durable tier: ``uri`` is this job's own prefix."""

    uri: str = pydantic.Field(
        min_length=1,
        max_length=1024,
        description="s3://bucket/prefix owned by this job.",
        json_schema_extra=schema.cel(
            (f"self.matches('{schema.S3_URI_PATTERN}')", "uri must look like s3://bucket/prefix"),
        ),
    )
    endpoint: str | None = pydantic.Field(
        default=None,
        max_length=512,
        description="S3 endpoint for MinIO, SeaweedFS and others.",
        json_schema_extra=schema.cel(
            (f"self.matches('{schema.ENDPOINT_PATTERN}')", "endpoint must be an http(s) URL"),
        ),
    )
    region: str | None = pydantic.Field(default=None, max_length=64, description="S3 region.")
    credentials_secret_ref: SecretRef | None = None
    concurrency: int = pydantic.Field(
        default=8, ge=1, le=64, description="Parallel part uploads per rank."
    )
    on_failure: UploadOnFailure = pydantic.Field(
        default="Continue",
        description=(
            "What an upload failure does. Continue: training goes on, the step stays "
            "committed locally and is uploaded later (next saves with backoff, start-up); "
            "the job shows UploadFailing with the error; local retention keeps steps that "
            "are not uploaded and reports when that exceeds its budget. Fail: the trainer "
            "stops with the error."
        ),
    )
    interval_steps: int | None = pydantic.Field(
        default=None,
        ge=1,
        description=(
            "Upload only the saves of steps divisible by this (a multiple of "
            "checkpoint.intervalSteps), and the final (SIGTERM) and last ones; the others "
            "stay on the volume and in memory and rotate without an upload. Saving every "
            "step to memory while S3 gets every Mth is the point. Unset: every save."
        ),
    )
    stall_seconds: int = pydantic.Field(
        default=30,
        ge=5,
        le=3600,
        description=(
            "A transfer (upload or restore download) that moves no bytes for this long is "
            "cancelled and reported (UploadFailing: no progress for N s to the endpoint), "
            "then retried with backoff; a hung store never stalls training."
        ),
    )

    @pydantic.field_validator("uri")
    @classmethod
    def _uri(cls, value: str) -> str:
        if re.fullmatch(schema.S3_URI_PATTERN[1:-1], value) is None:
            raise ValueError("uri must look like s3://bucket/prefix")
        return value

    @pydantic.field_validator("endpoint")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        if value is not None and re.fullmatch(schema.ENDPOINT_PATTERN[1:-1], value) is None:
            raise ValueError("endpoint must be an http(s) URL")
        return value


UPLOAD_INTERVAL_MULTIPLE = (
    "upload.intervalSteps must be a multiple of intervalSteps (it picks which saves are "
    "uploaded; with intervalSeconds no step number is known in advance)"
)
RESUME_EXACTLY_ONE = "set exactly one of latest, none, step or uri"
RESUME_SHA256_TARGET = "sha256 pins an explicit target: set it with step or uri"
SHA256_PATTERN = r"^[0-9a-f]{64}$"


RESUME_REQUEST_ANNOTATION = "cairn.dev/resume-request"
"""A new value asks for the explicit ``resume`` target again (``kubectl cairn
resume`` sets it): the operator applies an explicit target once per request."""


class Resume(schema.SpecModel):
    """What the job resumes from: exactly one form. An explicit one (step, uri,
    none) applies once, to the next attempt started after it is set or
    re-requested; later attempts resume from the newest committed step."""

    model_config = pydantic.ConfigDict(
        json_schema_extra=schema.cel(
            (
                "[has(self.latest), has(self.none), has(self.step), has(self.uri)]"
                ".filter(x, x).size() == 1",
                RESUME_EXACTLY_ONE,
            ),
            ("!has(self.latest) || self.latest", "latest must be true when set", ".latest"),
            ("!has(self.none) || self.none", "none must be true when set", ".none"),
            (
                "!has(self.sha256) || has(self.step) || has(self.uri)",
                RESUME_SHA256_TARGET,
                ".sha256",
            ),
        )
    )

    latest: bool | None = pydantic.Field(
        default=None, description="Newest committed step, local or remote."
    )
    none: bool | None = pydantic.Field(default=None, description="Start from scratch.")
    step: int | None = pydantic.Field(default=None, ge=0, description="This committed step.")
    uri: str | None = pydantic.Field(
        default=None,
        max_length=1024,
        description="An S3 step folder to import: a Cairn step (manifest.json) or a plain DCP "
        "checkpoint (TorchTitan, dcp.save); read with the upload endpoint and credentials.",
        json_schema_extra=schema.cel(
            (f"self.matches('{schema.S3_URI_PATTERN}')", "uri must look like s3://bucket/prefix"),
        ),
    )

    sha256: str | None = pydantic.Field(
        default=None,
        pattern=SHA256_PATTERN,
        description="SHA-256 (64 lowercase hex digits) of the target's DCP .metadata file: "
        "pins exactly the checkpoint that was reviewed; a different .metadata fails the job "
        "before it is read. Only with step or uri.",
    )

    @pydantic.model_validator(mode="after")
    def _check(self) -> Self:
        forms = [self.latest, self.none, self.step, self.uri]
        if sum(f is not None for f in forms) != 1:
            raise ValueError(RESUME_EXACTLY_ONE)
        if self.latest is False:
            raise ValueError("latest must be true when set")
        if self.none is False:
            raise ValueError("none must be true when set")
        if self.uri is not None and re.fullmatch(schema.S3_URI_PATTERN[1:-1], self.uri) is None:
            raise ValueError("uri must look like s3://bucket/prefix")
        if self.sha256 is not None and self.step is None and self.uri is None:
            raise ValueError(RESUME_SHA256_TARGET)
        return self


def _default_resume() -> Resume:
    return Resume(latest=True)


class CheckpointSpec(schema.SpecModel):
    """How the trainer checkpoints, where to, and what it resumes from."""

    model_config = pydantic.ConfigDict(
        json_schema_extra=schema.cel(
            (
                "!has(self.retention) || !has(self.retention.remote) || has(self.upload)",
                "retention.remote needs upload",
                ".retention.remote",
            ),
            (
                "!has(self.resume) || !has(self.resume.uri) || has(self.upload)",
                "resume.uri needs upload (its endpoint and credentials are used)",
                ".resume.uri",
            ),
            (
                "!has(self.upload) || !has(self.upload.intervalSteps) || "
                "(has(self.intervalSteps) && self.upload.intervalSteps % self.intervalSteps == 0)",
                UPLOAD_INTERVAL_MULTIPLE,
                ".upload.intervalSteps",
            ),
        )
    )

    interval_steps: int | None = pydantic.Field(
        default=None, ge=1, description="Checkpoint every this many steps."
    )
    interval_seconds: int | None = pydantic.Field(
        default=None, ge=1, description="Checkpoint at the first step this long after the last."
    )
    mount_path: str = pydantic.Field(
        default="/checkpoints",
        max_length=256,
        pattern=schema.ABS_PATH_PATTERN,
        description="Where the volume is mounted in the pods: absolute, no '..', "
        "not / or a system directory.",
        json_schema_extra=schema.cel(*MOUNT_PATH_RULES),
    )
    volume: CheckpointVolume = pydantic.Field(
        default_factory=_default_volume, json_schema_extra={"default": {"emptyDir": {}}}
    )
    async_mode: AsyncMode = pydantic.Field(
        default="pinned",
        description="pinned: stage to host buffers, write in the background; thread: "
        "background thread; off: synchronous.",
    )
    retention: Retention = pydantic.Field(
        default_factory=Retention,
        description="Which committed steps are kept, on the volume and in S3.",
        json_schema_extra=schema.object_default(Retention),
    )
    upload: UploadSpec | None = None
    resume: Resume = pydantic.Field(
        default_factory=_default_resume, json_schema_extra={"default": {"latest": True}}
    )
    on_delete: OnDelete = pydantic.Field(
        default="Retain", description="What happens to the S3 prefix when the job is deleted."
    )
    memory: MemoryTier = pydantic.Field(
        default_factory=MemoryTier,
        description="The in-memory tier (own copy + a peer's replica), tried first on restore.",
        json_schema_extra=schema.object_default(MemoryTier),
    )
    final_checkpoint_grace_seconds: int = pydantic.Field(
        default=300,
        ge=30,
        le=86400,
        description="Pod terminationGracePeriodSeconds: time for the final checkpoint.",
    )
    stale_after_seconds: int | None = pydantic.Field(
        default=None,
        ge=1,
        description="CheckpointStale after this long without a commit while running.",
    )
    status_interval_seconds: int = pydantic.Field(
        default=30,
        ge=1,
        le=3600,
        description="Rank 0 reports status.step at most this often; checkpoint facts "
        "(commits, uploads, errors) are reported when they change.",
    )

    @pydantic.field_validator("mount_path")
    @classmethod
    def _mount_path(cls, value: str) -> str:
        error = mount_path_error(value)
        if error is not None:
            raise ValueError(error)
        return value

    @pydantic.model_validator(mode="after")
    def _check(self) -> Self:
        if self.retention.remote is not None and self.upload is None:
            raise ValueError("retention.remote needs upload")
        if self.resume.uri is not None and self.upload is None:
            raise ValueError("resume.uri needs upload (its endpoint and credentials are used)")
        every = None if self.upload is None else self.upload.interval_steps
        if every is not None and (self.interval_steps is None or every % self.interval_steps):
            raise ValueError(UPLOAD_INTERVAL_MULTIPLE)
        return self
