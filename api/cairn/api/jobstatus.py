"""TrainingJob status models: what the operator and the writer on rank 0 report.

Pure. ``TrainingJobStatus`` is the shape of ``/status``; the CRD's status
schema is generated from it (``cairn.api.crdgen``). Ownership: the operator
writes phase, attempt, restarts, times, lastFailure, conditions and
``storage`` (what it verified and deleted in S3); the writer on rank 0 writes
``step`` and ``checkpoints`` with its own field manager, and neither side
writes the other's fields. ``ray`` (runtime ``ray`` only) is the driver's
(it runs on rank 0, the head pod), except ``ray.group``, which the operator
sets to 0 when it starts a new attempt, and ``ray.announcedInPlaceRestarts``,
its record of the ``InPlaceRestart`` Events it posted. ``torchrun`` (runtime
``torchrun``) has the same shape and split: rank 0's writer bumps it after an
in-place restart of the worker group. Models ignore unknown fields, so an
older operator tolerates a newer writer.
"""

import datetime
from typing import Literal

import pydantic
from pydantic import alias_generators

Phase = Literal[
    "Pending",
    "Starting",
    "Running",
    "Restarting",
    "Suspending",
    "Suspended",
    "Succeeded",
    "Failed",
]
PHASES: tuple[Phase, ...] = (
    "Pending",
    "Starting",
    "Running",
    "Restarting",
    "Suspending",
    "Suspended",
    "Succeeded",
    "Failed",
)
TERMINAL_PHASES: frozenset[Phase] = frozenset({"Succeeded", "Failed"})

CheckpointState = Literal["committed", "uploaded", "verified", "rotated", "corrupt"]
InFlightStage = Literal["staging", "writing", "committing", "uploading"]
ConditionStatus = Literal["True", "False", "Unknown"]


class _StatusModel(pydantic.BaseModel):
    """Status models: camelCase, tolerant of fields from newer writers."""

    model_config = pydantic.ConfigDict(
        alias_generator=alias_generators.to_camel,
        populate_by_name=True,
        extra="ignore",
        frozen=True,
    )


class Condition(_StatusModel):
    """metav1.Condition."""

    type: str = pydantic.Field(max_length=316, description="e.g. Ready, Failed, PodsNotStarting.")
    status: ConditionStatus = pydantic.Field(description="True, False or Unknown.")
    observed_generation: int | None = pydantic.Field(
        default=None, ge=0, description="The spec generation the condition was computed for."
    )
    last_transition_time: datetime.datetime = pydantic.Field(
        description="When the status last changed."
    )
    reason: str = pydantic.Field(max_length=1024, description="CamelCase cause.")
    message: str = pydantic.Field(default="", max_length=32768, description="For humans.")


_STEP = "The training step."
_BYTES = "Size of the step's files."


class CommittedCheckpoint(_StatusModel):
    """The newest step whose manifest is written on the volume."""

    step: int = pydantic.Field(ge=0, description=_STEP)
    time: datetime.datetime | None = pydantic.Field(default=None, description="Commit time.")
    bytes: int | None = pydantic.Field(
        default=None, ge=0, description=_BYTES, json_schema_extra={"format": "int64"}
    )
    write_seconds: float | None = pydantic.Field(
        default=None, ge=0, description="Background write time."
    )
    stall_seconds: float | None = pydantic.Field(
        default=None, ge=0, description="Time training was blocked by the save."
    )


class UploadedCheckpoint(_StatusModel):
    """The newest step whose manifest is in S3."""

    step: int = pydantic.Field(ge=0, description=_STEP)
    uri: str | None = pydantic.Field(default=None, max_length=1024, description="Its S3 folder.")
    time: datetime.datetime | None = pydantic.Field(default=None, description="Upload time.")
    bytes: int | None = pydantic.Field(
        default=None, ge=0, description=_BYTES, json_schema_extra={"format": "int64"}
    )
    verified: bool = pydantic.Field(
        default=False, description="Writer's claim; the operator's check is storage.verifiedStep."
    )


class InFlightCheckpoint(_StatusModel):
    """A step still being saved."""

    step: int = pydantic.Field(ge=0, description=_STEP)
    stage: InFlightStage = pydantic.Field(description="staging, writing, committing, uploading.")
    since: datetime.datetime | None = pydantic.Field(default=None, description="Stage start.")


