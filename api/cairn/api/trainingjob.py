"""The TrainingJob API (cairn.dev/v1alpha1): one source of truth.

Pure: pydantic v2 models of the object and its spec; ``spec.checkpoint``
lives in ``cairn.api.checkpointspec``, the status in ``cairn.api.jobstatus``,
shared schema helpers in ``cairn.api.schema``. ``cairn.api.crdgen``
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
from typing import Annotated, Any, Literal, Self

import pydantic
from pydantic import alias_generators

from cairn.api import checkpointspec, jobstatus, schema

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


FinishedPods = Literal["Keep", "Delete"]


# --------------------------------------------------------------------- spec


class EnvVar(schema.SpecModel):
    """One environment variable of the trainer container (``CAIRN_*`` is reserved)."""

    model_config = pydantic.ConfigDict(
        json_schema_extra=schema.cel(
            (
                f"!self.name.startsWith('{RESERVED_ENV_PREFIX}')",
                f"env names starting with {RESERVED_ENV_PREFIX} are reserved for the operator",
                ".name",
            ),
            ("!(has(self.value) && has(self.valueFrom))", "set value or valueFrom, not both"),
        )
    )

    name: str = pydantic.Field(min_length=1, max_length=256, pattern=schema.ENV_NAME_PATTERN)
    value: str | None = pydantic.Field(default=None, max_length=32768)
    value_from: dict[str, Any] | None = pydantic.Field(
        default=None, description="A core/v1 EnvVarSource.", json_schema_extra=schema.PRESERVE
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


ExitCode = Annotated[int, pydantic.Field(ge=1, le=255)]
Arg = Annotated[str, pydantic.Field(max_length=4096)]


class ResourceRequirements(schema.SpecModel):
    """Requests and limits of the trainer container (core/v1 quantities)."""

    requests: dict[str, schema.Quantity] | None = pydantic.Field(
        default=None, json_schema_extra={"maxProperties": 16}
    )
    limits: dict[str, schema.Quantity] | None = pydantic.Field(
        default=None, json_schema_extra={"maxProperties": 16}
    )


class ObjectMetaOverlay(schema.SpecModel):
    """Extra labels and annotations for every pod (e.g. Kueue, service mesh)."""

    labels: dict[str, str] | None = pydantic.Field(
        default=None, json_schema_extra={"maxProperties": 64}
    )
    annotations: dict[str, str] | None = pydantic.Field(
        default=None, json_schema_extra={"maxProperties": 64}
    )


class NamedObject(pydantic.BaseModel):
    """A core/v1 object with a name whose other fields pass through unchanged."""

    model_config = pydantic.ConfigDict(
        extra="allow", frozen=True, json_schema_extra=schema.PRESERVE
    )

    name: str = pydantic.Field(min_length=1, max_length=253)


class PodTemplateOverlay(schema.SpecModel):
    """What the user may add to every pod; the operator owns the rest."""

    model_config = pydantic.ConfigDict(
        json_schema_extra=schema.cel(
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
        json_schema_extra={"items": {"type": "object", **schema.PRESERVE}},
    )
    affinity: dict[str, Any] | None = pydantic.Field(
        default=None, description="A core/v1 Affinity.", json_schema_extra=schema.PRESERVE
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


class RestartPolicy(schema.SpecModel):
    """Gang restarts: a failed rank fails the attempt; preemptions are free."""

    model_config = pydantic.ConfigDict(
        json_schema_extra=schema.cel(
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


class CleanupPolicy(schema.SpecModel):
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


class TrainingJobSpec(schema.SpecModel):
    """The desired training run."""

    model_config = pydantic.ConfigDict(
        json_schema_extra=schema.cel(
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
    checkpoint: checkpointspec.CheckpointSpec = pydantic.Field(
        default_factory=checkpointspec.CheckpointSpec,
        json_schema_extra=schema.object_default(checkpointspec.CheckpointSpec),
    )
    restart_policy: RestartPolicy = pydantic.Field(
        default_factory=RestartPolicy, json_schema_extra=schema.object_default(RestartPolicy)
    )
    active_deadline_seconds: int | None = pydantic.Field(default=None, ge=1)
    cleanup: CleanupPolicy = pydantic.Field(
        default_factory=CleanupPolicy, json_schema_extra=schema.object_default(CleanupPolicy)
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
        schema.matches(schema.NAME_PATTERN, value.name, "metadata.name")
        return value


ROOT_RULES = schema.cel(
    (
        f"size(self.metadata.name) <= {MAX_NAME_LENGTH}",
        f"metadata.name must be at most {MAX_NAME_LENGTH} characters "
        "(pod hostnames <name>-a<attempt>-n<rank> are DNS labels)",
    ),
    (
        f"self.metadata.name.matches('{schema.NAME_PATTERN}')",
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
