"""Flux's verdicts on TrainingJobs: kstatus' rules for custom resources.

``kstatus_compute`` implements what sigs.k8s.io/cli-utils ``pkg/kstatus``
(which Flux's kustomize-controller and helm-controller use for ``wait`` and
health checks) does for a kind it has no built-in rules for:

1. ``metadata.deletionTimestamp`` set -> Terminating;
2. ``status.observedGeneration`` present and != ``metadata.generation`` ->
   InProgress (an absent observedGeneration skips this check);
3. a condition ``Reconciling`` with status True -> InProgress;
4. a condition ``Stalled`` with status True -> Failed;
5. otherwise -> Current.

Covers: the verdict for every phase on the status the operator's own
``status.patch`` writes; a spec edit not yet observed; deletion; and the
documented gap (an object with no status at all is Current to kstatus, before
the operator saw it).
"""

from typing import Any, Literal

import pytest

from cairn.api import jobstatus

from . import samples

Verdict = Literal["InProgress", "Failed", "Current", "Terminating"]

EXPECTED: dict[jobstatus.Phase, Verdict] = {
    "Pending": "InProgress",
    "Starting": "InProgress",
    "Running": "Current",
    "Restarting": "InProgress",
    "Suspending": "InProgress",
    "Suspended": "Current",
    "Succeeded": "Current",
    "Failed": "Failed",
}


def kstatus_compute(obj: dict[str, Any]) -> Verdict:
    """kstatus ``Compute`` for a custom resource (pure; rules in the docstring)."""
    meta = obj.get("metadata", {})
    status = obj.get("status") or {}
    if meta.get("deletionTimestamp"):
        return "Terminating"
    if (
        "generation" in meta
        and "observedGeneration" in status
        and status["observedGeneration"] != meta["generation"]
    ):
        return "InProgress"
    for condition in status.get("conditions") or ():
        if condition["type"] == "Reconciling" and condition["status"] == "True":
            return "InProgress"
        if condition["type"] == "Stalled" and condition["status"] == "True":
            return "Failed"
    return "Current"


def test_every_phase_is_covered() -> None:
    assert set(EXPECTED) == set(jobstatus.PHASES)


@pytest.mark.parametrize("phase", jobstatus.PHASES)
def test_phase_verdict(phase: jobstatus.Phase) -> None:
    assert kstatus_compute(samples.job_object(phase)) == EXPECTED[phase]


@pytest.mark.parametrize("phase", jobstatus.PHASES)
def test_every_condition_carries_the_observed_generation(phase: jobstatus.Phase) -> None:
    obj = samples.job_object(phase, generation=4)
    assert obj["status"]["observedGeneration"] == 4
    assert {c["observedGeneration"] for c in obj["status"]["conditions"]} == {4}


@pytest.mark.parametrize("phase", jobstatus.PHASES)
def test_unobserved_spec_edit_is_in_progress(phase: jobstatus.Phase) -> None:
    obj = samples.job_object(phase, generation=2, observed_generation=1)
    assert kstatus_compute(obj) == "InProgress"


def test_deletion_is_terminating() -> None:
    obj = samples.job_object("Running")
    obj["metadata"]["deletionTimestamp"] = "2026-11-22T13:00:00Z"
    assert kstatus_compute(obj) == "Terminating"


def test_reconciling_and_stalled_are_never_both_true() -> None:
    for phase in jobstatus.PHASES:
        conditions = {
            c["type"]: c["status"] for c in samples.job_object(phase)["status"]["conditions"]
        }
        assert (conditions["Reconciling"], conditions["Stalled"]) != ("True", "True"), phase


def test_no_status_yet_is_current_to_kstatus() -> None:
    # kstatus' documented gap: without status.observedGeneration it cannot tell
    # "not seen yet" from "done". docs/gitops.md says so (and how to wait).
    assert kstatus_compute(samples.fresh_object()) == "Current"


def test_kubectl_wait_conditions_match_terminal_phases() -> None:
    # `kubectl wait --for=condition=Complete` / `=Failed` (docs/gitops.md).
    for phase in jobstatus.PHASES:
        conditions = {
            c["type"]: c["status"] for c in samples.job_object(phase)["status"]["conditions"]
        }
        assert (conditions["Complete"] == "True") == (phase == "Succeeded")
        assert (conditions["Failed"] == "True") == (phase == "Failed")
