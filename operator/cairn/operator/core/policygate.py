"""Hold a job's pods while the status policy is absent: the ``StatusPolicyMissing`` gate.

Pure. The per-job Role lets the job's ServiceAccount patch the job's
``/status``; only the ValidatingAdmissionPolicy (``statuspolicy``) confines
that token to the writer pod and the writer fields. Without the policy (or
its binding) the token could write anything, so a plan that would create the
Role, its RoleBinding or a pod is held back whole (its status, deletes,
creates and transition events are recomputed by the next reconcile, so
nothing is lost) and replaced by the condition ``StatusPolicyMissing=True``
with a Warning Event, once per new message. Plans that create nothing (a
running, suspending or finished job) pass unchanged: what already runs keeps
running. Once the policy is back the normal plan's status patch recomputes
the conditions without this one (``status.desired_conditions``).
"""

import datetime

from cairn.api import jobstatus, trainingjob
from cairn.operator.core import conditions as cond
from cairn.operator.core import jobplan, k8stypes

GATED_KINDS: frozenset[str] = frozenset({"Role", "RoleBinding", "Pod"})
"""Creates that hand the job's ServiceAccount its status rights or a token."""
RECHECK_SECONDS = 5.0
"""How soon a held job looks again (the IO check caches a missing policy as long)."""


def _missing_condition(
    previous: jobstatus.TrainingJobStatus, *, message: str, generation: int, now: datetime.datetime
) -> list[k8stypes.ConditionDict]:
    kept = [
        cond.Desired(type=c.type, status=c.status == "True", reason=c.reason, message=c.message)
        for c in previous.conditions or ()
        if c.type != cond.STATUS_POLICY_MISSING
    ]
    mine = cond.Desired(
        type=cond.STATUS_POLICY_MISSING,
        status=True,
        reason=cond.REASON_STATUS_POLICY_MISSING,
        message=message,
    )
    return cond.merge(
        previous=previous.conditions, desired=[*kept, mine], generation=generation, now=now
    )


def gate(
    todo: jobplan.Plan,
    *,
    missing: str | None,
    job: trainingjob.TrainingJob,
    reported_before: frozenset[str],
    now: datetime.datetime,
) -> jobplan.Plan:
    """``todo`` unchanged when the policy is present (``missing`` None) or the
    plan creates nothing gated; else the held plan. ``reported_before``: the
    foreign pods already reported (their Events are part of what is held)."""
    if missing is None or not any(c["kind"] in GATED_KINDS for c in todo.creates):
        return todo
    requeue = min(todo.requeue_after or RECHECK_SECONDS, RECHECK_SECONDS)
    held = cond.find(job.status.conditions, cond.STATUS_POLICY_MISSING)
    if held is not None and (held.status, held.message) == ("True", missing):
        return jobplan.Plan(
            requeue_after=requeue, decision=todo.decision, foreign_reported=reported_before
        )
    status: k8stypes.StatusPatch = {
        "conditions": _missing_condition(
            job.status, message=missing, generation=job.metadata.generation, now=now
        )
    }
    event = k8stypes.Event(
        type="Warning", reason=cond.REASON_STATUS_POLICY_MISSING, message=missing
    )
    return jobplan.Plan(
        status=status,
        events=(event,),
        requeue_after=requeue,
        decision=todo.decision,
        foreign_reported=reported_before,
    )
