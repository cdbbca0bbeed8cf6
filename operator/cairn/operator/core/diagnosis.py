"""Why an attempt does not start or ended: pure classifiers of what was observed.

Pure: ``jobobserve`` values in, reasons and messages (``conditions``) out.
``judge`` names an attempt's root cause (a counted eviction the pod caused
itself, a free preemption, a configuration error, the first rank that
failed; runtime ray: never a worker that only echoes the head's failure);
``lifecycle`` and ``restartpolicy`` decide what to do about it.
``create_problem``/``pod_problem`` say what the ``PodsNotStarting`` and
``NameConflict`` conditions say.
"""

import datetime

from cairn.api import exitcodes, trainingjob
from cairn.operator.core import conditions as cond
from cairn.operator.core import decisions, jobobserve

OWN_USAGE_EVICTION_MARKERS: tuple[str, ...] = (
    "exceeds the limit",  # Usage of EmptyDir volume "x" exceeds the limit "1Gi".
    "exceeds the total limit",  # Pod ephemeral local storage usage exceeds the total limit…
    "exceeded its local ephemeral storage limit",  # Container x exceeded its local…
    "was using",  # node pressure: Container x was using 5Gi, request is 1Gi…
)
"""Phrases of the kubelet's eviction messages that blame the pod's own usage."""


def own_eviction(pod: jobobserve.ObservedPod) -> bool:
    """Pure: the kubelet evicted the pod for what the pod itself used."""
    return pod.pod_reason == "Evicted" and any(
        marker in pod.pod_message for marker in OWN_USAGE_EVICTION_MARKERS
    )


def lost(pod: jobobserve.ObservedPod) -> str | None:
    """Why a rank was taken away by someone else (a preemption), if it was."""
    if pod.disruption_reason is not None:
        return pod.disruption_reason
    if pod.phase == "Failed" and pod.pod_reason == "Evicted":
        return f"Evicted: {pod.pod_message}".rstrip(": ")
    if pod.phase == "Unknown":
        return "pod phase Unknown"
    if pod.deleting and not pod.terminated:
        return "pod deleted"
    return None


def create_problem(
    errors: tuple[jobobserve.CreateError, ...],
) -> tuple[tuple[str, str] | None, str | None]:
    """(PodsNotStarting reason and message, NameConflict message) from failed creates."""
    conflict = next((e for e in errors if e.conflict), None)
    refused = next((e for e in errors if not e.conflict), None)
    not_starting = None
    if refused is not None:
        not_starting = (
            cond.REASON_FAILED_CREATE,
            cond.MSG_CREATE_FAILED.format(
                kind=refused.kind, name=refused.name, message=refused.message
            ),
        )
    name_conflict = None
    if conflict is not None:
        name_conflict = cond.MSG_NAME_CONFLICT.format(kind=conflict.kind, name=conflict.name)
    return not_starting, name_conflict


def pod_problem(
    pods: tuple[jobobserve.ObservedPod, ...], *, attempt: int
) -> tuple[str, str] | None:
    """The first rank stuck before its trainer runs: (reason, message)."""
    for pod in sorted(pods, key=lambda p: p.rank):
        stuck = pod.not_starting
        if stuck is not None:
            reason, message = stuck
            return reason, cond.MSG_NOT_STARTING.format(
                attempt=attempt, rank=pod.rank, reason=reason, message=message
            )
    return None


def judge(
    job: trainingjob.TrainingJob,
    observed: jobobserve.Observed,
    base: decisions.Base,
    *,
    now: datetime.datetime,
) -> decisions.Failure | None:
    """The root cause if the current attempt has failed; None while it is healthy.

    In order: an eviction the pod caused itself (counted), a rank taken away
    (a free preemption), a rank gone while Running (the same), then the
    failed ranks (``_failed_rank``)."""
    pods = observed.pods_of(base.attempt)
    attempt = base.attempt
    for pod in pods:
        if own_eviction(pod):
            message = cond.MSG_EVICTED.format(
                attempt=attempt, rank=pod.rank, message=pod.pod_message
            )
            return _failure(attempt, now, cond.REASON_EVICTED, message, rank=pod.rank)
    for pod in pods:
        why = lost(pod)
        if why is not None:
            message = cond.MSG_PREEMPTED.format(attempt=attempt, rank=pod.rank, why=why)
            return _failure(
                attempt, now, cond.REASON_PREEMPTED, message, rank=pod.rank, counted=False
            )
    missing = sorted(set(range(job.spec.nodes)) - {p.rank for p in pods})
    if base.phase == "Running" and missing:
        why = "pod disappeared"
        message = cond.MSG_PREEMPTED.format(attempt=attempt, rank=missing[0], why=why)
        return _failure(
            attempt, now, cond.REASON_PREEMPTED, message, rank=missing[0], counted=False
        )
    failed = [p for p in pods if p.phase == "Failed"]
    if job.spec.runtime == "ray":
        failed = ray_root_candidates(failed, pods)
    return _failed_rank(failed, attempt=attempt, now=now) if failed else None


