"""Why an attempt does not start or ended: pure classifiers of what was observed.

Pure: ``observe`` values in, reasons and messages (``conditions``) out.
``lifecycle`` decides what to do about them: whether a lost rank is a free
preemption or a counted eviction the pod caused itself, what the
``PodsNotStarting`` and ``NameConflict`` conditions say.
"""

from cairn.operator import conditions as cond
from cairn.operator import observe

OWN_USAGE_EVICTION_MARKERS: tuple[str, ...] = (
    "exceeds the limit",  # Usage of EmptyDir volume "x" exceeds the limit "1Gi".
    "exceeds the total limit",  # Pod ephemeral local storage usage exceeds the total limit…
    "exceeded its local ephemeral storage limit",  # Container x exceeded its local…
    "was using",  # node pressure: Container x was using 5Gi, request is 1Gi…
)
"""Phrases of the kubelet's eviction messages that blame the pod's own usage."""


def own_eviction(pod: observe.ObservedPod) -> bool:
    """Pure: the kubelet evicted the pod for what the pod itself used."""
    return pod.pod_reason == "Evicted" and any(
        marker in pod.pod_message for marker in OWN_USAGE_EVICTION_MARKERS
    )


def lost(pod: observe.ObservedPod) -> str | None:
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
    errors: tuple[observe.CreateError, ...],
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


def pod_problem(pods: tuple[observe.ObservedPod, ...], *, attempt: int) -> tuple[str, str] | None:
    """The first rank stuck before its trainer runs: (reason, message)."""
    for pod in sorted(pods, key=lambda p: p.rank):
        stuck = pod.not_starting
        if stuck is not None:
            reason, message = stuck
            return reason, cond.MSG_NOT_STARTING.format(
                attempt=attempt, rank=pod.rank, reason=reason, message=message
            )
    return None
