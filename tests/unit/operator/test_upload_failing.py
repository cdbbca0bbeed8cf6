"""The UploadFailing condition, derived from the writer's `status.checkpoints.uploadError`.

Covers: no condition without upload; False while uploads succeed; True with
the error, the backlog and the retention note when the writer reports one;
it is a warning condition (its turning True posts a Warning Event);
RetentionOverBudget from the writer's `retentionOverBudget`, with or without
an upload error, also a warning condition.
"""

from __future__ import annotations

import datetime

import pytest

from cairn.operator.core import conditions, jobobserve, lifecycle, status

from . import jobs

NOW = datetime.datetime(2026, 11, 23, 12, 0, tzinfo=datetime.UTC)


def upload_failing(checkpoints: dict[str, object], **spec: object) -> list[conditions.Desired]:
    job = jobs.job({"phase": "Running", "attempt": 1, "checkpoints": checkpoints}, **spec)
    decision = lifecycle.decide(job=job, observed=jobobserve.Observed(pods=()), now=NOW)
    return [
        c
        for c in status.desired_conditions(job, decision, NOW)
        if c.type == conditions.UPLOAD_FAILING
    ]


UPLOAD = {"checkpoint": {"upload": {"uri": "s3://bkt/p"}}}


def test_no_condition_without_upload() -> None:
    assert upload_failing({}) == []


def test_false_while_uploads_succeed() -> None:
    (found,) = upload_failing({"lastUploaded": {"step": 4}}, **UPLOAD)
    assert (found.status, found.reason) == (False, conditions.REASON_UPLOADS_OK)


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (
            {"message": "RemoteError: connection reset", "step": 6, "backlog": [4, 6]},
            "upload of step 6 failed: RemoteError: connection reset; "
            "waiting for upload: steps [4, 6]",
        ),
        (
            {
                "message": "boom",
                "step": 8,
                "backlog": [2, 4, 6, 8],
                "retention": "local retention over budget (keepLast 2)",
            },
            "upload of step 8 failed: boom; waiting for upload: steps [2, 4, 6, 8]; "
            "local retention over budget (keepLast 2)",
        ),
    ],
)
def test_true_with_the_writers_error(error: dict[str, object], expected: str) -> None:
    (found,) = upload_failing({"uploadError": error}, **UPLOAD)
    assert (found.status, found.reason, found.message) == (
        True,
        conditions.REASON_UPLOAD_FAILING,
        expected,
    )


def test_is_a_warning_condition() -> None:
    assert conditions.UPLOAD_FAILING in conditions.WARNING_CONDITIONS
    assert conditions.UPLOAD_FAILING in conditions.TYPES


def retention_over_budget(checkpoints: dict[str, object]) -> conditions.Desired:
    job = jobs.job({"phase": "Running", "attempt": 1, "checkpoints": checkpoints}, **UPLOAD)
    decision = lifecycle.decide(job=job, observed=jobobserve.Observed(pods=()), now=NOW)
    (found,) = [
        c
        for c in status.desired_conditions(job, decision, NOW)
        if c.type == conditions.RETENTION_OVER_BUDGET
    ]
    return found


def test_retention_over_budget_without_an_upload_error() -> None:
    """A slow store fails nothing, yet the volume fills: its own warning condition."""
    note = (
        "local retention over budget (keepLast 2): keeping steps [2, 4] that are not uploaded yet"
    )
    found = retention_over_budget({"lastUploaded": {"step": 1}, "retentionOverBudget": note})
    assert (found.status, found.reason, found.message) == (
        True,
        conditions.REASON_RETENTION_OVER_BUDGET,
        note,
    )
    within = retention_over_budget({"lastUploaded": {"step": 4}})
    assert (within.status, within.reason) == (False, conditions.REASON_RETENTION_WITHIN_BUDGET)
    assert conditions.RETENTION_OVER_BUDGET in conditions.WARNING_CONDITIONS
    assert conditions.RETENTION_OVER_BUDGET in conditions.TYPES