class CheckpointRecord(_StatusModel):
    """One step's place in the lifecycle."""

    step: int = pydantic.Field(ge=0, description=_STEP)
    state: CheckpointState = pydantic.Field(
        description="committed, uploaded, verified, rotated or corrupt."
    )
    time: datetime.datetime | None = pydantic.Field(default=None, description="State change.")
    bytes: int | None = pydantic.Field(
        default=None, ge=0, description=_BYTES, json_schema_extra={"format": "int64"}
    )
    uri: str | None = pydantic.Field(default=None, max_length=1024, description="S3 folder.")
    message: str | None = pydantic.Field(default=None, max_length=1024, description="Detail.")


class ResumedFrom(_StatusModel):
    """The step the current lineage was loaded from."""

    step: int = pydantic.Field(ge=0, description=_STEP)
    attempt: int | None = pydantic.Field(default=None, ge=1, description="The attempt that loaded.")
    source: Literal["local", "remote"] | None = pydantic.Field(
        default=None, description="local (volume or pod memory) or remote (S3)."
    )
    tier: Literal["memory", "peer", "local", "s3"] | None = pydantic.Field(
        default=None,
        description="Where the bytes came from: memory (every rank its own memory copy), "
        "peer (some rank its peer's replica), local (the volume) or s3.",
    )
    uri: str | None = pydantic.Field(default=None, max_length=1024, description="Where from.")
    fell_back_from: int | None = pydantic.Field(
        default=None, ge=0, description="A newer step that failed verification."
    )
    imported: bool | None = pydantic.Field(
        default=None,
        description="True: a checkpoint this job did not write (resume.uri, a plain DCP "
        "folder, another job's step), loaded by the documented key-mapping rule.",
    )


class UploadError(_StatusModel):
    """Uploads are failing; training goes on and the steps wait in a backlog."""

    message: str = pydantic.Field(max_length=1024, description="The last upload error.")
    time: datetime.datetime | None = pydantic.Field(default=None, description="When it failed.")
    step: int | None = pydantic.Field(default=None, ge=0, description="The step that failed.")
    backlog: list[int] | None = pydantic.Field(
        default=None,
        max_length=64,
        description="Committed steps waiting for upload (retried at later saves).",
    )
    retention: str | None = pydantic.Field(
        default=None,
        max_length=1024,
        description="Set when the backlog keeps more steps than local retention allows.",
    )


HISTORY_LIMIT = 32


class CheckpointsStatus(_StatusModel):
    """Facts reported by the writer on rank 0 (the operator never writes these)."""

    last_committed: CommittedCheckpoint | None = pydantic.Field(
        default=None, description="The newest committed step."
    )
    last_uploaded: UploadedCheckpoint | None = pydantic.Field(
        default=None, description="The newest uploaded step."
    )
    in_flight: list[InFlightCheckpoint] | None = pydantic.Field(
        default=None, max_length=8, description="Steps being saved."
    )
    history: list[CheckpointRecord] | None = pydantic.Field(
        default=None, max_length=HISTORY_LIMIT, description="Recent steps, newest last."
    )
    resumed_from: ResumedFrom | None = pydantic.Field(
        default=None, description="What this lineage resumed from."
    )
    upload_error: UploadError | None = pydantic.Field(
        default=None, description="Set while uploads fail (upload.onFailure: Continue)."
    )
    retention_over_budget: str | None = pydantic.Field(
        default=None,
        max_length=1024,
        description=(
            "Set while local retention keeps more steps than keepLast/maxBytes allow "
            "because they are not uploaded yet (a slow or failing store)."
        ),
    )


class LastFailure(_StatusModel):
    """Why the most recent attempt ended (operator-owned)."""

    attempt: int = pydantic.Field(ge=1, description="The attempt that ended.")
    time: datetime.datetime = pydantic.Field(description="When the operator saw it end.")
    reason: str = pydantic.Field(
        max_length=128, description="e.g. RankFailed, Preempted, ConfigurationError."
    )
    message: str = pydantic.Field(
        default="", max_length=4096, description="What happened (a rank's termination message)."
    )
    rank: int | None = pydantic.Field(default=None, ge=0, description="The root-cause rank.")
    exit_code: int | None = pydantic.Field(default=None, description="Its trainer's exit code.")
    counted: bool = pydantic.Field(
        default=True, description="Whether it counted against restartPolicy.maxRestarts."
    )
    backoff_seconds: int | None = pydantic.Field(
        default=None, ge=0, description="The wait before the next attempt."
    )


REMOTE_STEPS_LIMIT = 256


class PrefixClaimStatus(_StatusModel):
    """Whether the operator may work under the job's S3 prefix (operator-owned)."""

    owned: bool = pydantic.Field(
        description="true: the prefix's owner object names this job's UID; the operator "
        "verifies, applies retention and onDelete there. false: it does none of these."
    )
    reason: str = pydantic.Field(
        max_length=128,
        description="PrefixOwned, PrefixOwnedByAnotherJob, PrefixNested, "
        "OperatorIdentityNotAllowed, EndpointNotAllowed, EndpointAddressRefused, "
        "OwnerUnreadable or ClaimFailed.",
    )
    message: str = pydantic.Field(default="", max_length=1024, description="Why, for humans.")


