"""The library's own status feed and save schedule (issue #22.1, #24.4).

Covers: no operator environment (none, rank 0 not asked, no namespace) →
no feed and no API call; the environment without in-cluster credentials →
no feed, a logged reason, no error; a malformed status interval names the
variable; the feed folds commits, uploads, the step and the resume into the
patches the reporter sends (a real `StatusReporter` into a recording sink),
and its close delivers the final state; `resumedFrom` of an S3 resume that
fell back; the final request's state moves none → signalled → requested →
saved, and a save of another step does not claim the final one.
"""

import logging
import pathlib
from typing import Any

import pytest

from cairn.api import podenv
from cairn.checkpoint import (
    coordinator,
    events,
    options,
    restore,
    schedule,
    status_feed,
    status_reporter,
)

JOB_ENV = {podenv.REPORT_STATUS: "1", podenv.JOB_NAME: "j", podenv.NAMESPACE: "ns"}


def _opts(tmp_path: pathlib.Path, **kw: Any) -> options.CheckpointOptions:
    return options.CheckpointOptions(directory=tmp_path, **kw)


@pytest.mark.parametrize(
    "environ",
    [
        {},
        {**JOB_ENV, podenv.REPORT_STATUS: "0"},
        {podenv.REPORT_STATUS: "1", podenv.JOB_NAME: "j"},
        {podenv.REPORT_STATUS: "1", podenv.NAMESPACE: "ns"},
    ],
    ids=["no-env", "not-rank-0", "no-namespace", "no-job-name"],
)
def test_without_the_operator_environment_there_is_no_feed(
    tmp_path: pathlib.Path, environ: dict[str, str]
) -> None:
    assert status_feed.target_from_env(environ) is None
    assert status_feed.StatusFeed.from_env(_opts(tmp_path), environ=environ) is None


def test_the_environment_without_cluster_credentials_stays_silent(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    with caplog.at_level(logging.WARNING, logger=status_feed.__name__):
        assert status_feed.StatusFeed.from_env(_opts(tmp_path), environ=JOB_ENV) is None
    assert "no in-cluster API access" in caplog.text


def test_a_malformed_status_interval_names_the_variable() -> None:
    environ = {**JOB_ENV, podenv.STATUS_INTERVAL_SECONDS: "soon"}
    with pytest.raises(ValueError, match=podenv.STATUS_INTERVAL_SECONDS):
        status_feed.target_from_env(environ)


def test_the_interval_comes_from_the_environment() -> None:
    target = status_feed.target_from_env({**JOB_ENV, podenv.STATUS_INTERVAL_SECONDS: "5"})
    assert target == status_feed.Target(name="j", namespace="ns", status_interval_seconds=5.0)


def test_the_feed_reports_step_commit_upload_and_resume() -> None:
    bodies: list[dict[str, Any]] = []
    reporter = status_reporter.StatusReporter(
        patch=bodies.append, min_interval_seconds=0.0, status_interval_seconds=0.0
    )
    feed = status_feed.StatusFeed(
        reporter=reporter, previous=None, upload_uri="s3://b/job", api_fence=None
    )
    result = restore.RestoreResult(step=10, source="s3", skipped=((15, "corrupt"),))
    feed.on_resume(status_feed.resumed_from(result, attempt=2))
    feed.on_step(11)
    feed.on_event(events.ProgressEvent(phase="committed", step=15, rank=0, bytes=7))
    feed.on_event(events.ProgressEvent(phase="committed", step=20, rank=1, bytes=7))  # not rank 0
    feed.on_event(events.ProgressEvent(phase="uploaded", step=15, rank=0, bytes=7))
    feed.on_step(16)
    feed.close()
    status = bodies[-1]["status"]
    assert status["step"] == 16
    ckpts = status["checkpoints"]
    assert ckpts["lastCommitted"]["step"] == 15
    assert ckpts["lastUploaded"]["step"] == 15
    assert ckpts["lastUploaded"]["uri"] == "s3://b/job/step-000000015/"
    assert ckpts["resumedFrom"] == {
        "step": 10,
        "attempt": 2,
        "source": "remote",
        "tier": "s3",
        "uri": None,
        "fellBackFrom": 15,
        "imported": None,
    }


def test_the_final_request_moves_through_one_state(tmp_path: pathlib.Path) -> None:
    plan = schedule.SaveSchedule(
        opts=_opts(tmp_path, interval_steps=100), coordinator=coordinator.LocalCoordinator()
    )
    seen: list[schedule.FinalState] = [plan.final]
    assert not plan.should_save(1)
    plan.note_signal()
    seen.append(plan.final)
    plan.note_signal()  # a second SIGTERM changes nothing
    seen.append(plan.final)
    assert plan.should_save(2)  # one process: agreed at the step it is at
    assert plan.final_step == 2
    seen.append(plan.final)
    assert not plan.started(1)  # another step's save is not the final one
    seen.append(plan.final)
    assert plan.started(2)
    seen.append(plan.final)
    assert seen == ["none", "signalled", "signalled", "requested", "requested", "saved"]
