"""The TrainingJob API (cairn.dev/v1alpha1): one source of truth.

Pure: pydantic v2 models of the spec and the status. ``cairn.api.crdgen``
turns them into the CRD's structural OpenAPI schema, so every constraint
declared here (defaults, enums, ranges, CEL rules) is enforced by the API
server; the Python validators mirror the CEL rules so that the operator and the
tests reject the same objects. Transition rules (``oldSelf``) have a Python
twin in :func:`update_errors`.

Data flow: user YAML -> API server (schema + CEL) -> operator
(``TrainingJob.model_validate``) -> ``cairn.operator.plan``; the writer on
rank 0 patches ``status.step`` and ``status.checkpoints``; the operator
patches the rest of the status.
"""

import datetime
import re
from typing import Annotated, Any, Literal, Self

import pydantic
from pydantic import alias_generators

from cairn.api import jobstatus

GROUP = "cairn.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "TrainingJob"
PLURAL = "trainingjobs"
SINGULAR = "trainingjob"
SHORT_NAMES = ("tj",)

CONTROLLER_NAME = "cairn.dev/trainingjob-controller"
"""The value of ``spec.managedBy`` (or its absence) that this operator acts on."""

MAX_NAME_LENGTH = 45
"""Job names are capped so that ``<job>-a<attempt>-n<rank>`` stays a DNS label."""

RESERVED_ENV_PREFIX = "CAIRN_"
CHECKPOINT_VOLUME_NAME = "cairn-checkpoints"

S3_URI_PATTERN = r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^ ]*)?$"
ENDPOINT_PATTERN = r"^https?://[^ /]+(/[^ ]*)?$"
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
ENV_NAME_PATTERN = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
ABS_PATH_PATTERN = r"^/[^ ]*$"

AsyncMode = Literal["pinned", "thread", "off"]
OnDelete = Literal["Retain", "Delete"]
FinishedPods = Literal["Keep", "Delete"]


def cel(*rules: tuple[str, str] | tuple[str, str, str]) -> dict[str, Any]:
    """JSON-schema extra carrying CEL rules: (rule, message[, fieldPath])."""
    out: list[dict[str, str]] = []
    for item in rules:
        entry = {"rule": item[0], "message": item[1]}
        if len(item) == 3:
            entry["fieldPath"] = item[2]
        out.append(entry)
    return {"x-kubernetes-validations": out}


PRESERVE: dict[str, Any] = {"x-kubernetes-preserve-unknown-fields": True}
"""Schema extra for opaque Kubernetes sub-objects (affinity, volumes…)."""


def object_default(model: type[pydantic.BaseModel]) -> dict[str, Any]:
    """Schema extra: the model's full default, so the API server creates the
    object with every nested default (CEL rules see them) and kubectl explain
    shows them."""
    return {"default": model().model_dump(mode="json", by_alias=True, exclude_none=True)}


class _Model(pydantic.BaseModel):
    """Spec models: camelCase on the wire, unknown fields rejected, no coercion
    (the API server does not coerce either)."""

    model_config = pydantic.ConfigDict(
        alias_generator=alias_generators.to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        strict=True,
    )


def _matches(pattern: str, value: str, field: str) -> str:
    if re.fullmatch(pattern.removeprefix("^").removesuffix("$"), value) is None:
        raise ValueError(f"{field} must match {pattern}")
    return value


# --------------------------------------------------------------------- spec


class EnvVar(_Model):
    """One environment variable of the trainer container (``CAIRN_*`` is reserved)."""

    model_config = pydantic.ConfigDict(
        json_schema_extra=cel(
            (
                f"!self.name.startsWith('{RESERVED_ENV_PREFIX}')",
                f"env names starting with {RESERVED_ENV_PREFIX} are reserved for the operator",
                ".name",
            ),
            ("!(has(self.value) && has(self.valueFrom))", "set value or valueFrom, not both"),
        )
    )

    name: str = pydantic.Field(min_length=1, max_length=256, pattern=ENV_NAME_PATTERN)
    value: str | None = pydantic.Field(default=None, max_length=32768)
    value_from: dict[str, Any] | None = pydantic.Field(
        default=None, description="A core/v1 EnvVarSource.", json_schema_extra=PRESERVE
    )

    @pydantic.model_validator(mode="after")
    def _check(self) -> Self:
        if self.name.startswith(RESERVED_ENV_PREFIX):
            raise ValueError(
                f"env names starting with {RESERVED_ENV_PREFIX} are reserved for the operator"
            )
        if self.value is not None and self.value_from is not None:
            raise ValueError("set value or valueFrom, not both")
        return self


