"""The operator's status patch: operator-owned fields and the conditions.

Pure: a ``decisions.Decision`` plus the job and the clock in, a JSON merge
patch of ``/status`` out. It never contains ``step`` or ``checkpoints``:
those belong to the writer on rank 0, and a merge patch leaves them alone.
Conditions are derived here and only here.
"""

import datetime

from cairn.api import jobstatus, trainingjob
from cairn.operator.core import clock, decisions, k8stypes, prefixplan
from cairn.operator.core import conditions as cond


def _failure(failure: decisions.Failure | None) -> k8stypes.LastFailureDict | None:
    if failure is None:
        return None
    out: k8stypes.LastFailureDict = {
        "attempt": failure.attempt,
        "time": clock.rfc3339_or_none(failure.time) or "",
        "reason": failure.reason,
        "message": failure.message,
        "counted": failure.counted,
    }
    if failure.rank is not None:
        out["rank"] = failure.rank
    if failure.exit_code is not None:
        out["exitCode"] = failure.exit_code
    if failure.backoff_seconds is not None:
        out["backoffSeconds"] = failure.backoff_seconds
    return out


def _problem_conditions(decision: decisions.Decision) -> list[cond.Desired]:
    """The abnormal-true conditions that say why a job does not move."""
    stuck = decision.not_starting
    failure = decision.failure
    stalled = (
        failure is not None
        and failure.reason == cond.REASON_PROGRESS_DEADLINE
        and failure.attempt == decision.attempt
    )
    return [
        cond.Desired(
            type=cond.PODS_NOT_STARTING,
            status=stuck is not None,
            reason=stuck[0] if stuck else cond.REASON_PODS_STARTED,
            message=stuck[1] if stuck else "",
        ),
        cond.Desired(
            type=cond.NAME_CONFLICT,
            status=decision.name_conflict is not None,
            reason=cond.REASON_NAME_CONFLICT if decision.name_conflict else cond.REASON_NO_CONFLICT,
            message=decision.name_conflict or "",
        ),
        cond.Desired(
            type=cond.PROGRESS_STALLED,
            status=stalled,
            reason=cond.REASON_PROGRESS_DEADLINE if stalled else cond.REASON_PROGRESSING,
            message=failure.message if stalled and failure else "",
        ),
    ]


def _progress(decision: decisions.Decision) -> k8stypes.ProgressDict | None:
    if decision.progress_time is None:
        return None
    out: k8stypes.ProgressDict = {"time": clock.rfc3339_or_none(decision.progress_time) or ""}
    if decision.progress_step is not None:
        out["step"] = decision.progress_step
    return out


def _checkpoint_conditions(
    job: trainingjob.TrainingJob, decision: decisions.Decision, now: datetime.datetime
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
        # Verified: only what the operator read back from S3 itself
        # (status.storage); a writer-asserted lastUploaded.verified is ignored.
        storage = job.status.storage
        verified = (
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
    if job.spec.checkpoint.upload is not None:
        out.append(_upload_failing(ckpts.upload_error))
        out.append(_retention_over_budget(ckpts.retention_over_budget))
        out.append(prefixplan.condition(job.status.storage))
    out.append(_stale_condition(decision))
    return out


def _stale_condition(decision: decisions.Decision) -> cond.Desired:
    """CheckpointStale from the staleness ``lifecycle`` measured (Running only):
    the one comparison is ``deadlines.Staleness.stale``."""
    staleness = decision.staleness if decision.phase == "Running" else None
    if staleness is not None and staleness.stale:
        since = clock.rfc3339(staleness.reference)
        message = cond.MSG_STALE.format(since=since, limit=staleness.limit)
        return cond.Desired(
            type=cond.CHECKPOINT_STALE, status=True, reason=cond.REASON_STALE, message=message
        )
    fresh = cond.REASON_FRESH if decision.phase == "Running" else cond.REASON_NOT_RUNNING
    return cond.Desired(type=cond.CHECKPOINT_STALE, status=False, reason=fresh, message="")


def _upload_failing(error: jobstatus.UploadError | None) -> cond.Desired:
    """UploadFailing from the writer's uploadError (the writer reports the fact)."""
    if error is None:
        return cond.Desired(type=cond.UPLOAD_FAILING, status=False, reason=cond.REASON_UPLOADS_OK)
    backlog = f"; waiting for upload: steps {error.backlog}" if error.backlog else ""
    retention = f"; {error.retention}" if error.retention else ""
    return cond.Desired(
        type=cond.UPLOAD_FAILING,
        status=True,
        reason=cond.REASON_UPLOAD_FAILING,
        message=f"upload of step {error.step} failed: {error.message}{backlog}{retention}",
    )


def _retention_over_budget(note: str | None) -> cond.Desired:
    """RetentionOverBudget from the writer's note: the backlog (a slow or failing
    store) keeps more local steps than retention allows; the volume fills."""
    if not note:
        return cond.Desired(
            type=cond.RETENTION_OVER_BUDGET,
            status=False,
            reason=cond.REASON_RETENTION_WITHIN_BUDGET,
        )
    return cond.Desired(
        type=cond.RETENTION_OVER_BUDGET,
        status=True,
        reason=cond.REASON_RETENTION_OVER_BUDGET,
        message=note,
    )


def desired_conditions(
    job: trainingjob.TrainingJob | None,
    decision: decisions.Decision,
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
    out += _problem_conditions(decision)
    if job is not None:
        out += _checkpoint_conditions(job, decision, now)
    return out


def patch(
    *,
    job: trainingjob.TrainingJob | None,
    metadata: trainingjob.ObjectMeta,
    previous: jobstatus.TrainingJobStatus,
    decision: decisions.Decision,
    now: datetime.datetime,
) -> k8stypes.StatusPatch:
    """The merge patch for /status (operator-owned fields only)."""
    out: k8stypes.StatusPatch = {
        "phase": decision.phase,
        "observedGeneration": metadata.generation,
        "attempt": decision.attempt,
        "restarts": decision.restarts,
        "restartsCountTowardsMax": decision.counted_restarts,
        "startTime": clock.rfc3339_or_none(decision.start_time),
        "attemptStartTime": clock.rfc3339_or_none(decision.attempt_start_time),
        "completionTime": clock.rfc3339_or_none(decision.completion_time),
        "lastFailure": _failure(decision.failure),
        "progress": _progress(decision),
        "conditions": cond.merge(
            previous=previous.conditions,
            desired=desired_conditions(job, decision, now),
            generation=metadata.generation,
            now=now,
        ),
    }
    if decision.pod_replacements is not None:
        out["podReplacements"] = [
            r.model_dump(mode="json", by_alias=True, exclude_none=True)
            for r in decision.pod_replacements
        ] or None
    elif previous.pod_replacements and decision.attempt != (previous.attempt or 0):
        out["podReplacements"] = None  # a new attempt: its pods are all new
    if decision.resume_applied is not None:
        out["resumeApplied"] = decision.resume_applied.model_dump(
            mode="json", by_alias=True, exclude_none=True
        )
    return out
