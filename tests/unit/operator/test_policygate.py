"""The StatusPolicyMissing gate without a cluster (``core.policygate`` over ``jobplan``).

Cases: policy present -> the plan as planned; missing on a new job -> no
Role, RoleBinding or pod, nothing deleted, the condition True with the
reason and the message, one Warning Event, a recheck within seconds; missing
again with the same message -> nothing written, no second Event; a new
message -> written and announced again; a running job's plan that creates
nothing -> unchanged (what runs keeps running); restored -> the normal plan
starts the pods and its status no longer carries the condition; other
conditions survive the gate; foreign pods already reported stay reported.
"""

from cairn.api import trainingjob
from cairn.operator.core import conditions, jobobserve, jobplan, policygate

from . import jobs

MISSING = "ValidatingAdmissionPolicy x is not installed (...): pods are held"


def _gated(
    job: trainingjob.TrainingJob,
    *,
    missing: str | None,
    pods: tuple[jobobserve.ObservedPod, ...] = (),
    reported: frozenset[str] = frozenset(),
) -> jobplan.Plan:
    observed = jobobserve.Observed(pods=pods, reported_foreign=reported)
    todo = jobplan.plan(job=job, observed=observed, now=jobs.at(1))
    return policygate.gate(todo, missing=missing, job=job, reported_before=reported, now=jobs.at(1))


def _condition(job: trainingjob.TrainingJob, result: jobplan.Plan) -> trainingjob.Condition | None:
    after = jobs.patched(job, result)
    return conditions.find(after.status.conditions, conditions.STATUS_POLICY_MISSING)


def test_present_policy_leaves_the_plan() -> None:
    job = jobs.job()
    todo = jobplan.plan(job=job, observed=jobobserve.Observed(pods=()), now=jobs.at(1))
    gated = policygate.gate(
        todo, missing=None, job=job, reported_before=frozenset(), now=jobs.at(1)
    )
    assert gated is todo
    assert {c["kind"] for c in todo.creates} >= {"Role", "RoleBinding", "Pod"}


def test_missing_policy_holds_every_create_and_says_why() -> None:
    job = jobs.job()
    held = _gated(job, missing=MISSING)
    assert held.creates == ()
    assert held.deletes == ()
    found = _condition(job, held)
    assert found is not None
    assert (found.status, found.reason, found.message) == (
        "True",
        conditions.REASON_STATUS_POLICY_MISSING,
        MISSING,
    )
    assert [(e.type, e.reason, e.message) for e in held.events] == [
        ("Warning", conditions.REASON_STATUS_POLICY_MISSING, MISSING)
    ]
    assert held.requeue_after is not None
    assert held.requeue_after <= policygate.RECHECK_SECONDS
    assert set(held.status or {}) == {"conditions"}  # no phase, attempt or time moved


def test_missing_again_writes_and_announces_nothing() -> None:
    job = jobs.job()
    first = jobs.patched(job, _gated(job, missing=MISSING))
    again = _gated(first, missing=MISSING)
    assert (again.status, again.events, again.creates) == (None, (), ())
    assert again.requeue_after == policygate.RECHECK_SECONDS


def test_a_new_reason_is_written_and_announced() -> None:
    job = jobs.job()
    first = jobs.patched(job, _gated(job, missing=MISSING))
    other = "could not read the ValidatingAdmissionPolicy x (403 Forbidden): pods are held"
    again = _gated(first, missing=other)
    found = _condition(first, again)
    assert found is not None
    assert found.message == other
    assert [e.message for e in again.events] == [other]


def test_running_job_keeps_running() -> None:
    job = jobs.job(status={"phase": "Running", "attempt": 1, "restarts": 0})
    pods = (jobs.pod(1, 0), jobs.pod(1, 1))
    observed = jobobserve.Observed(pods=pods)
    todo = jobplan.plan(job=job, observed=observed, now=jobs.at(1))
    assert not any(c["kind"] in policygate.GATED_KINDS for c in todo.creates)
    gated = policygate.gate(
        todo, missing=MISSING, job=job, reported_before=frozenset(), now=jobs.at(1)
    )
    assert gated is todo


def test_restored_policy_starts_the_pods_and_drops_the_condition() -> None:
    job = jobs.patched(jobs.job(), _gated(jobs.job(), missing=MISSING))
    resumed = _gated(job, missing=None)
    assert {c["kind"] for c in resumed.creates} >= {"Role", "RoleBinding", "Pod"}
    assert _condition(job, resumed) is None
    assert jobs.patched(job, resumed).status.phase is not None


def test_other_conditions_survive_the_gate() -> None:
    ready = {
        "type": "Ready",
        "status": "False",
        "reason": "Pending",
        "message": "waiting",
        "lastTransitionTime": "2026-11-22T11:00:00Z",
    }
    job = jobs.job(status={"conditions": [ready]})
    held = jobs.patched(job, _gated(job, missing=MISSING))
    kept = conditions.find(held.status.conditions, "Ready")
    assert kept is not None
    assert (kept.status, kept.reason, kept.message) == ("False", "Pending", "waiting")
    assert kept.last_transition_time == jobs.T0.replace(hour=11)


def test_foreign_pods_already_reported_stay_reported() -> None:
    held = _gated(jobs.job(), missing=MISSING, reported=frozenset({"stranger-uid"}))
    assert held.foreign_reported == frozenset({"stranger-uid"})
