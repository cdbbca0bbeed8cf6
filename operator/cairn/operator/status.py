"""The operator's status patch: operator-owned fields and the conditions.

Pure: a ``lifecycle.Decision`` plus the job and the clock in, a JSON merge
patch of ``/status`` out. It never contains ``step`` or ``checkpoints``:
those belong to the writer on rank 0, and a merge patch leaves them alone.
Conditions are derived here and only here.
"""

import datetime

from cairn.api import jobstatus, trainingjob
from cairn.operator import conditions as cond
from cairn.operator import k8stypes, lifecycle


def _time(value: datetime.datetime | None) -> str | None:
    if value is None:
        return None
    return value.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _failure(failure: lifecycle.Failure | None) -> k8stypes.LastFailureDict | None:
    if failure is None:
        return None
    out: k8stypes.LastFailureDict = {
        "attempt": failure.attempt,
        "time": _time(failure.time) or "",
        "reason": failure.reason,
        "message": failure.message,
        "counted": failure.counted,
    }
    if failure.rank is not None:
        out["rank"] = failure.rank
    if failure.exit_code is not None:
        out["exitCode"] = failure.exit_code
    return out


def _checkpoint_conditions(
    job: trainingjob.TrainingJob, decision: lifecycle.Decision, now: datetime.datetime
) -> list[cond.Desired]:
    ckpts = job.status.checkpoints or jobstatus.CheckpointsStatus()
    committed = ckpts.last_committed
    uploaded = ckpts.last_uploaded
    out = [
        cond.Desired(
            type=cond.CHECKPOINT_COMMITTED,
            status=committed is not None,
            reason=cond.REASON_COMMITTED if committed else cond.REASON_NO_CHECKPOINT,
            message=cond.MSG_COMMITTED.format(step=committed.step) if committed else "",
        )
    ]
    if job.spec.checkpoint.upload is None:
        out.append(
            cond.Desired(
                type=cond.CHECKPOINT_UPLOADED, status=False, reason=cond.REASON_UPLOAD_DISABLED
            )
        )
    elif uploaded is None:
        out.append(
            cond.Desired(
                type=cond.CHECKPOINT_UPLOADED, status=False, reason=cond.REASON_NOT_UPLOADED
            )
        )
    else:
        # Verified: the operator read the step back from S3 (status.storage);
        # the writer's own flag is honoured too.
        storage = job.status.storage
        verified = uploaded.verified or (
            storage is not None
            and storage.verified_step is not None
            and storage.verified_step >= uploaded.step
        )
        out.append(
            cond.Desired(
                type=cond.CHECKPOINT_UPLOADED,
                status=True,
                reason=cond.REASON_VERIFIED if verified else cond.REASON_UPLOADED,
                message=cond.MSG_UPLOADED.format(step=uploaded.step, uri=uploaded.uri or ""),
            )
        )
    stale = False
    message = ""
    reference = lifecycle.stale_reference(job)
    if decision.phase == "Running" and reference is not None:
        limit = lifecycle.stale_after_seconds(job.spec.checkpoint)
        age = int((now - reference).total_seconds())
        if age >= limit:
            stale = True
            message = cond.MSG_STALE.format(seconds=age, limit=limit)
    out.append(
        cond.Desired(
            type=cond.CHECKPOINT_STALE,
            status=stale,
            reason=cond.REASON_STALE
            if stale
            else (cond.REASON_FRESH if decision.phase == "Running" else cond.REASON_NOT_RUNNING),
            message=message,
        )
    )
    return out


def desired_conditions(
    job: trainingjob.TrainingJob | None,
    decision: lifecycle.Decision,
    now: datetime.datetime,
) -> list[cond.Desired]:
    """All conditions for a decision (``job`` is None for an invalid spec)."""
    phase = decision.phase
    why = decision.reason
    msg = decision.message
    out = [
        cond.Desired(type=cond.READY, status=phase == "Running", reason=why, message=msg),
        cond.Desired(
            type=cond.COMPLETE,
            status=phase == "Succeeded",
            reason=why if phase == "Succeeded" else cond.REASON_NOT_FINISHED,
            message=msg if phase == "Succeeded" else "",
        ),
        cond.Desired(
            type=cond.FAILED,
            status=phase == "Failed",
            reason=why if phase == "Failed" else cond.REASON_NOT_FAILED,
            message=msg if phase == "Failed" else "",
        ),
        cond.Desired(
            type=cond.SUSPENDED,
            status=phase == "Suspended",
            reason=why if phase in ("Suspended", "Suspending") else cond.REASON_NOT_SUSPENDED,
            message=msg if phase in ("Suspended", "Suspending") else "",
        ),
        cond.Desired(
            type=cond.RECONCILING,
            status=phase in ("Pending", "Starting", "Restarting", "Suspending"),
            reason=why,
            message=msg,
        ),
        cond.Desired(
            type=cond.STALLED,
            status=phase == "Failed",
            reason=why if phase == "Failed" else cond.REASON_NOT_FAILED,
            message=msg if phase == "Failed" else "",
        ),
    ]
    if job is not None:
        out += _checkpoint_conditions(job, decision, now)
    return out


def patch(
    *,
    job: trainingjob.TrainingJob | None,
    metadata: trainingjob.ObjectMeta,
    previous: jobstatus.TrainingJobStatus,
    decision: lifecycle.Decision,
    now: datetime.datetime,
) -> k8stypes.StatusPatch:
    """The merge patch for /status (operator-owned fields only)."""
    return {
        "phase": decision.phase,
        "observedGeneration": metadata.generation,
        "attempt": decision.attempt,
        "restarts": decision.restarts,
        "restartsCountTowardsMax": decision.counted_restarts,
        "startTime": _time(decision.start_time),
        "attemptStartTime": _time(decision.attempt_start_time),
        "completionTime": _time(decision.completion_time),
        "lastFailure": _failure(decision.failure),
        "conditions": cond.merge(
            previous=previous.conditions,
            desired=desired_conditions(job, decision, now),
            generation=metadata.generation,
            now=now,
        ),
    }
