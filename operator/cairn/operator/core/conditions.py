"""Condition types, reasons and messages, and how a new set replaces the old.

Pure. Every reason the operator writes is a named constant here, so docs,
events and tests refer to the same strings. ``merge`` keeps
``lastTransitionTime`` unless a condition's status actually changed, as
metav1.Condition asks.

kstatus (Flux, Argo CD, ``kubectl wait``) reads ``observedGeneration`` plus the
abnormal-true conditions ``Reconciling`` and ``Stalled``; the operator sets them
alongside the user-facing ones.
"""

import dataclasses
import datetime
from collections.abc import Iterable, Sequence

from cairn.api import exitcodes, jobstatus
from cairn.operator.core import clock, k8stypes

# --- types ---------------------------------------------------------------------
READY = "Ready"
CHECKPOINT_COMMITTED = "CheckpointCommitted"
CHECKPOINT_UPLOADED = "CheckpointUploaded"
CHECKPOINT_STALE = "CheckpointStale"
COMPLETE = "Complete"
FAILED = "Failed"
SUSPENDED = "Suspended"
RECONCILING = "Reconciling"
STALLED = "Stalled"
PODS_NOT_STARTING = "PodsNotStarting"
"""Abnormal-true: a child could not be created or a pod is stuck before its trainer runs."""
NAME_CONFLICT = "NameConflict"
"""Abnormal-true: an object this job does not own already has a child's name."""
STATUS_POLICY_MISSING = "StatusPolicyMissing"
"""Abnormal-true: the status ValidatingAdmissionPolicy or its binding is absent
(or not this operator's), so no pods start (``policygate``)."""
PROGRESS_STALLED = "ProgressStalled"
"""Abnormal-true: no new status.step for progressDeadlineSeconds; the attempt restarts."""
UPLOAD_FAILING = "UploadFailing"
"""Abnormal-true: uploads fail (upload.onFailure: Continue); steps wait in a backlog."""
STORAGE_REFUSED = "StorageRefused"
"""Abnormal-true: the operator does not verify, apply retention or delete under the
job's S3 prefix (owned by another job, or refused by its S3 settings; see
``prefixplan``). The S3 pass posts its Event."""
CLEANUP_FAILED = "CleanupFailed"
"""Abnormal-true, on a job being deleted: ``onDelete: Delete`` could not empty its
S3 prefix (``ondelete``; retried, then the finalizer goes and the objects stay)."""
RETENTION_OVER_BUDGET = "RetentionOverBudget"
"""Abnormal-true: local retention keeps steps past keepLast/maxBytes because they
are not uploaded yet (the writer's checkpoints.retentionOverBudget)."""
WARNING_CONDITIONS: frozenset[str] = frozenset(
    {PODS_NOT_STARTING, NAME_CONFLICT, PROGRESS_STALLED, UPLOAD_FAILING, RETENTION_OVER_BUDGET}
)
"""Conditions whose turning True (or a new reason/message) posts a Warning Event."""

TYPES: tuple[str, ...] = (
    READY,
    CHECKPOINT_COMMITTED,
    CHECKPOINT_UPLOADED,
    CHECKPOINT_STALE,
    UPLOAD_FAILING,
    RETENTION_OVER_BUDGET,
    COMPLETE,
    FAILED,
    SUSPENDED,
    RECONCILING,
    STALLED,
    PODS_NOT_STARTING,
    NAME_CONFLICT,
    PROGRESS_STALLED,
    STORAGE_REFUSED,
)

# --- reasons (also used as Event reasons) ------------------------------------
REASON_CREATED = "Created"
REASON_ATTEMPT_STARTED = "AttemptStarted"
REASON_PODS_STARTING = "PodsStarting"
REASON_RUNNING = "Running"
REASON_RANK_FAILED = "RankFailed"
REASON_PREEMPTED = "Preempted"
REASON_REPLACING_POD = "ReplacingPod"
REASON_BACKOFF = "BackoffWaiting"
REASON_TEARING_DOWN = "TearingDown"
REASON_SUSPENDING = "Suspending"
REASON_SUSPENDED = "Suspended"
REASON_RESUMED = "Resumed"
REASON_SUCCEEDED = "Succeeded"
REASON_NON_RETRYABLE = "NonRetryableExitCode"
REASON_MAX_RESTARTS = "MaxRestartsExceeded"
REASON_DEADLINE = "DeadlineExceeded"
REASON_INVALID_SPEC = "InvalidSpec"
REASON_STALE_STATUS = "StaleStatus"
REASON_NOT_SUSPENDED = "NotSuspended"
REASON_NOT_FINISHED = "NotFinished"
REASON_NOT_FAILED = "NotFailed"
REASON_COMMITTED = "Committed"
REASON_NO_CHECKPOINT = "NoCheckpointYet"
REASON_UPLOADED = "Uploaded"
REASON_VERIFIED = "Verified"
REASON_NOT_UPLOADED = "NotUploadedYet"
REASON_UPLOAD_DISABLED = "UploadDisabled"
REASON_UPLOAD_FAILING = "UploadFailing"
REASON_UPLOADS_OK = "NoUploadError"
REASON_RETENTION_OVER_BUDGET = "RetentionOverBudget"
REASON_RETENTION_WITHIN_BUDGET = "WithinBudget"
REASON_STALE = "NoRecentCommit"
REASON_FRESH = "RecentCommit"
REASON_NOT_RUNNING = "NotRunning"
REASON_FAILED_CREATE = "FailedCreate"
REASON_INVALID_POD_SPEC = "InvalidPodSpec"
REASON_NAME_CONFLICT = "NameConflict"
REASON_STATUS_POLICY_MISSING = "StatusPolicyMissing"
REASON_NO_CONFLICT = "NoConflict"
REASON_PODS_NOT_STARTING = "PodsNotStarting"
REASON_PODS_STARTED = "PodsStarted"
REASON_STARTUP_DEADLINE = "StartupDeadlineExceeded"
REASON_PROGRESS_DEADLINE = "ProgressDeadlineExceeded"
REASON_PROGRESSING = "Progressing"
REASON_MAX_PREEMPTIONS = "MaxPreemptionsExceeded"
REASON_EVICTED = "Evicted"
REASON_CLEANUP_RETRYING = "CleanupRetrying"
REASON_CLEANUP_EXHAUSTED = "CleanupAttemptsExhausted"
REASON_CONFIG_ERROR = exitcodes.CONFIG_ERROR_REASON

