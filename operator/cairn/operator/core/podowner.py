"""Which of the pods labelled with a job's name are the job's own, and the
``ForeignPod`` report of the others.

Pure. Labels say nothing about who made a pod: anyone who may create a pod
in the namespace can copy ``cairn.dev/job-name``, ``cairn.dev/attempt`` and
``cairn.dev/rank``. A pod labelled with a job's name is that job's own only
if its controller ownerReference is the job's UID and its name is the one
``podidentity.pod_name`` gives its attempt and rank (``builders.pod`` sets both;
Ray heads and workers are the same pods). Any other such pod is *foreign*:
``jobplan.plan`` attaches the observed pods first (``attach``), so no decision
(phase, attempt, stale status, suspend, deadlines, Kueue hold, deletes)
ever sees one, and reports each foreign pod once (``reports``) as a Warning
Event on the job. ``handlers`` applies the same rule (``owns``) to its own
pod lists (onDelete, the Kueue quota release).
"""

import dataclasses

from cairn.api import podidentity
from cairn.operator.core import jobobserve, k8stypes

REASON_FOREIGN_POD = "ForeignPod"
MSG_FOREIGN_POD = (
    "pod {pod} has this job's labels but is not its pod ({why}); ignored: "
    "it is not counted, waited for or deleted"
)
MAX_REPORTS_PER_PLAN = 10
"""Events per reconcile at most: a namespace filled with decoys is reported
over several reconciles, not in one burst."""


def why_foreign(pod: jobobserve.ObservedPod, *, job_name: str, job_uid: str) -> str | None:
    """Why ``pod`` (labelled with ``job_name``) is not the job's; None: it is."""
    return podidentity.why_foreign(
        name=pod.name,
        attempt=pod.attempt,
        rank=pod.rank,
        controller=pod.controller_uid,
        job_name=job_name,
        job_uid=job_uid,
    )


def owns(pod: jobobserve.ObservedPod, *, job_name: str, job_uid: str) -> bool:
    """Whether ``pod`` is the job's own (see the module docstring)."""
    return why_foreign(pod, job_name=job_name, job_uid=job_uid) is None


def attach(observed: jobobserve.Observed, *, job_name: str, job_uid: str) -> jobobserve.Observed:
    """``observed`` with only the job's own pods in ``pods``; the rest (foreign)
    move to ``foreign``."""
    own: list[jobobserve.ObservedPod] = []
    foreign: list[jobobserve.ObservedPod] = list(observed.foreign)
    for pod in observed.pods:
        (own if owns(pod, job_name=job_name, job_uid=job_uid) else foreign).append(pod)
    return dataclasses.replace(observed, pods=tuple(own), foreign=tuple(foreign))


def reports(
    observed: jobobserve.Observed, *, job_name: str, job_uid: str
) -> tuple[tuple[k8stypes.Event, ...], frozenset[str]]:
    """The Warning Events for foreign pods not reported yet (at most
    ``MAX_REPORTS_PER_PLAN``), and the UIDs reported after them: those still
    foreign (a pod gone is forgotten) and the newly reported."""
    present = {p.uid for p in observed.foreign}
    reported = observed.reported_foreign & present
    events: list[k8stypes.Event] = []
    for pod in sorted(observed.foreign, key=lambda p: p.name):
        if pod.uid in reported or len(events) >= MAX_REPORTS_PER_PLAN:
            continue
        why = why_foreign(pod, job_name=job_name, job_uid=job_uid) or "not this job's"
        message = MSG_FOREIGN_POD.format(pod=pod.name, why=why)
        events.append(k8stypes.Event(type="Warning", reason=REASON_FOREIGN_POD, message=message))
        reported |= {pod.uid}
    return tuple(events), frozenset(reported)
