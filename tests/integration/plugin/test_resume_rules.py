"""``kubectl cairn resume --from-step``: when it refuses, and what it sends (pure, no cluster).

Covers: a finished job (Succeeded, Failed) is refused; a step the status does
not know as committed is refused (never committed, only rotated away, in
flight, corrupt in history or in the operator's S3 listing), with the known
steps in the reason; steps known from history, lastCommitted, lastUploaded or
the operator's remoteSteps are accepted; the edit patch nulls the other
one-of forms and the old sha256 pin, carries a new resume-request annotation
and the checked resourceVersion, and sets ``spec.suspend`` only when asked;
the wait for Suspended needs the operator to have seen the patched generation.
"""

import datetime
from typing import Any

import pytest

from cairn.api import checkpointspec
from cairn.kubectl_plugin import resume

NOW = datetime.datetime(2026, 11, 22, 12, 0, tzinfo=datetime.UTC)


def job(**status: Any) -> dict[str, Any]:
    return {"metadata": {"name": "llm", "resourceVersion": "42"}, "status": status}


HISTORY = {
    "history": [
        {"step": 30, "state": "uploaded"},
        {"step": 20, "state": "committed"},
        {"step": 10, "state": "rotated"},
        {"step": 5, "state": "corrupt"},
    ],
    "lastCommitted": {"step": 40},
    "lastUploaded": {"step": 35},
    "inFlight": [{"step": 50, "stage": "writing"}],
}


@pytest.mark.parametrize("phase", ["Succeeded", "Failed"])
def test_a_finished_job_is_refused(phase: str) -> None:
    reason = resume.refusal(name="llm", job=job(phase=phase, checkpoints=HISTORY), step=30)
    assert reason is not None and f"is {phase}" in reason and "does not start again" in reason


@pytest.mark.parametrize(
    "step", [7, 10, 5, 50], ids=["never-committed", "rotated", "corrupt", "in-flight"]
)
def test_a_step_that_is_not_committed_is_refused(step: int) -> None:
    reason = resume.refusal(name="llm", job=job(phase="Suspended", checkpoints=HISTORY), step=step)
    assert reason == (
        f"step {step} is not a committed checkpoint of trainingjob llm"
        " (known: 20, 30, 35, 40); see kubectl cairn checkpoints llm"
    )


def test_a_job_without_checkpoints_lists_none() -> None:
    reason = resume.refusal(name="llm", job=job(phase="Suspended"), step=0)
    assert reason is not None and "(known: none)" in reason


@pytest.mark.parametrize("step", [20, 30, 35, 40, 60])
def test_known_steps_are_accepted(step: int) -> None:
    storage = {"remoteSteps": [30, 60, 70], "corruptSteps": [70]}
    status = job(phase="Suspended", checkpoints=HISTORY, storage=storage)
    assert resume.refusal(name="llm", job=status, step=step) is None


def test_a_step_the_operator_found_corrupt_is_refused() -> None:
    storage = {"remoteSteps": [30, 70], "corruptSteps": [70]}
    status = job(phase="Running", checkpoints=HISTORY, storage=storage)
    assert resume.refusal(name="llm", job=status, step=70) is not None


def test_a_running_job_with_the_step_is_accepted() -> None:
    # The command suspends it first; refusing would leave users a manual dance.
    assert (
        resume.refusal(name="llm", job=job(phase="Running", checkpoints=HISTORY), step=20) is None
    )


@pytest.mark.parametrize("suspend", [True, False, None])
def test_the_edit_patch(suspend: bool | None) -> None:
    patch = resume.edit_patch(
        step=7, request=resume.request_id(NOW), resource_version="42", suspend=suspend
    )
    spec: dict[str, Any] = {
        "checkpoint": {
            "resume": {"step": 7, "latest": None, "none": None, "uri": None, "sha256": None}
        }
    }
    if suspend is not None:
        spec["suspend"] = suspend
    assert patch == {
        "metadata": {
            "resourceVersion": "42",
            "annotations": {
                checkpointspec.RESUME_REQUEST_ANNOTATION: "2026-11-22T12:00:00.000000Z"
            },
        },
        "spec": spec,
    }


def test_each_request_is_new() -> None:
    later = NOW + datetime.timedelta(microseconds=1)
    assert resume.request_id(NOW) != resume.request_id(later)


@pytest.mark.parametrize(
    ("status", "seen"),
    [
        ({"phase": "Suspended", "observedGeneration": 4}, True),
        ({"phase": "Suspended", "observedGeneration": 5}, True),
        # Suspended from before the patch: the operator has not acted on it yet.
        ({"phase": "Suspended", "observedGeneration": 3}, False),
        ({"phase": "Suspending", "observedGeneration": 4}, False),
        ({}, False),
    ],
)
def test_suspended_at(status: dict[str, Any], seen: bool) -> None:
    assert resume.suspended_at({"status": status}, generation=4) is seen
