"""The plugin's pure views (no cluster): ages, sizes, selectors, progress.

Covers: kubectl-style ages at each unit boundary; human-readable sizes; the
pod label selector; the download progress line; a step known only from
``lastUploaded``. The resume rules and patches: ``test_resume_rules.py``.
"""

import datetime

import pytest

from cairn.api import jobstatus
from cairn.kubectl_plugin import views

NOW = datetime.datetime(2026, 11, 22, 12, 0, tzinfo=datetime.UTC)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (119, "119s"),
        (120, "2m"),
        (7199, "119m"),
        (7200, "2h"),
        (172800, "2d"),
        (-5, "0s"),
    ],
)
def test_age(seconds: int, text: str) -> None:
    assert views.age(now=NOW, then=NOW - datetime.timedelta(seconds=seconds)) == text


def test_age_unknown() -> None:
    assert views.age(now=NOW, then=None) == "-"


@pytest.mark.parametrize(
    ("size", "text"),
    [
        (None, "-"),
        (0, "0B"),
        (1023, "1023B"),
        (1024, "1.0KiB"),
        (3 * 1024**3, "3.0GiB"),
        (5 * 1024**5, "5120.0TiB"),
    ],
)
def test_human_bytes(size: int | None, text: str) -> None:
    assert views.human_bytes(size) == text


def test_pod_selector() -> None:
    assert views.pod_selector(job="llm", attempt=3, rank=1) == (
        "cairn.dev/job-name=llm,cairn.dev/attempt=3,cairn.dev/rank=1"
    )
    assert views.pod_selector(job="llm", attempt=None, rank=None) == "cairn.dev/job-name=llm"


def test_step_known_only_from_last_uploaded() -> None:
    status = jobstatus.TrainingJobStatus.model_validate(
        {"checkpoints": {"lastUploaded": {"step": 9, "uri": "s3://b/p", "verified": False}}}
    )
    [row] = views.checkpoint_rows(status)
    assert (row.step, row.state, row.local, row.remote, row.verified) == (
        9,
        "uploaded",
        "?",
        "yes",
        False,
    )


def test_progress_line() -> None:
    state = views.Progress(done=3 * 1024**2, total=12 * 1024**2, files_done=1, files=4)
    assert views.progress_line(state, width=8) == "[##------]  25%  3.0MiB/12.0MiB  1/4 files"
    empty = views.Progress(done=0, total=0, files_done=0, files=0)
    assert views.progress_line(empty, width=4).startswith("[####] 100%")
