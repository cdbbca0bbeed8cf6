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
(``TrainingJob.model_validate``) -> ``cairn.operator.core.jobplan``; the writer on
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
RAY_VOLUME_NAME = "cairn-ray"
"""Runtime ray: the pod's emptyDir for Ray's temp dir (reserved like the checkpoint volume)."""
OWNED_VOLUME_NAMES = ("cairn-memory", "cairn-manifest-key", "cairn-ray-token")
"""The operator's other pod volumes (memory tier, manifest key, Ray token): a
user volume of the same name would make every pod of the job fail to create."""


FinishedPods = Literal["Keep", "Delete"]
Runtime = Literal["torchrun", "ray"]
RAY_MIN_OBJECT_STORE_BYTES = 75 * 1024 * 1024
"""``ray start`` refuses a smaller ``--object-store-memory``."""
RAY_VERSION_PATTERN = r"^[0-9]+[.][0-9]+[.][0-9]+([-.+a-zA-Z0-9]*)?$"

DEFAULT_STARTUP_DEADLINE_SECONDS = 600
DEFAULT_MAX_PREEMPTIONS = 20
DEFAULT_BACKOFF_RESET_SECONDS = 600
MANAGED_BY_PATTERN = (
    "^[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
    "/[-A-Za-z0-9_.]+(/[-A-Za-z0-9_.]+)*$"
)
"""A domain-prefixed path such as ``kueue.x-k8s.io/multikueue`` (as JobSet's managedBy)."""


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

    name: str = pydantic.Field(
        min_length=1,
        max_length=256,
        pattern=schema.ENV_NAME_PATTERN,
        description=f"Variable name; {RESERVED_ENV_PREFIX}* is reserved for the operator.",
    )
    value: str | None = pydantic.Field(
        default=None, max_length=32768, description="Literal value ($(VAR) expands)."
    )
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


def _quantities_rule(what: str) -> dict[str, Any]:
    return {
        "maxProperties": 16,
        **schema.cel(
            (
                f"self.all(k, {schema.quantity_rule('self[k]')})",
                f"{what} must be non-negative quantities such as 500m, 2 or 4Gi",
            )
        ),
    }


def _check_quantities(
    values: dict[str, schema.Quantity] | None, what: str
) -> dict[str, schema.Quantity] | None:
    for key, value in (values or {}).items():
        schema.check_quantity(value, f"{what}.{key}")
    return values


class ResourceRequirements(schema.SpecModel):
    """Requests and limits of the trainer container (core/v1 quantities)."""

    requests: dict[str, schema.Quantity] | None = pydantic.Field(
        default=None,
        description="Minimum resources per pod, e.g. cpu: 500m, memory: 4Gi.",
        json_schema_extra=_quantities_rule("requests"),
    )
    limits: dict[str, schema.Quantity] | None = pydantic.Field(
        default=None,
        description="Maximum resources per pod, e.g. memory: 8Gi, nvidia.com/gpu: 8.",
        json_schema_extra=_quantities_rule("limits"),
    )

    @pydantic.field_validator("requests", "limits")
    @classmethod
    def _quantities(
        cls, value: dict[str, schema.Quantity] | None, info: pydantic.ValidationInfo
    ) -> dict[str, schema.Quantity] | None:
        return _check_quantities(value, str(info.field_name))


class ObjectMetaOverlay(schema.SpecModel):
    """Extra labels and annotations for every pod (e.g. Kueue, service mesh)."""

    labels: dict[str, str] | None = pydantic.Field(
        default=None,
        description="Labels added to every pod (Cairn's own labels win).",
        json_schema_extra={"maxProperties": 64},
    )
    annotations: dict[str, str] | None = pydantic.Field(
        default=None,
        description="Annotations added to every pod.",
        json_schema_extra={"maxProperties": 64},
    )


class NamedObject(pydantic.BaseModel):
    """A core/v1 object with a name whose other fields pass through unchanged."""

    model_config = pydantic.ConfigDict(
        extra="allow", frozen=True, json_schema_extra=schema.PRESERVE
    )

    name: str = pydantic.Field(min_length=1, max_length=253, description="The object's name.")


