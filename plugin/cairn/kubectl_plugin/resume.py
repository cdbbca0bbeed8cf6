"""``kubectl cairn resume JOB --from-step N``: when it applies, and the patches it sends.

Pure: the job (as the API returns it) in, a refusal or JSON merge patches out.

The operator applies an explicit ``spec.checkpoint.resume`` once per request
(``status.resumeApplied``; see ``cairn.operator.core.resumeplan``); a request is
the target plus the ``cairn.dev/resume-request`` annotation, which this
command sets to a new value every time, so asking for the same step twice
works. The command refuses (exit 1, the reason on stderr) instead of
patching when the request cannot take effect:

- the job is Succeeded or Failed: a finished job never starts again;
- the step is not a committed checkpoint the status knows of (history,
  lastCommitted, lastUploaded, or the operator's S3 listing) or the operator
  found it corrupt: the trainer would stop the attempt with a configuration
  error instead.

Only ``metadata.annotations``, ``spec.suspend`` and ``spec.checkpoint.resume``
are sent (a GitOps controller's other fields are untouched), guarded by the
``resourceVersion`` that was checked, so a job that changed in between is
refused by the API server (409) rather than patched blind.
"""

import datetime
from typing import Any

from cairn.api import checkpointspec, jobstatus

FINISHED = frozenset({"Succeeded", "Failed"})
GOOD_STATES = frozenset({"committed", "uploaded", "verified"})
UNSUSPEND: dict[str, Any] = {"spec": {"suspend": False}}


def known_steps(status: jobstatus.TrainingJobStatus) -> frozenset[int]:
    """Committed steps the job's status knows of, minus those found corrupt."""
    ckpts = status.checkpoints or jobstatus.CheckpointsStatus()
    storage = status.storage or jobstatus.StorageStatus()
    steps = {r.step for r in ckpts.history or () if r.state in GOOD_STATES}
    steps |= set(storage.remote_steps or ())
    for newest in (ckpts.last_committed, ckpts.last_uploaded):
        if newest is not None:
            steps.add(newest.step)
    corrupt = set(storage.corrupt_steps or ())
    corrupt |= {r.step for r in ckpts.history or () if r.state == "corrupt"}
    return frozenset(steps - corrupt)


def refusal(*, name: str, job: dict[str, Any], step: int) -> str | None:
    """Why ``resume --from-step step`` cannot do what it says (None: it can)."""
    status = jobstatus.TrainingJobStatus.model_validate(job.get("status") or {})
    if status.phase in FINISHED:
        return (
            f"trainingjob {name} is {status.phase}: a finished job does not start again;"
            " create a new job with spec.checkpoint.resume"
        )
    known = known_steps(status)
    if step not in known:
        listed = ", ".join(str(s) for s in sorted(known)[-10:]) or "none"
        return (
            f"step {step} is not a committed checkpoint of trainingjob {name}"
            f" (known: {listed}); see kubectl cairn checkpoints {name}"
        )
    return None


def request_id(now: datetime.datetime) -> str:
    """A new ``cairn.dev/resume-request`` value: the time of the request."""
    return now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def edit_patch(
    *, step: int, request: str, resource_version: str, suspend: bool | None
) -> dict[str, Any]:
    """The merge patch that sets the target (``suspend``: None leaves it)."""
    spec: dict[str, Any] = {
        # One-of: the other forms nulled; sha256 pinned the old target, not this step.
        "checkpoint": {
            "resume": {"step": step, "latest": None, "none": None, "uri": None, "sha256": None}
        }
    }
    if suspend is not None:
        spec["suspend"] = suspend
    return {
        "metadata": {
            "resourceVersion": resource_version,
            "annotations": {checkpointspec.RESUME_REQUEST_ANNOTATION: request},
        },
        "spec": spec,
    }


def suspended_at(job: dict[str, Any], *, generation: int) -> bool:
    """The operator has acted on ``generation`` (or later) and the job is Suspended."""
    status = job.get("status") or {}
    return (
        status.get("phase") == "Suspended" and (status.get("observedGeneration") or 0) >= generation
    )
