"""The plugin prefers the operator's S3 verification (``status.storage``).

Covers: ``checkpoints`` marks a step verified when the operator verified it
(``verifiedStep``, or kept in ``remoteSteps`` and not in ``corruptSteps`` or
``foreignSteps``) although the writer's ``lastUploaded.verified`` is false;
``describe`` says "(verified)", shows the verified step and method, and the
last S3 error; a foreign step is never shown verified.
"""

import datetime

from cairn.api import jobstatus
from cairn.kubectl_plugin import views

NOW = datetime.datetime(2026, 11, 23, 3, 0, tzinfo=datetime.UTC)
STATUS = {
    "checkpoints": {
        "lastCommitted": {"step": 30},
        "lastUploaded": {"step": 30, "uri": "s3://b/p/step-000000030", "verified": False},
        "history": [
            {"step": 10, "state": "uploaded"},
            {"step": 20, "state": "uploaded"},
            {"step": 30, "state": "uploaded"},
        ],
    },
    "storage": {
        "verifiedStep": 30,
        "verifiedBy": "crc32c",
        "remoteSteps": [10, 20, 30],
        "corruptSteps": [20],
        "lastError": "listing s3://b/p/ failed: SlowDown",
    },
}


def test_checkpoint_rows_prefer_the_operators_verification() -> None:
    status = jobstatus.TrainingJobStatus.model_validate(STATUS)
    rows = {row.step: row.verified for row in views.checkpoint_rows(status)}
    assert rows == {30: True, 20: False, 10: True}
    assert views.operator_verified(status) == frozenset({10, 30})


def test_describe_shows_the_verified_step() -> None:
    job = {
        "metadata": {"name": "j", "namespace": "ns"},
        "spec": {"checkpoint": {"upload": {"uri": "s3://b/p"}}},
        "status": STATUS,
    }
    out = views.describe(job, pods=[], now=NOW)
    assert "Uploaded:      step 30 to s3://b/p/step-000000030 (verified)" in out
    assert "Verified:      step 30 in S3 (crc32c)" in out
    assert "S3 error:      listing s3://b/p/ failed: SlowDown" in out


def test_a_foreign_step_in_s3_is_not_shown_verified() -> None:
    """A step the operator found not the job's own (``foreignSteps``: forged or
    another job's, issue 19) is kept in ``remoteSteps`` but never verified."""
    doc = {
        **STATUS,
        "storage": {
            **STATUS["storage"],
            "verifiedBy": "crc32c+hmac",
            "remoteSteps": [10, 20, 30, 40],
            "foreignSteps": [40],
        },
    }
    status = jobstatus.TrainingJobStatus.model_validate(doc)
    assert views.operator_verified(status) == frozenset({10, 30})