def _opaque_list(description: str, max_items: int = 64) -> Any:
    """A list of core/v1 objects passed through to the pod unchanged."""
    return pydantic.Field(
        default=None,
        max_length=max_items,
        description=description,
        json_schema_extra={"items": {"type": "object", **schema.PRESERVE}},
    )


def _opaque(description: str) -> Any:
    """One core/v1 object passed through unchanged (the API server validates it
    against the core schema when the pod is created)."""
    return pydantic.Field(default=None, description=description, json_schema_extra=schema.PRESERVE)


class PodTemplateOverlay(schema.SpecModel):
    """What the user may add to every pod; the operator owns the rest."""

    model_config = pydantic.ConfigDict(
        json_schema_extra=schema.cel(
            (
                f"!has(self.volumes) || self.volumes.all(v, v.name != '{CHECKPOINT_VOLUME_NAME}')",
                f"the volume name {CHECKPOINT_VOLUME_NAME} is reserved",
                ".volumes",
            ),
            (
                f"!has(self.volumes) || self.volumes.all(v, v.name != '{RAY_VOLUME_NAME}')",
                f"the volume name {RAY_VOLUME_NAME} is reserved",
                ".volumes",
            ),
            (
                "!has(self.volumes) || self.volumes.all(v, !(v.name in "
                f"{list(OWNED_VOLUME_NAMES)}))",
                f"the volume names {', '.join(OWNED_VOLUME_NAMES)} are reserved",
                ".volumes",
            ),
        )
    )

    metadata: ObjectMetaOverlay | None = pydantic.Field(
        default=None, description="Labels and annotations for every pod."
    )
    node_selector: dict[str, str] | None = pydantic.Field(
        default=None,
        description="Node labels every pod requires.",
        json_schema_extra={"maxProperties": 64},
    )
    tolerations: list[dict[str, Any]] | None = _opaque_list("core/v1 Tolerations.")
    affinity: dict[str, Any] | None = _opaque("A core/v1 Affinity.")
    topology_spread_constraints: list[dict[str, Any]] | None = _opaque_list(
        "core/v1 TopologySpreadConstraints (select the pods with cairn.dev/job-name).", 16
    )
    priority_class_name: str | None = pydantic.Field(
        default=None, max_length=253, description="The pods' PriorityClass."
    )
    scheduler_name: str | None = pydantic.Field(
        default=None, max_length=253, description="The scheduler that places the pods."
    )
    runtime_class_name: str | None = pydantic.Field(
        default=None, max_length=253, description="The pods' RuntimeClass (e.g. nvidia, gvisor)."
    )
    scheduling_gates: list[dict[str, Any]] | None = _opaque_list(
        "core/v1 PodSchedulingGates: the pods stay unscheduled until a controller removes them.",
        16,
    )
    service_account_name: str | None = pydantic.Field(
        default=None,
        max_length=253,
        pattern=schema.SUBDOMAIN_PATTERN,
        description="Run the pods as this ServiceAccount instead of <job>-trainer "
        "(the operator binds its status-writer Role to it).",
    )
    security_context: dict[str, Any] | None = _opaque(
        "core/v1 PodSecurityContext, merged key by key over the restricted defaults "
        "(runAsNonRoot: true, seccompProfile RuntimeDefault)."
    )
    container_security_context: dict[str, Any] | None = _opaque(
        "core/v1 SecurityContext of the trainer container, merged key by key over the "
        "restricted defaults (allowPrivilegeEscalation: false, capabilities drop ALL)."
    )
    env_from: list[dict[str, Any]] | None = _opaque_list(
        "core/v1 EnvFromSources of the trainer container (Secrets, ConfigMaps).", 16
    )
    init_containers: list[NamedObject] | None = pydantic.Field(
        default=None, max_length=16, description="core/v1 Containers run before the trainer."
    )
    sidecars: list[NamedObject] | None = pydantic.Field(
        default=None,
        max_length=16,
        description="core/v1 Containers run beside the trainer for the pod's lifetime "
        "(native sidecars: init containers with restartPolicy Always).",
    )
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
        if any(v.name == RAY_VOLUME_NAME for v in self.volumes or ()):
            raise ValueError(f"the volume name {RAY_VOLUME_NAME} is reserved")
        if any(v.name in OWNED_VOLUME_NAMES for v in self.volumes or ()):
            raise ValueError(f"the volume names {', '.join(OWNED_VOLUME_NAMES)} are reserved")
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

    max_restarts: int = pydantic.Field(
        default=3,
        ge=0,
        le=10000,
        description="Counted restarts (rank failures, own evictions, deadlines) before Failed.",
    )
    max_preemptions: int = pydantic.Field(
        default=DEFAULT_MAX_PREEMPTIONS,
        ge=0,
        le=10000,
        description="Restarts caused by others (evictions, node loss, deleted pods) before "
        "Failed; they do not count against maxRestarts.",
    )
    backoff_seconds: int = pydantic.Field(
        default=10, ge=0, le=86400, description="Wait before the first restart; doubles after."
    )
    max_backoff_seconds: int = pydantic.Field(
        default=300, ge=0, le=86400, description="Cap of the doubling backoff."
    )
    backoff_reset_seconds: int = pydantic.Field(
        default=DEFAULT_BACKOFF_RESET_SECONDS,
        ge=1,
        le=604800,
        description="An attempt that ran this long before it failed resets the backoff to "
        "backoffSeconds.",
    )
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