Quantity = int | str
ExitCode = Annotated[int, pydantic.Field(ge=1, le=255)]
Arg = Annotated[str, pydantic.Field(max_length=4096)]


class ResourceRequirements(_Model):
    """Requests and limits of the trainer container (core/v1 quantities)."""

    requests: dict[str, Quantity] | None = pydantic.Field(
        default=None, json_schema_extra={"maxProperties": 16}
    )
    limits: dict[str, Quantity] | None = pydantic.Field(
        default=None, json_schema_extra={"maxProperties": 16}
    )


class ObjectMetaOverlay(_Model):
    """Extra labels and annotations for every pod (e.g. Kueue, service mesh)."""

    labels: dict[str, str] | None = pydantic.Field(
        default=None, json_schema_extra={"maxProperties": 64}
    )
    annotations: dict[str, str] | None = pydantic.Field(
        default=None, json_schema_extra={"maxProperties": 64}
    )


class NamedObject(pydantic.BaseModel):
    """A core/v1 object with a name whose other fields pass through unchanged."""

    model_config = pydantic.ConfigDict(extra="allow", frozen=True, json_schema_extra=PRESERVE)

    name: str = pydantic.Field(min_length=1, max_length=253)


class PodTemplateOverlay(_Model):
    """What the user may add to every pod; the operator owns the rest."""

    model_config = pydantic.ConfigDict(
        json_schema_extra=cel(
            (
                f"!has(self.volumes) || self.volumes.all(v, v.name != '{CHECKPOINT_VOLUME_NAME}')",
                f"the volume name {CHECKPOINT_VOLUME_NAME} is reserved",
                ".volumes",
            ),
        )
    )

    metadata: ObjectMetaOverlay | None = None
    node_selector: dict[str, str] | None = pydantic.Field(
        default=None, json_schema_extra={"maxProperties": 64}
    )
    tolerations: list[dict[str, Any]] | None = pydantic.Field(
        default=None,
        max_length=64,
        description="core/v1 Tolerations.",
        json_schema_extra={"items": {"type": "object", **PRESERVE}},
    )
    affinity: dict[str, Any] | None = pydantic.Field(
        default=None, description="A core/v1 Affinity.", json_schema_extra=PRESERVE
    )
    priority_class_name: str | None = pydantic.Field(default=None, max_length=253)
    scheduler_name: str | None = pydantic.Field(default=None, max_length=253)
    image_pull_secrets: list[dict[str, str]] | None = pydantic.Field(
        default=None, max_length=16, description="core/v1 LocalObjectReferences."
    )
    volumes: list[NamedObject] | None = pydantic.Field(
        default=None, max_length=64, description="core/v1 Volumes added to every pod."
    )
    volume_mounts: list[NamedObject] | None = pydantic.Field(
        default=None, max_length=64, description="core/v1 VolumeMounts of the trainer."
    )

    @pydantic.model_validator(mode="after")
    def _check(self) -> Self:
        if any(v.name == CHECKPOINT_VOLUME_NAME for v in self.volumes or ()):
            raise ValueError(f"the volume name {CHECKPOINT_VOLUME_NAME} is reserved")
        return self


class PersistentVolumeClaimSource(_Model):
    """A PVC shared by all ranks (ReadWriteMany for nodes > 1)."""

    claim_name: str = pydantic.Field(min_length=1, max_length=253)
    sub_path: str | None = pydantic.Field(default=None, max_length=256)


class EmptyDirSource(_Model):
    """Node-local scratch; S3 upload is the durable tier."""

    medium: Literal["", "Memory"] | None = None
    size_limit: Quantity | None = None