class StorageStatus(_StatusModel):
    """What the operator learned from the job's S3 prefix (operator-owned).

    The writer's ``checkpoints.lastUploaded.verified`` stays false: the writer
    cannot verify its own upload; the operator reads the objects back.
    """

    verified_step: int | None = pydantic.Field(
        default=None, ge=0, description="Newest step whose objects match its manifest."
    )
    verified_time: datetime.datetime | None = pydantic.Field(
        default=None, description="When verifiedStep was last checked."
    )
    verified_by: Literal["crc32c", "size", "crc32c+hmac", "size+hmac"] | None = pydantic.Field(
        default=None,
        description="crc32c: the store's full-object CRC32C matched; size: sizes only; "
        "+hmac: and the manifest's signature verified with the job's key.",
    )
    remote_steps: list[int] | None = pydantic.Field(
        default=None,
        max_length=REMOTE_STEPS_LIMIT,
        description="Committed steps in S3 after retention, oldest first (newest if capped).",
    )
    corrupt_steps: list[int] | None = pydantic.Field(
        default=None,
        max_length=REMOTE_STEPS_LIMIT,
        description="Steps with a manifest whose objects do not match it.",
    )
    foreign_steps: list[int] | None = pydantic.Field(
        default=None,
        max_length=REMOTE_STEPS_LIMIT,
        description="Steps whose manifest is not this job's own (not signed with its key, "
        "or another job's): kept, never deleted, never loaded implicitly.",
    )
    last_retention_time: datetime.datetime | None = pydantic.Field(
        default=None, description="When remote retention last ran."
    )
    last_error: str | None = pydantic.Field(
        default=None, max_length=1024, description="The last S3 error, cleared on success."
    )
    claim: PrefixClaimStatus | None = pydantic.Field(
        default=None, description="Whether this job owns its S3 prefix (see docs/operator.md)."
    )


class Progress(_StatusModel):
    """When the operator last saw ``status.step`` change (operator-owned)."""

    step: int | None = pydantic.Field(default=None, ge=0, description="status.step then.")
    time: datetime.datetime = pydantic.Field(description="When it was first seen.")


class InPlaceRestart(_StatusModel):
    """The Ray driver's last in-place recovery (a new rank-actor group, same pods)."""

    time: datetime.datetime | None = pydantic.Field(default=None, description="When it began.")
    reason: str = pydantic.Field(
        default="", max_length=1024, description="Why the group was replaced (the dead actor)."
    )
    from_step: int | None = pydantic.Field(
        default=None, ge=0, description="The committed step the new group restores (null: none)."
    )


class RayStatus(_StatusModel):
    """Runtime ``ray``: the rank-actor group the driver on the head pod runs."""

    group: int | None = pydantic.Field(
        default=None,
        ge=0,
        description="Generation of the rank-actor group within the current attempt "
        "(the operator sets 0 on a new attempt; the driver bumps it before it starts a "
        "new group).",
    )
    in_place_restarts: int | None = pydantic.Field(
        default=None, ge=0, description="In-place restarts over the job's life (the driver's)."
    )
    last_in_place_restart: InPlaceRestart | None = pydantic.Field(
        default=None, description="The most recent in-place restart."
    )
    announced_in_place_restarts: int | None = pydantic.Field(
        default=None,
        ge=0,
        description="The operator's record: inPlaceRestarts it has posted an InPlaceRestart "
        "Event for.",
    )


class TorchrunStatus(RayStatus):
    """Runtime ``torchrun``: the worker group torchrun's elastic agents run, in the
    same vocabulary as ``ray``: rank 0 of a restarted group (``group`` is the
    generation every rank agreed on, ``cairn.checkpoint.torchrun_group.agreed``)
    bumps ``group`` and ``inPlaceRestarts`` before it commits; the operator resets ``group`` to 0 on a new attempt and posts the
    ``InPlaceRestart`` Event."""

    group: int | None = pydantic.Field(
        default=None,
        ge=0,
        description="The worker group's generation within the current attempt (agreed by "
        "every rank, never repeated, also after a pod was replaced; the operator sets 0 on a "
        "new attempt, rank 0 of a restarted group bumps it before it commits).",
    )
    in_place_restarts: int | None = pydantic.Field(
        default=None, ge=0, description="In-place restarts over the job's life (rank 0's)."
    )