def _failure(
    attempt: int,
    now: datetime.datetime,
    reason: str,
    message: str,
    *,
    rank: int | None,
    counted: bool = True,
    exit_code: int | None = None,
) -> decisions.Failure:
    return decisions.Failure(
        attempt=attempt,
        time=now,
        reason=reason,
        message=message,
        rank=rank,
        exit_code=exit_code,
        counted=counted,
    )


def _failed_rank(
    failed: list[jobobserve.ObservedPod], *, attempt: int, now: datetime.datetime
) -> decisions.Failure:
    """A configuration error (exit 78: not counted, fails the job), else the
    rank that failed first."""
    config = next(
        (p for p in failed if exitcodes.is_config_error(p.exit_code, p.termination_message)),
        None,
    )
    if config is not None:
        # Deterministic: every rank would refuse the same configuration again.
        message = cond.MSG_CONFIG_ERROR.format(
            attempt=attempt,
            rank=config.rank,
            message=config.termination_message.strip() or cond.MSG_CONFIG_ERROR_DEFAULT,
        )
        return _failure(
            attempt,
            now,
            cond.REASON_CONFIG_ERROR,
            message,
            rank=config.rank,
            exit_code=config.exit_code,
            counted=False,
        )
    far = datetime.datetime.max.replace(tzinfo=datetime.UTC)
    root = min(failed, key=lambda p: (p.finished_at or far, p.rank))
    detail = f" ({root.termination_reason})" if root.termination_reason else ""
    if root.termination_message.strip():
        detail += f": {root.termination_message.strip()}"
    message = cond.MSG_RANK_FAILED.format(
        attempt=attempt, rank=root.rank, code=root.exit_code, detail=detail
    )
    return _failure(
        attempt, now, cond.REASON_RANK_FAILED, message, rank=root.rank, exit_code=root.exit_code
    )


def ray_follower(job: trainingjob.TrainingJob, pod: jobobserve.ObservedPod) -> bool:
    """A Ray worker that ended only because the head's driver failed: the
    attempt stays Running until the head (which stops Ray first) ends too."""
    return (
        job.spec.runtime == "ray"
        and pod.rank != 0
        and pod.phase == "Failed"
        and exitcodes.follows_head(pod.termination_message)
    )


def ray_root_candidates(
    failed: list[jobobserve.ObservedPod], pods: tuple[jobobserve.ObservedPod, ...]
) -> list[jobobserve.ObservedPod]:
    """Runtime ray: the failed pods that can be the root cause. A worker that
    only echoes the head's failed driver (``exitcodes.follows_head``) is not:
    while the head still runs (it stops Ray before it exits) the attempt has
    not failed yet, and once the head ended, the head is the cause."""
    own = [p for p in failed if not (p.rank != 0 and exitcodes.follows_head(p.termination_message))]
    if own or not failed:
        return own
    head_live = any(p.rank == 0 and not p.terminated for p in pods)
    return [] if head_live else failed


def ray_head_succeeded(
    job: trainingjob.TrainingJob, pods: tuple[jobobserve.ObservedPod, ...]
) -> bool:
    """Runtime ray: the head (rank 0) ran the driver and exits with its code, so
    its success is the job's, whatever a worker did after it (a worker that
    lost the head before it read the success flag exits non-zero)."""
    if job.spec.runtime != "ray":
        return False
    return any(p.rank == 0 and p.phase == "Succeeded" for p in pods)
