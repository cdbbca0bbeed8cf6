"""Runtime ray: the operator's two duties in ``status.ray`` and its Event.

Pure. The Ray driver on the head pod owns ``status.ray`` (``group``,
``inPlaceRestarts``, ``lastInPlaceRestart``: it bumps them before it starts a
new rank-actor group in the same pods). The operator

- sets ``status.ray.group = 0`` when it starts a new attempt (new pods, a new
  fencing generation: ``status.attempt`` and the group restart together);
- posts one ``InPlaceRestart`` Event when it sees ``inPlaceRestarts`` grow,
  and records what it announced in ``status.ray.announcedInPlaceRestarts``
  (in the same status patch that precedes the Event, like every other
  transition of ``plan``), so an operator restart does not announce twice.

Phase and conditions do not change: an in-place restart is invisible to the
lifecycle (the pods stay Running).
"""

from cairn.api import jobstatus, trainingjob
from cairn.operator.core import k8stypes

EVENT_REASON = "InPlaceRestart"


def _unannounced(status: jobstatus.TrainingJobStatus) -> int:
    """In-place restarts the driver reported and the operator has not announced."""
    ray = status.ray
    if ray is None or ray.in_place_restarts is None:
        return 0
    return max(ray.in_place_restarts - (ray.announced_in_place_restarts or 0), 0)


def patch(
    job: trainingjob.TrainingJob, *, attempt: int, new_attempt: bool
) -> k8stypes.RayStatusPatch | None:
    """The operator's keys of ``status.ray`` for this reconcile (None: nothing)."""
    if job.spec.runtime != "ray":
        return None
    out: k8stypes.RayStatusPatch = {}
    if new_attempt and attempt > 0:
        out["group"] = 0
    ray = job.status.ray
    if _unannounced(job.status) and ray is not None and ray.in_place_restarts is not None:
        out["announcedInPlaceRestarts"] = ray.in_place_restarts
    return out or None


def message(ray: jobstatus.RayStatus, *, unannounced: int) -> str:
    """For humans: which group, why, and from which step it restores."""
    last = ray.last_in_place_restart or jobstatus.InPlaceRestart()
    total = ray.in_place_restarts or 0
    count = (
        f"in-place restart {total}"
        if unannounced == 1
        else (f"in-place restarts {total - unannounced + 1}-{total}")
    )
    group = "?" if ray.group is None else str(ray.group)
    step = "no committed step" if last.from_step is None else f"step {last.from_step}"
    why = f": {last.reason}" if last.reason else ""
    return f"{count}, rank-actor group {group} restores from {step}{why}"


def events(job: trainingjob.TrainingJob) -> tuple[k8stypes.Event, ...]:
    """One Normal ``InPlaceRestart`` Event for every growth of ``inPlaceRestarts``
    the operator has not announced yet (several between two looks: one Event)."""
    ray = job.status.ray
    unannounced = _unannounced(job.status)
    if job.spec.runtime != "ray" or ray is None or not unannounced:
        return ()
    return (
        k8stypes.Event(
            type="Normal", reason=EVENT_REASON, message=message(ray, unannounced=unannounced)
        ),
    )
