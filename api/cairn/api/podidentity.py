"""Which pod is a job's own: its labels, its name and the ownership rule.

Pure, and shared by the operator (``cairn.operator.core.names``,
``podowner``) and the kubectl plugin (``views``), so both judge a pod the
same way. Labels say nothing about who made a pod: anyone who may create a
pod in the namespace can copy them. A pod labelled with a job's name is the
job's own only if its controller ownerReference is the job's UID and its
name is the one ``pod_name`` gives its attempt and rank (the operator sets
both when it creates the pod).
"""

from collections.abc import Mapping
from typing import Any

LABEL_JOB = "cairn.dev/job-name"
LABEL_ATTEMPT = "cairn.dev/attempt"
LABEL_RANK = "cairn.dev/rank"


def pod_name(*, job: str, attempt: int, rank: int) -> str:
    """``<job>-a<attempt>-n<rank>``: also the pod's hostname (a DNS label)."""
    return f"{job}-a{attempt}-n{rank}"


def int_label(labels: Mapping[str, str], key: str) -> int | None:
    """A label's non-negative integer value; None when absent or not digits."""
    value = labels.get(key, "")
    return int(value) if isinstance(value, str) and value.isdigit() else None


def controller_uid(metadata: Mapping[str, Any]) -> str | None:
    """UID of the controller ownerReference in ``metadata`` (at most one is
    allowed by the API server); None without one."""
    for owner in metadata.get("ownerReferences") or ():
        if isinstance(owner, Mapping) and owner.get("controller") is True:
            return str(owner.get("uid") or "") or None
    return None


def why_foreign(
    *,
    name: str,
    attempt: int | None,
    rank: int | None,
    controller: str | None,
    job_name: str,
    job_uid: str,
) -> str | None:
    """Why the pod ``name`` (labelled with ``job_name``, its attempt and rank
    labels parsed) is not the job's; None: it is."""
    if controller is None:
        return "it has no controller ownerReference"
    if not job_uid or controller != job_uid:
        return "its controller ownerReference is not this job"
    if attempt is None or rank is None:
        return "its attempt or rank label is not a number"
    expected = pod_name(job=job_name, attempt=attempt, rank=rank)
    if name != expected:
        return f"the operator names attempt {attempt} rank {rank} {expected}"
    return None
