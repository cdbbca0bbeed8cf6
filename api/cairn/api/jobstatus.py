"""TrainingJob status models: what the operator and the writer on rank 0 report.

Pure. ``TrainingJobStatus`` is the shape of ``/status``; the CRD's status
schema is generated from it (``cairn.api.crdgen``). Ownership: the operator
writes phase, attempt, restarts, times, lastFailure, conditions and
``storage`` (what it verified and deleted in S3); the writer on rank 0 writes
``step`` and ``checkpoints`` with its own field manager, and neither side
writes the other's fields. Models ignore unknown fields, so an
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

    type: str = pydantic.Field(max_length=316)
    status: ConditionStatus
    observed_generation: int | None = pydantic.Field(default=None, ge=0)
    last_transition_time: datetime.datetime
    reason: str = pydantic.Field(max_length=1024)
    message: str = pydantic.Field(default="", max_length=32768)


class CommittedCheckpoint(_StatusModel):
    step: int = pydantic.Field(ge=0)
    time: datetime.datetime | None = None
    bytes: int | None = pydantic.Field(default=None, ge=0, json_schema_extra={"format": "int64"})
    write_seconds: float | None = pydantic.Field(default=None, ge=0)
    stall_seconds: float | None = pydantic.Field(default=None, ge=0)


class UploadedCheckpoint(_StatusModel):
    step: int = pydantic.Field(ge=0)
    uri: str | None = pydantic.Field(default=None, max_length=1024)
    time: datetime.datetime | None = None
    bytes: int | None = pydantic.Field(default=None, ge=0, json_schema_extra={"format": "int64"})
    verified: bool = False


class InFlightCheckpoint(_StatusModel):
    step: int = pydantic.Field(ge=0)
    stage: InFlightStage
    since: datetime.datetime | None = None


class CheckpointRecord(_StatusModel):
    step: int = pydantic.Field(ge=0)
    state: CheckpointState
    time: datetime.datetime | None = None
    bytes: int | None = pydantic.Field(default=None, ge=0, json_schema_extra={"format": "int64"})
    uri: str | None = pydantic.Field(default=None, max_length=1024)
    message: str | None = pydantic.Field(default=None, max_length=1024)


class ResumedFrom(_StatusModel):
    step: int = pydantic.Field(ge=0)
    attempt: int | None = pydantic.Field(default=None, ge=1)
    source: Literal["local", "remote"] | None = None
    uri: str | None = pydantic.Field(default=None, max_length=1024)
    fell_back_from: int | None = pydantic.Field(
        default=None, ge=0, description="A newer step that failed verification."
    )


HISTORY_LIMIT = 32


class CheckpointsStatus(_StatusModel):
    """Facts reported by the writer on rank 0 (the operator never writes these)."""

    last_committed: CommittedCheckpoint | None = None
    last_uploaded: UploadedCheckpoint | None = None
    in_flight: list[InFlightCheckpoint] | None = pydantic.Field(default=None, max_length=8)
    history: list[CheckpointRecord] | None = pydantic.Field(default=None, max_length=HISTORY_LIMIT)
    resumed_from: ResumedFrom | None = None


class LastFailure(_StatusModel):
    """Why the most recent attempt ended (operator-owned)."""

    attempt: int = pydantic.Field(ge=1)
    time: datetime.datetime
    reason: str = pydantic.Field(max_length=128)
    message: str = pydantic.Field(default="", max_length=4096)
    rank: int | None = pydantic.Field(default=None, ge=0)
    exit_code: int | None = None
    counted: bool = True


REMOTE_STEPS_LIMIT = 256


class StorageStatus(_StatusModel):
    """What the operator learned from the job's S3 prefix (operator-owned).

    The writer's ``checkpoints.lastUploaded.verified`` stays false: the writer
    cannot verify its own upload; the operator reads the objects back.
    """

    verified_step: int | None = pydantic.Field(
        default=None, ge=0, description="Newest step whose objects match its manifest."
    )
    verified_time: datetime.datetime | None = None
    verified_by: Literal["crc32c", "size"] | None = pydantic.Field(
        default=None,
        description="crc32c: the store's full-object CRC32C matched; size: sizes only.",
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
    last_retention_time: datetime.datetime | None = None
    last_error: str | None = pydantic.Field(default=None, max_length=1024)


class TrainingJobStatus(_StatusModel):
    """Observed state. Operator: phase, attempt, restarts, times, conditions, storage.
    Writer (rank 0): step, checkpoints."""

    phase: Phase | None = None
    observed_generation: int | None = pydantic.Field(default=None, ge=0)
    attempt: int | None = pydantic.Field(default=None, ge=0)
    restarts: int | None = pydantic.Field(default=None, ge=0)
    restarts_count_towards_max: int | None = pydantic.Field(default=None, ge=0)
    start_time: datetime.datetime | None = None
    attempt_start_time: datetime.datetime | None = None
    completion_time: datetime.datetime | None = None
    last_failure: LastFailure | None = None
    step: int | None = pydantic.Field(default=None, ge=0)
    checkpoints: CheckpointsStatus | None = None
    storage: StorageStatus | None = None
    conditions: list[Condition] | None = pydantic.Field(
        default=None,
        max_length=32,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
