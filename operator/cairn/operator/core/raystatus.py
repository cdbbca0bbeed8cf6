"""In-place restarts: the operator's two duties in ``status.ray`` /
``status.torchrun`` and its Event (one vocabulary for both runtimes).

Pure. The Ray driver on the head pod owns ``status.ray`` (``group``,
``inPlaceRestarts``, ``lastInPlaceRestart``: it bumps them before it starts a
new rank-actor group in the same pods). The operator

- sets ``status.ray.group = 0`` when it starts a new attempt (new pods, a new
  fencing generation: ``status.attempt`` and the group restart together);
- posts one ``InPlaceRestart`` Event when it sees ``inPlaceRestarts`` grow,
  and records what it announced in ``status.ray.announcedInPlaceRestarts``
  (in the same status patch that precedes the Event, like every other
  transition of ``plan``), so an operator restart does not announce twice.

Runtime torchrun has the same split in ``status.torchrun``: rank 0 of a
worker group torchrun restarted in place bumps ``group`` (its
``TORCHELASTIC_RESTART_COUNT``) and ``inPlaceRestarts`` before it commits; the
operator resets ``group`` only when one was recorded (a job without in-place
restarts keeps the status it always had).

Phase and conditions do not change: an in-place restart is invisible to the
lifecycle (the pods stay Running).
"""

from cairn.api import jobstatus, trainingjob
from cairn.operator.core import k8stypes

EVENT_REASON = "InPlaceRestart"


def status_key(job: trainingjob.TrainingJob) -> str:
    """The job's in-place status field: ``ray`` or ``torchrun``."""
    return "ray" if job.spec.runtime == "ray" else "torchrun"


def _group_status(job: trainingjob.TrainingJob) -> jobstatus.RayStatus | None:
    return job.status.ray if job.spec.runtime == "ray" else job.status.torchrun


def _unannounced(job: trainingjob.TrainingJob) -> int:
    """In-place restarts the runtime reported and the operator has not announced."""
    ray = _group_status(job)
    if ray is None or ray.in_place_restarts is None:
        return 0
    return max(ray.in_place_restarts - (ray.announced_in_place_restarts or 0), 0)


def patch(
    job: trainingjob.TrainingJob, *, attempt: int, new_attempt: bool
) -> k8stypes.RayStatusPatch | None:
    """The operator's keys of ``status.<status_key>`` for this reconcile (None: nothing)."""
    ray = _group_status(job)
    out: k8stypes.RayStatusPatch = {}
    if new_attempt and attempt > 0 and (job.spec.runtime == "ray" or (ray and ray.group)):
        out["group"] = 0
    if _unannounced(job) and ray is not None and ray.in_place_restarts is not None:
        out["announcedInPlaceRestarts"] = ray.in_place_restarts
    return out or None


def message(ray: jobstatus.RayStatus, *, unannounced: int, unit: str = "rank-actor group") -> str:
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
    return f"{count}, {unit} {group} restores from {step}{why}"


def events(job: trainingjob.TrainingJob) -> tuple[k8stypes.Event, ...]:
    """One Normal ``InPlaceRestart`` Event for every growth of ``inPlaceRestarts``
    the operator has not announced yet (several between two looks: one Event)."""
    ray = _group_status(job)
    unannounced = _unannounced(job)
    if ray is None or not unannounced:
        return ()
    unit = "rank-actor group" if job.spec.runtime == "ray" else "torchrun worker group"
    return (
        k8stypes.Event(
            type="Normal",
            reason=EVENT_REASON,
            message=message(ray, unannounced=unannounced, unit=unit),
        ),
    )