class RaySpec(schema.SpecModel):
    """Runtime ``ray``: how each pod starts its Ray node (``ray start``)."""

    version: str | None = pydantic.Field(
        default=None,
        max_length=64,
        pattern=RAY_VERSION_PATTERN,
        description="The Ray version the job needs, e.g. 2.60.0: a pod whose ray differs "
        "exits 78 (ConfigurationError) before it starts Ray. Unset: not checked.",
    )
    num_cpus: int | None = pydantic.Field(
        default=None, ge=0, le=4096, description="CPUs per node for Ray (ray start --num-cpus)."
    )
    num_gpus: int | None = pydantic.Field(
        default=None, ge=0, le=64, description="GPUs per node for Ray (ray start --num-gpus)."
    )
    object_store_memory_bytes: int | None = pydantic.Field(
        default=None,
        ge=RAY_MIN_OBJECT_STORE_BYTES,
        description="Object store size per node (ray start --object-store-memory).",
    )
    max_in_place_restarts: int = pydantic.Field(
        default=3,
        ge=0,
        le=1000,
        description="In-place restarts (a new rank-actor group in the same pods) per attempt "
        "before the driver gives up and the operator restarts the pods.",
    )
    dashboard: bool = pydantic.Field(
        default=False,
        description="Run the Ray dashboard on the head (port 8265), bound to the pod's IP "
        "and behind the job's Ray token. Off by default.",
    )


MAX_IN_PLACE_NODES = 10
"""torchrun's c10d rendezvous ranks nodes by host name; pod names keep that
equal to the node rank up to here (``-n10`` sorts before ``-n2``)."""

IN_PLACE_RESUME_MESSAGE = (
    "torchrun.maxInPlaceRestarts needs checkpoint.resume unset or latest (a worker group "
    "restarted in place cannot tell on every node that an explicit target was spent)"
)


class TorchrunSpec(schema.SpecModel):
    """Runtime ``torchrun``: its elastic agent's in-place restarts (docs/operator.md)."""

    max_in_place_restarts: int = pydantic.Field(
        default=0,
        ge=0,
        le=1000,
        description="In-place restarts per attempt: when a rank process dies, every pod's "
        "torchrun restarts its workers in the same pods (--max-restarts) before the pod "
        "exits and the operator restarts the pods. 0: every failure restarts the pods.",
    )