class PodReplacement(_StatusModel):
    """Runtime torchrun or ray with in-place restarts: one lost pod the operator replaced
    within the attempt (operator-owned; docs/operator.md, "A lost pod replaced in
    place")."""

    rank: int = pydantic.Field(ge=0, description="The node rank whose pod was lost.")
    lost_pod_uid: str = pydantic.Field(
        default="",
        max_length=64,
        description="The lost pod's UID (empty: it was gone before the operator saw it).",
    )
    replacement_uid: str = pydantic.Field(
        default="",
        max_length=64,
        description="The replacement pod's UID, once seen (empty: not created or not seen yet).",
    )
    time: datetime.datetime = pydantic.Field(description="When the loss was seen.")
    reason: str = pydantic.Field(
        default="", max_length=1024, description="Why the pod was lost (deleted, evicted, …)."
    )


class ResumeApplied(_StatusModel):
    """The explicit ``spec.checkpoint.resume`` the operator handed to an attempt
    (operator-owned). A request applies once: attempts after ``attempt`` resume
    from the newest committed step, unless the request changes (another target,
    or a new ``cairn.dev/resume-request`` annotation)."""

    target: str = pydantic.Field(
        max_length=1100, description="The target as CAIRN_RESUME_FROM: step:<N>, none or s3://…"
    )
    request: str | None = pydantic.Field(
        default=None,
        max_length=128,
        description="The job's cairn.dev/resume-request annotation then (null: none).",
    )
    generation: int = pydantic.Field(ge=0, description="The spec generation it was read at.")
    attempt: int | None = pydantic.Field(
        default=None,
        ge=1,
        description="The first attempt that got it (null: applied before this record existed).",
    )
    time: datetime.datetime | None = pydantic.Field(
        default=None, description="When that attempt started."
    )


class TrainingJobStatus(_StatusModel):
    """Observed state. Operator: phase, attempt, restarts, times, conditions, storage.
    Writer (rank 0): step, checkpoints."""

    phase: Phase | None = pydantic.Field(
        default=None,
        description="Pending, Starting, Running, Restarting, Suspending, Suspended, "
        "Succeeded or Failed.",
    )
    observed_generation: int | None = pydantic.Field(
        default=None, ge=0, description="The spec generation the operator last acted on."
    )
    attempt: int | None = pydantic.Field(
        default=None, ge=0, description="The current gang attempt (1 for the first)."
    )
    restarts: int | None = pydantic.Field(default=None, ge=0, description="Restarts so far.")
    restarts_count_towards_max: int | None = pydantic.Field(
        default=None, ge=0, description="Restarts counted against restartPolicy.maxRestarts."
    )
    start_time: datetime.datetime | None = pydantic.Field(
        default=None, description="When the job (or its resume) started."
    )
    attempt_start_time: datetime.datetime | None = pydantic.Field(
        default=None, description="When the current attempt's pods were created."
    )
    completion_time: datetime.datetime | None = pydantic.Field(
        default=None, description="When the job Succeeded or Failed."
    )
    last_failure: LastFailure | None = pydantic.Field(
        default=None, description="Why the most recent attempt ended."
    )
    step: int | None = pydantic.Field(
        default=None, ge=0, description="The last training step rank 0 reported."
    )
    progress: Progress | None = pydantic.Field(
        default=None, description="When step last changed (progressDeadlineSeconds)."
    )
    checkpoints: CheckpointsStatus | None = pydantic.Field(
        default=None, description="Checkpoint facts reported by rank 0's writer."
    )
    storage: StorageStatus | None = pydantic.Field(
        default=None, description="What the operator verified and deleted in S3."
    )
    ray: RayStatus | None = pydantic.Field(
        default=None, description="Runtime ray: the driver's rank-actor group and its restarts."
    )
    torchrun: TorchrunStatus | None = pydantic.Field(
        default=None,
        description="Runtime torchrun: the worker group (torchrun's restart count) and its "
        "in-place restarts.",
    )
    resume_applied: ResumeApplied | None = pydantic.Field(
        default=None,
        description="The explicit spec.checkpoint.resume already handed to an attempt.",
    )
    pod_replacements: list[PodReplacement] | None = pydantic.Field(
        default=None,
        max_length=1000,
        description="Runtime torchrun or ray with maxInPlaceRestarts: the lost pods of the "
        "current attempt replaced in place (each one of maxInPlaceRestarts; cleared on a new "
        "attempt).",
    )
    conditions: list[Condition] | None = pydantic.Field(
        default=None,
        max_length=32,
        description="Ready, Complete, Failed, Suspended, PodsNotStarting, NameConflict, "
        "ProgressStalled, Checkpoint*, Reconciling, Stalled.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
