"""The UploadFailing condition, derived from the writer's `status.checkpoints.uploadError`.

Covers: no condition without upload; False while uploads succeed; True with
the error, the backlog and the retention note when the writer reports one;
it is a warning condition (its turning True posts a Warning Event).
"""

from __future__ import annotations

import datetime

import pytest

from cairn.operator import conditions, lifecycle, observe, status

from . import jobs

NOW = datetime.datetime(2026, 11, 23, 12, 0, tzinfo=datetime.UTC)


def upload_failing(checkpoints: dict[str, object], **spec: object) -> list[conditions.Desired]:
    job = jobs.job({"phase": "Running", "attempt": 1, "checkpoints": checkpoints}, **spec)
    decision = lifecycle.decide(job=job, observed=observe.Observed(pods=()), now=NOW)
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