RUN_DEFINING_FIELDS: tuple[str, ...] = (
    "runtime",
    "ray",
    "torchrun",
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

_IS_RAY = "(has(self.runtime) && self.runtime == 'ray')"
_IS_TORCHRUN = "(!has(self.runtime) || self.runtime == 'torchrun')"
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
            (
                f"!has(self.ray) || {_IS_RAY}",
                "spec.ray is allowed only with runtime: ray",
                ".ray",
            ),
            (
                f"!has(self.torchrun) || {_IS_TORCHRUN}",
                "spec.torchrun is allowed only with runtime: torchrun",
                ".torchrun",
            ),
            (
                "!has(self.torchrun) || !has(self.torchrun.maxInPlaceRestarts) || "
                f"self.torchrun.maxInPlaceRestarts == 0 || !has(self.nodes) || "
                f"self.nodes <= {MAX_IN_PLACE_NODES}",
                f"torchrun.maxInPlaceRestarts needs nodes <= {MAX_IN_PLACE_NODES} (c10d "
                "rendezvous orders nodes by host name: <job>-a<attempt>-n10 sorts before -n2)",
                ".torchrun",
            ),
            (
                "!has(self.torchrun) || !has(self.torchrun.maxInPlaceRestarts) || "
                "self.torchrun.maxInPlaceRestarts == 0 || !has(self.checkpoint) || "
                "!has(self.checkpoint.resume) || has(self.checkpoint.resume.latest)",
                IN_PLACE_RESUME_MESSAGE,
                ".torchrun",
            ),
            (
                # The memory tier's tmpfs counts against the container's memory limit.
                "!has(self.checkpoint) || !has(self.checkpoint.memory) || "
                "!self.checkpoint.memory.enabled || !has(self.checkpoint.memory.sizeLimit) || "
                "!has(self.resources) || !has(self.resources.limits) || "
                "!('memory' in self.resources.limits) || "
                "quantity(string(self.checkpoint.memory.sizeLimit))"
                ".isLessThan(quantity(string(self.resources.limits['memory'])))",
                checkpointspec.MEMORY_OVER_LIMIT,
                ".checkpoint.memory.sizeLimit",
            ),
            (
                f"!({_IS_RAY}) || has(self.command)",
                "runtime: ray needs spec.command (the operator runs it under the Ray launcher)",
                ".command",
            ),
        )
    )

    suspend: bool = pydantic.Field(
        default=False,
        description="true: write a final checkpoint and stop the pods; false again resumes.",
    )
    managed_by: str | None = pydantic.Field(
        default=None,
        max_length=63,
        pattern=MANAGED_BY_PATTERN,
        description="The controller that reconciles this job, a domain-prefixed path; "
        f"unset or {CONTROLLER_NAME} means Cairn. Immutable.",
    )
    runtime: Runtime = pydantic.Field(
        default="torchrun",
        description="torchrun: the command runs in every pod. ray: rank 0 is a Ray head, "
        "the other pods Ray workers, and the command is the driver run on the head.",
    )
    ray: RaySpec | None = pydantic.Field(
        default=None, description="Runtime ray: the Ray nodes' settings."
    )
    torchrun: TorchrunSpec | None = pydantic.Field(
        default=None, description="Runtime torchrun: its elastic agent's settings."
    )
    nodes: int = pydantic.Field(default=1, ge=1, le=1024, description="Pods, one per node rank.")
    procs_per_node: int = pydantic.Field(default=1, ge=1, le=64, description="--nproc-per-node.")
    image: str = pydantic.Field(
        min_length=1, max_length=512, description="The trainer container's image."
    )
    command: list[Arg] | None = pydantic.Field(
        default=None, max_length=64, description="Entrypoint; unset: the image's."
    )
    args: list[Arg] | None = pydantic.Field(
        default=None, max_length=256, description="Arguments to the entrypoint."
    )
    env: list[EnvVar] | None = pydantic.Field(
        default=None,
        max_length=128,
        description="Extra environment variables of the trainer container.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    resources: ResourceRequirements | None = pydantic.Field(
        default=None, description="Requests and limits of each pod's trainer container."
    )
    template: PodTemplateOverlay | None = pydantic.Field(
        default=None, description="What to add to every pod (scheduling, security, volumes)."
    )
    checkpoint: checkpointspec.CheckpointSpec = pydantic.Field(
        default_factory=checkpointspec.CheckpointSpec,
        description="How and where the trainer checkpoints, and what it resumes from.",
        json_schema_extra=schema.object_default(checkpointspec.CheckpointSpec),
    )
    restart_policy: RestartPolicy = pydantic.Field(
        default_factory=RestartPolicy,
        description="Gang restarts: budgets and backoff.",
        json_schema_extra=schema.object_default(RestartPolicy),
    )
    active_deadline_seconds: int | None = pydantic.Field(
        default=None, ge=1, description="Failed after running this long (restarts on resume)."
    )
    ttl_seconds_after_finished: int | None = pydantic.Field(
        default=None,
        ge=0,
        le=31536000,
        description="Delete the job this long after it Succeeded or Failed (its pods, "
        "Events and metrics go with it; onDelete still applies). Unset: kept.",
    )
    startup_deadline_seconds: int = pydantic.Field(
        default=DEFAULT_STARTUP_DEADLINE_SECONDS,
        ge=1,
        le=86400,
        description="An attempt whose pods are not all running this long after it started "
        "ends as a counted failure (StartupDeadlineExceeded).",
    )
    progress_deadline_seconds: int | None = pydantic.Field(
        default=None,
        ge=1,
        le=604800,
        description="While Running, no new status.step for this long: the ProgressStalled "
        "condition and a counted restart. Unset: not checked.",
    )
    cleanup: CleanupPolicy = pydantic.Field(
        default_factory=CleanupPolicy,
        description="What happens to terminated pods.",
        json_schema_extra=schema.object_default(CleanupPolicy),
    )

    @pydantic.field_validator("env")
    @classmethod
    def _env_unique(cls, value: list[EnvVar] | None) -> list[EnvVar] | None:
        names = [e.name for e in value or ()]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate env names: {', '.join(dupes)}")
        return value

    @pydantic.model_validator(mode="after")
    def _check_runtime(self) -> Self:
        if self.ray is not None and self.runtime != "ray":
            raise ValueError("spec.ray is allowed only with runtime: ray")
        if self.torchrun is not None and self.runtime != "torchrun":
            raise ValueError("spec.torchrun is allowed only with runtime: torchrun")
        in_place = self.torchrun is not None and self.torchrun.max_in_place_restarts > 0
        resume = self.checkpoint.resume
        if in_place and resume is not None and not resume.latest:
            raise ValueError(IN_PLACE_RESUME_MESSAGE)
        if in_place and self.nodes > MAX_IN_PLACE_NODES:
            raise ValueError(
                f"torchrun.maxInPlaceRestarts needs nodes <= {MAX_IN_PLACE_NODES} (c10d "
                "rendezvous orders nodes by host name: <job>-a<attempt>-n10 sorts before -n2)"
            )
        if not _memory_fits(self):
            raise ValueError(checkpointspec.MEMORY_OVER_LIMIT)
        if self.runtime == "ray" and self.command is None:
            raise ValueError(
                "runtime: ray needs spec.command (the operator runs it under the Ray launcher)"
            )
        return self

    @property
    def ray_settings(self) -> RaySpec:
        """``spec.ray`` or its defaults (meaningful for runtime ray only)."""
        return self.ray or RaySpec()

    @property
    def torchrun_settings(self) -> TorchrunSpec:
        """``spec.torchrun`` or its defaults (meaningful for runtime torchrun only)."""
        return self.torchrun or TorchrunSpec()

    @property
    def managed_by_cairn(self) -> bool:
        return self.managed_by in (None, CONTROLLER_NAME)


def _memory_fits(spec: TrainingJobSpec) -> bool:
    """Pure twin of the CEL rule: the memory tier fits under the memory limit."""
    memory = spec.checkpoint.memory
    limits = spec.resources.limits if spec.resources is not None else None
    if not memory.enabled or memory.size_limit is None or not limits or "memory" not in limits:
        return True
    size = checkpointspec.quantity_value(memory.size_limit)
    return size < checkpointspec.quantity_value(limits["memory"])


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
    annotations: dict[str, str] | None = None


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
RayStatus = jobstatus.RayStatus
TorchrunStatus = jobstatus.TorchrunStatus
CommittedCheckpoint = jobstatus.CommittedCheckpoint
UploadedCheckpoint = jobstatus.UploadedCheckpoint
InFlightCheckpoint = jobstatus.InFlightCheckpoint
CheckpointRecord = jobstatus.CheckpointRecord
ResumedFrom = jobstatus.ResumedFrom
CheckpointsStatus = jobstatus.CheckpointsStatus
LastFailure = jobstatus.LastFailure
TrainingJobStatus = jobstatus.TrainingJobStatus
HISTORY_LIMIT = jobstatus.HISTORY_LIMIT