class CheckpointVolume(_Model):
    """Where checkpoint folders live inside the pods: exactly one source."""

    model_config = pydantic.ConfigDict(
        json_schema_extra=cel(
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


def _default_volume() -> CheckpointVolume:
    return CheckpointVolume(empty_dir=EmptyDirSource())


class LocalRetention(_Model):
    """Rotation of committed steps on the checkpoint volume (done by the writer)."""

    keep_last: int = pydantic.Field(
        default=3,
        le=1000,
        description="Committed steps kept; >= 2 because the newest may still be writing.",
        json_schema_extra=cel(
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


class RemoteRetention(_Model):
    """Retention in S3 (applied by the operator); unset fields keep everything."""

    keep_last: int | None = pydantic.Field(default=None, ge=1, le=100000)
    keep_every: int | None = pydantic.Field(
        default=None, ge=1, description="Keep every step that is a multiple of this (milestones)."
    )


class Retention(_Model):
    local: LocalRetention = pydantic.Field(
        default_factory=LocalRetention, json_schema_extra=object_default(LocalRetention)
    )
    remote: RemoteRetention | None = None


class SecretRef(_Model):
    """A Secret in the job's namespace; its values reach pods via secretKeyRef only."""

    name: str = pydantic.Field(min_length=1, max_length=253)
    access_key_id_key: str = pydantic.Field(default="AWS_ACCESS_KEY_ID", max_length=253)
    secret_access_key_key: str = pydantic.Field(default="AWS_SECRET_ACCESS_KEY", max_length=253)


class UploadSpec(_Model):
    """The S3 durable tier: ``uri`` is this job's own prefix."""

    uri: str = pydantic.Field(
        min_length=1,
        max_length=1024,
        description="s3://bucket/prefix owned by this job.",
        json_schema_extra=cel(
            (f"self.matches('{S3_URI_PATTERN}')", "uri must look like s3://bucket/prefix"),
        ),
    )
    endpoint: str | None = pydantic.Field(
        default=None,
        max_length=512,
        description="S3 endpoint for MinIO, SeaweedFS and others.",
        json_schema_extra=cel(
            (f"self.matches('{ENDPOINT_PATTERN}')", "endpoint must be an http(s) URL"),
        ),
    )
    region: str | None = pydantic.Field(default=None, max_length=64)
    credentials_secret_ref: SecretRef | None = None
    concurrency: int = pydantic.Field(default=8, ge=1, le=64)

    @pydantic.field_validator("uri")
    @classmethod
    def _uri(cls, value: str) -> str:
        if re.fullmatch(S3_URI_PATTERN[1:-1], value) is None:
            raise ValueError("uri must look like s3://bucket/prefix")
        return value

    @pydantic.field_validator("endpoint")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        if value is not None and re.fullmatch(ENDPOINT_PATTERN[1:-1], value) is None:
            raise ValueError("endpoint must be an http(s) URL")
        return value


RESUME_EXACTLY_ONE = "set exactly one of latest, none, step or uri"


class Resume(_Model):
    """What the first attempt resumes from: exactly one form."""

    model_config = pydantic.ConfigDict(
        json_schema_extra=cel(
            (
                "[has(self.latest), has(self.none), has(self.step), has(self.uri)]"
                ".filter(x, x).size() == 1",
                RESUME_EXACTLY_ONE,
            ),
            ("!has(self.latest) || self.latest", "latest must be true when set", ".latest"),
            ("!has(self.none) || self.none", "none must be true when set", ".none"),
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
        description="A committed step folder in S3.",
        json_schema_extra=cel(
            (f"self.matches('{S3_URI_PATTERN}')", "uri must look like s3://bucket/prefix"),
        ),
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
        if self.uri is not None and re.fullmatch(S3_URI_PATTERN[1:-1], self.uri) is None:
            raise ValueError("uri must look like s3://bucket/prefix")
        return self


def _default_resume() -> Resume:
    return Resume(latest=True)


class CheckpointSpec(_Model):
    """How the trainer checkpoints, where to, and what it resumes from."""

    model_config = pydantic.ConfigDict(
        json_schema_extra=cel(
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
        )
    )

    interval_steps: int | None = pydantic.Field(default=None, ge=1)
    interval_seconds: int | None = pydantic.Field(default=None, ge=1)
    mount_path: str = pydantic.Field(
        default="/checkpoints", max_length=256, pattern=ABS_PATH_PATTERN
    )
    volume: CheckpointVolume = pydantic.Field(
        default_factory=_default_volume, json_schema_extra={"default": {"emptyDir": {}}}
    )
    async_mode: AsyncMode = "pinned"
    retention: Retention = pydantic.Field(
        default_factory=Retention, json_schema_extra=object_default(Retention)
    )
    upload: UploadSpec | None = None
    resume: Resume = pydantic.Field(
        default_factory=_default_resume, json_schema_extra={"default": {"latest": True}}
    )
    on_delete: OnDelete = pydantic.Field(
        default="Retain", description="What happens to the S3 prefix when the job is deleted."
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

    @pydantic.model_validator(mode="after")
    def _check(self) -> Self:
        if self.retention.remote is not None and self.upload is None:
            raise ValueError("retention.remote needs upload")
        if self.resume.uri is not None and self.upload is None:
            raise ValueError("resume.uri needs upload (its endpoint and credentials are used)")
        return self


class RestartPolicy(_Model):
    """Gang restarts: a failed rank fails the attempt; preemptions are free."""

    model_config = pydantic.ConfigDict(
        json_schema_extra=cel(
            (
                "!has(self.maxBackoffSeconds) || !has(self.backoffSeconds) "
                "|| self.maxBackoffSeconds >= self.backoffSeconds",
                "maxBackoffSeconds must be >= backoffSeconds",
            ),
        )
    )

    max_restarts: int = pydantic.Field(default=3, ge=0, le=10000)
    backoff_seconds: int = pydantic.Field(default=10, ge=0, le=86400)
    max_backoff_seconds: int = pydantic.Field(default=300, ge=0, le=86400)
    retryable_exit_codes: list[ExitCode] | None = pydantic.Field(
        default=None,
        max_length=255,
        description="Exit codes that restart the job; unset: every non-zero code.",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )

    @pydantic.model_validator(mode="after")
    def _check(self) -> Self:
        if self.max_backoff_seconds < self.backoff_seconds:
            raise ValueError("maxBackoffSeconds must be >= backoffSeconds")
        return self


class CleanupPolicy(_Model):
    """What happens to terminated pods (their logs live with them)."""

    finished_pods: FinishedPods = pydantic.Field(
        default="Keep",
        description="Keep: pods of the last failed and the final attempt stay for logs.",
    )


RUN_DEFINING_FIELDS: tuple[str, ...] = (
    "nodes",
    "procsPerNode",
    "image",
    "command",
    "args",
    "env",
    "resources",
    "template",
    "checkpoint",
)
"""Spec fields that shape the running pods: immutable unless suspended."""

_SUSPENDED = "(has(self.suspend) && self.suspend) || (has(oldSelf.suspend) && oldSelf.suspend)"


def _immutable_while_running(field: str) -> tuple[str, str, str]:
    same = (
        f"has(self.{field}) == has(oldSelf.{field}) && "
        f"(!has(self.{field}) || self.{field} == oldSelf.{field})"
    )
    return (
        f"{_SUSPENDED} || ({same})",
        f"spec.{field} can only change while the job is suspended",
        f".{field}",
    )


class TrainingJobSpec(_Model):
    """The desired training run."""

    model_config = pydantic.ConfigDict(
        json_schema_extra=cel(
            (
                "has(self.managedBy) == has(oldSelf.managedBy) && "
                "(!has(self.managedBy) || self.managedBy == oldSelf.managedBy)",
                "spec.managedBy is immutable",
                ".managedBy",
            ),
            *(_immutable_while_running(f) for f in RUN_DEFINING_FIELDS),
        )
    )

    suspend: bool = False
    managed_by: str | None = pydantic.Field(
        default=None,
        max_length=63,
        description=f"Another controller's name; unset or {CONTROLLER_NAME} means Cairn.",
    )
    nodes: int = pydantic.Field(default=1, ge=1, le=1024, description="Pods, one per node rank.")
    procs_per_node: int = pydantic.Field(default=1, ge=1, le=64, description="--nproc-per-node.")
    image: str = pydantic.Field(min_length=1, max_length=512)
    command: list[Arg] | None = pydantic.Field(default=None, max_length=64)
    args: list[Arg] | None = pydantic.Field(default=None, max_length=256)
    env: list[EnvVar] | None = pydantic.Field(
        default=None,
        max_length=128,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    resources: ResourceRequirements | None = None
    template: PodTemplateOverlay | None = None
    checkpoint: CheckpointSpec = pydantic.Field(
        default_factory=CheckpointSpec, json_schema_extra=object_default(CheckpointSpec)
    )
    restart_policy: RestartPolicy = pydantic.Field(
        default_factory=RestartPolicy, json_schema_extra=object_default(RestartPolicy)
    )
    active_deadline_seconds: int | None = pydantic.Field(default=None, ge=1)
    cleanup: CleanupPolicy = pydantic.Field(
        default_factory=CleanupPolicy, json_schema_extra=object_default(CleanupPolicy)
    )

    @pydantic.field_validator("env")
    @classmethod
    def _env_unique(cls, value: list[EnvVar] | None) -> list[EnvVar] | None:
        names = [e.name for e in value or ()]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate env names: {', '.join(dupes)}")
        return value

    @property
    def managed_by_cairn(self) -> bool:
        return self.managed_by in (None, CONTROLLER_NAME)


# --------------------------------------------------------------- the object


class ObjectMeta(pydantic.BaseModel):
    """The few metadata fields the operator reads."""

    model_config = pydantic.ConfigDict(
        alias_generator=alias_generators.to_camel,
        populate_by_name=True,
        extra="ignore",
        frozen=True,
    )

    name: str
    namespace: str = "default"
    uid: str = ""
    generation: int = 0
    creation_timestamp: datetime.datetime | None = None
    deletion_timestamp: datetime.datetime | None = None
    labels: dict[str, str] | None = None


class TrainingJob(pydantic.BaseModel):
    """The whole object as the operator reads it."""

    model_config = pydantic.ConfigDict(
        alias_generator=alias_generators.to_camel,
        populate_by_name=True,
        extra="ignore",
        frozen=True,
    )

    api_version: Literal["cairn.dev/v1alpha1"] = "cairn.dev/v1alpha1"
    kind: Literal["TrainingJob"] = "TrainingJob"
    metadata: ObjectMeta
    spec: TrainingJobSpec
    status: jobstatus.TrainingJobStatus = pydantic.Field(
        default_factory=jobstatus.TrainingJobStatus
    )

    @pydantic.field_validator("metadata")
    @classmethod
    def _name(cls, value: ObjectMeta) -> ObjectMeta:
        if len(value.name) > MAX_NAME_LENGTH:
            raise ValueError(f"metadata.name must be at most {MAX_NAME_LENGTH} characters")
        _matches(NAME_PATTERN, value.name, "metadata.name")
        return value


ROOT_RULES = cel(
    (
        f"size(self.metadata.name) <= {MAX_NAME_LENGTH}",
        f"metadata.name must be at most {MAX_NAME_LENGTH} characters "
        "(pod hostnames <name>-a<attempt>-n<rank> are DNS labels)",
    ),
    (
        f"self.metadata.name.matches('{NAME_PATTERN}')",
        "metadata.name must be a DNS-1035 label (it names the headless Service)",
    ),
)
"""Rules on the whole object (CEL may read metadata.name there)."""


def update_errors(*, old: TrainingJobSpec, new: TrainingJobSpec) -> list[str]:
    """Pure twin of the spec's transition rules: messages for a forbidden update."""
    errors: list[str] = []
    if old.managed_by != new.managed_by:
        errors.append("spec.managedBy is immutable")
    if old.suspend or new.suspend:
        return errors
    old_wire = old.model_dump(by_alias=True, exclude_none=True)
    new_wire = new.model_dump(by_alias=True, exclude_none=True)
    for field in RUN_DEFINING_FIELDS:
        if old_wire.get(field) != new_wire.get(field):
            errors.append(f"spec.{field} can only change while the job is suspended")
    return errors


# The status models live in cairn.api.jobstatus; these names keep
# ``trainingjob.<Name>`` working for callers that see the object as a whole.
Phase = jobstatus.Phase
PHASES = jobstatus.PHASES
TERMINAL_PHASES = jobstatus.TERMINAL_PHASES
Condition = jobstatus.Condition
CommittedCheckpoint = jobstatus.CommittedCheckpoint
UploadedCheckpoint = jobstatus.UploadedCheckpoint
InFlightCheckpoint = jobstatus.InFlightCheckpoint
CheckpointRecord = jobstatus.CheckpointRecord
ResumedFrom = jobstatus.ResumedFrom
CheckpointsStatus = jobstatus.CheckpointsStatus
LastFailure = jobstatus.LastFailure
TrainingJobStatus = jobstatus.TrainingJobStatus
HISTORY_LIMIT = jobstatus.HISTORY_LIMIT