# --- message templates --------------------------------------------------------
MSG_ATTEMPT_STARTED = "attempt {attempt}: {nodes} pod(s) created, resuming from {resume}"
MSG_RESUME_EXPLICIT = " (spec.checkpoint.resume of generation {generation}, applied once)"
MSG_PODS_STARTING = "attempt {attempt}: {running}/{nodes} pod(s) running"
MSG_RUNNING = "attempt {attempt}: all {nodes} pod(s) running"
MSG_RANK_FAILED = "attempt {attempt}: rank {rank} exited with code {code}{detail}"
MSG_PREEMPTED = "attempt {attempt}: rank {rank} lost ({why}); not counted against maxRestarts"
MSG_REPLACING_POD = (
    "attempt {attempt}: replacing the pod of rank(s) {ranks} in place ({why}); the other "
    "pods keep running; {used} of maxInPlaceRestarts={budget} replacement(s) this attempt"
)
MSG_POD_LOST = (
    "attempt {attempt}: rank {rank} lost ({why}); its pod is replaced in place, the other "
    "pods keep running ({used} of maxInPlaceRestarts={budget} this attempt)"
)
MSG_REPLACEMENT_LATE = "its replacement did not run within {seconds}s"
MSG_BACKOFF = "{failure}; attempt {next} starts in {seconds}s"
MSG_TEARING_DOWN = "{failure}; waiting for {count} pod(s) of attempt {attempt} to stop"
MSG_SUSPENDING = "waiting for {count} pod(s) to write a final checkpoint and stop"
MSG_SUSPENDED = "suspended; no pods running"
MSG_NON_RETRYABLE = "{failure}, which is not in restartPolicy.retryableExitCodes"
MSG_MAX_RESTARTS = "{failure}; {counted} counted restart(s) exceed maxRestarts={limit}"
MSG_DEADLINE = "running for longer than activeDeadlineSeconds={seconds}"
MSG_SUCCEEDED = "attempt {attempt}: all {nodes} pod(s) succeeded"
MSG_INVALID_SPEC = "the spec passed the schema but not the operator's checks: {error}"
MSG_STALE_STATUS = "pods of attempt {attempt} exist but status.attempt is {known}; waiting"
MSG_CREATED = "waiting for the operator to start attempt 1"
MSG_COMMITTED = "step {step} committed"
MSG_UPLOADED = "step {step} uploaded to {uri}"
MSG_STALE = "no checkpoint committed since {since} (expected within {limit}s)"
"""No live age: the message stays equal between reconciles, so a stale job's
status is not rewritten every time (printer columns compute ages from times)."""
MSG_CREATE_FAILED = "{kind} {name} not created: {message}"
MSG_INVALID_POD_SPEC = "the API server refused {kind} {name}: {message}"
MSG_NAME_CONFLICT = (
    "{kind} {name} exists and is not owned by this job; rename or delete it (never adopted)"
)
MSG_NOT_STARTING = "attempt {attempt}: rank {rank} {reason}: {message}"
MSG_STARTUP_DEADLINE = (
    "attempt {attempt}: pods not all running {seconds}s after the attempt started "
    "(startupDeadlineSeconds){detail}"
)
MSG_PROGRESS_DEADLINE = (
    "attempt {attempt}: no new step for {seconds}s (progressDeadlineSeconds), last step {step}"
)
MSG_MAX_PREEMPTIONS = "{failure}; {count} preemption(s) exceed maxPreemptions={limit}"
MSG_EVICTED = "attempt {attempt}: rank {rank} evicted for its own usage: {message}"
MSG_CONFIG_ERROR = "attempt {attempt}: rank {rank} reported a configuration error: {message}"
MSG_CONFIG_ERROR_DEFAULT = "exit code 78 (no termination message)"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Desired:
    """A condition as the plan wants it, before times are attached."""

    type: str
    status: bool
    reason: str
    message: str = ""


def merge(
    *,
    previous: Sequence[jobstatus.Condition] | None,
    desired: Iterable[Desired],
    generation: int,
    now: datetime.datetime,
) -> list[k8stypes.ConditionDict]:
    """The new condition list; lastTransitionTime moves only on a status change."""
    old = {c.type: c for c in previous or ()}
    out: list[k8stypes.ConditionDict] = []
    for want in desired:
        status: k8stypes.ConditionDict = {
            "type": want.type,
            "status": "True" if want.status else "False",
            "observedGeneration": generation,
            "lastTransitionTime": clock.rfc3339(now),
            "reason": want.reason,
            "message": want.message,
        }
        before = old.get(want.type)
        if before is not None and before.status == status["status"]:
            status["lastTransitionTime"] = clock.rfc3339(before.last_transition_time)
        out.append(status)
    return out


def find(conditions: Sequence[jobstatus.Condition] | None, kind: str) -> jobstatus.Condition | None:
    return next((c for c in conditions or () if c.type == kind), None)
