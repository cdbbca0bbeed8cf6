"""Shared builders of test TrainingJobs and observed pods (test data, not tests)."""

import datetime
from typing import Any

from cairn.api import trainingjob
from cairn.operator.core import jobobserve, jobplan

T0 = datetime.datetime(2026, 11, 22, 12, 0, 0, tzinfo=datetime.UTC)
JOB_UID = "uid-1"


def at(seconds: float) -> datetime.datetime:
    return T0 + datetime.timedelta(seconds=seconds)


def body(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "cairn.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "demo", "namespace": "ml", "uid": JOB_UID, "generation": 1},
        "spec": {"image": "cairn-trainer:dev", "nodes": 2, **spec},
    }


def patched(job: trainingjob.TrainingJob, result: jobplan.Plan) -> trainingjob.TrainingJob:
    """What the API server holds after effects applied the plan's status merge patch."""
    raw: dict[str, Any] = job.model_dump(mode="json", by_alias=True, exclude_none=True)
    status = raw.setdefault("status", {})
    for key, value in (result.status or {}).items():
        if value is None:
            status.pop(key, None)
        else:
            status[key] = value
    return trainingjob.TrainingJob.model_validate(raw)


def job(status: dict[str, Any] | None = None, **spec: Any) -> trainingjob.TrainingJob:
    raw = body(**spec)
    if status is not None:
        raw["status"] = status
    return trainingjob.TrainingJob.model_validate(raw)


def pod(
    attempt: int,
    rank: int,
    phase: jobobserve.PodPhase = "Running",
    **fields: Any,
) -> jobobserve.ObservedPod:
    """One of the job's own pods: the name the operator gives it and the job
    (``body``'s uid) as its controller ownerReference, as ``builders.pod`` makes it."""
    fields.setdefault("controller_uid", JOB_UID)
    return jobobserve.ObservedPod(
        name=f"demo-a{attempt}-n{rank}",
        uid=f"pod-{attempt}-{rank}",
        attempt=attempt,
        rank=rank,
        phase=phase,
        **fields,
    )
