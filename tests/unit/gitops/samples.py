"""Sample TrainingJob objects, one per phase, with the status the operator writes.

Test data, not tests. Each object's status is produced by the operator's own
pure code (``status.patch`` from a ``decisions.Decision``), plus the writer's
checkpoint facts, so the GitOps health tests judge what the operator really
writes rather than hand-written conditions.
"""

import dataclasses
import datetime
from typing import Any

from cairn.api import jobstatus, trainingjob
from cairn.operator.core import conditions as cond
from cairn.operator.core import decisions, status

T0 = datetime.datetime(2026, 11, 22, 12, 0, 0, tzinfo=datetime.UTC)
NOW = T0 + datetime.timedelta(minutes=30)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Sample:
    phase: jobstatus.Phase
    reason: str
    message: str


SAMPLES: dict[jobstatus.Phase, Sample] = {
    "Pending": Sample(phase="Pending", reason=cond.REASON_CREATED, message=cond.MSG_CREATED),
    "Starting": Sample(
        phase="Starting", reason=cond.REASON_PODS_STARTING, message="attempt 1: 1/2 pod(s) running"
    ),
    "Running": Sample(
        phase="Running", reason=cond.REASON_RUNNING, message="attempt 1: all 2 pod(s) running"
    ),
    "Restarting": Sample(
        phase="Restarting",
        reason=cond.REASON_BACKOFF,
        message="attempt 1: rank 1 exited with code 1; attempt 2 starts in 10s",
    ),
    "Suspending": Sample(
        phase="Suspending",
        reason=cond.REASON_SUSPENDING,
        message="waiting for 2 pod(s) to write a final checkpoint and stop",
    ),
    "Suspended": Sample(
        phase="Suspended", reason=cond.REASON_SUSPENDED, message=cond.MSG_SUSPENDED
    ),
    "Succeeded": Sample(
        phase="Succeeded", reason=cond.REASON_SUCCEEDED, message="attempt 1: all 2 pod(s) succeeded"
    ),
    "Failed": Sample(
        phase="Failed",
        reason=cond.REASON_MAX_RESTARTS,
        message="rank 1 exited with code 1; 4 counted restart(s) exceed maxRestarts=3",
    ),
}


def _drop_none(value: Any) -> Any:
    """What a JSON merge patch leaves in the object: null fields removed."""
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


def _base(generation: int) -> dict[str, Any]:
    return {
        "apiVersion": trainingjob.API_VERSION,
        "kind": trainingjob.KIND,
        "metadata": {"name": "demo", "namespace": "ml", "uid": "uid-1", "generation": generation},
        "spec": {
            "image": "cairn-trainer:dev",
            "nodes": 2,
            "checkpoint": {"upload": {"uri": "s3://bucket/demo"}},
        },
    }


WRITER_FACTS: dict[str, Any] = {
    "step": 120,
    "checkpoints": {
        "lastCommitted": {"step": 100, "time": "2026-11-22T12:20:00Z", "bytes": 1024},
        "lastUploaded": {
            "step": 100,
            "uri": "s3://bucket/demo/step-000000100",
            "time": "2026-11-22T12:21:00Z",
            "verified": True,
        },
    },
}


def job_object(
    phase: jobstatus.Phase, *, generation: int = 1, observed_generation: int | None = None
) -> dict[str, Any]:
    """The whole object as the API would return it after the operator's patch.

    ``observed_generation`` lower than ``generation`` simulates a spec edit the
    operator has not seen yet.
    """
    sample = SAMPLES[phase]
    seen = generation if observed_generation is None else observed_generation
    raw = _base(seen)
    raw["status"] = dict(WRITER_FACTS)
    job = trainingjob.TrainingJob.model_validate(raw)
    running = phase not in ("Pending", "Suspended")
    decision = decisions.Decision(
        phase=phase,
        reason=sample.reason,
        message=sample.message,
        attempt=0 if phase == "Pending" else 1,
        restarts=4 if phase == "Failed" else (1 if phase == "Restarting" else 0),
        counted_restarts=4 if phase == "Failed" else (1 if phase == "Restarting" else 0),
        start_time=T0 if running else None,
        attempt_start_time=T0 if running else None,
        completion_time=NOW if phase in jobstatus.TERMINAL_PHASES else None,
        failure=None,
    )
    patch = status.patch(
        job=job, metadata=job.metadata, previous=job.status, decision=decision, now=NOW
    )
    out = _base(generation)
    out["status"] = {**WRITER_FACTS, **_drop_none(dict(patch))}
    return out


def fresh_object() -> dict[str, Any]:
    """Just applied: the operator has not written any status yet."""
    return _base(1)
