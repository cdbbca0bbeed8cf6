"""Which checkpoint attempt k resumes from: the spec's explicit target once, then latest.

Covers (``resumeplan.choose``): a fresh job with ``latest`` records the
request; a fresh job's explicit step/uri/none applies to attempt 1 and is
recorded; an import that crashed before loading or committing is retried;
an edit of ``spec.checkpoint.resume`` after commits (the `kubectl cairn
resume --from-step` case) applies to the next attempt, and after that
attempt loaded it (or committed since it started) later attempts resume
from latest; a crash before the load retries the target; a lost pod of the
applying attempt gets the same target; the same target again needs a new
``cairn.dev/resume-request``; an unrelated edit (a new generation, same
request) never re-applies it; a job that committed before any record (an
older operator) keeps resuming from latest. Through ``jobplan.plan``: the start
of the attempt writes ``status.resumeApplied`` and its event names the
explicit target and the generation.
"""

import datetime
from typing import Any

import pytest

from cairn.api import checkpointspec, podenv, trainingjob
from cairn.operator.core import decisions, jobobserve, jobplan, resumeplan

from . import jobs

LATEST = podenv.ResumeTarget(kind="latest")
STEP10 = podenv.ResumeTarget(kind="step", step=10)
URI = "s3://bucket/imports/run-7"
UPLOAD = {"uri": "s3://bucket/jobs/demo"}
T_APPLIED = "2026-11-22T12:00:10Z"


def make(
    resume: dict[str, Any],
    *,
    status: dict[str, Any] | None = None,
    request: str | None = None,
    generation: int = 1,
) -> trainingjob.TrainingJob:
    raw = jobs.body(checkpoint={"resume": resume, "upload": UPLOAD})
    raw["metadata"]["generation"] = generation
    if request is not None:
        raw["metadata"]["annotations"] = {checkpointspec.RESUME_REQUEST_ANNOTATION: request}
    if status is not None:
        raw["status"] = status
    return trainingjob.TrainingJob.model_validate(raw)


def applied(target: str, attempt: int | None, request: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"target": target, "generation": 2, "time": T_APPLIED}
    if attempt is not None:
        out["attempt"] = attempt
    if request is not None:
        out["request"] = request
    return out


def committed(step: int, at: str = "2026-11-22T12:00:05Z") -> dict[str, Any]:
    return {"lastCommitted": {"step": step, "time": at}}


def test_a_fresh_job_with_latest_records_the_request() -> None:
    choice = resumeplan.choose(make({"latest": True}), attempt=1, now=jobs.T0)
    assert choice.target == LATEST and not choice.explicit
    assert choice.record is not None
    assert (choice.record.target, choice.record.attempt) == ("latest", 1)


@pytest.mark.parametrize(
    ("resume", "target"),
    [
        ({"step": 10}, STEP10),
        ({"uri": URI}, podenv.ResumeTarget(kind="uri", uri=URI)),
        ({"none": True}, podenv.ResumeTarget(kind="none")),
    ],
    ids=["step", "uri", "none"],
)
def test_a_fresh_jobs_explicit_target_applies_to_attempt_one(
    resume: dict[str, Any], target: podenv.ResumeTarget
) -> None:
    choice = resumeplan.choose(make(resume, generation=1), attempt=1, now=jobs.T0)
    assert choice.target == target and choice.explicit
    assert choice.record is not None
    assert choice.record.target == podenv.format_resume(target)
    assert (choice.record.attempt, choice.record.generation, choice.record.time) == (1, 1, jobs.T0)


def test_an_import_that_crashed_before_any_commit_is_retried() -> None:
    job = make({"uri": URI}, status={"attempt": 1, "resumeApplied": applied(URI, 1)})
    choice = resumeplan.choose(job, attempt=2, now=jobs.at(60))
    assert choice.target == podenv.ResumeTarget(kind="uri", uri=URI)
    assert choice.record is None


def test_an_import_that_committed_resumes_from_latest() -> None:
    status = {
        "attempt": 1,
        "resumeApplied": applied(URI, 1),
        "checkpoints": {**committed(4, "2026-11-22T12:01:00Z")},
    }
    choice = resumeplan.choose(make({"uri": URI}, status=status), attempt=2, now=jobs.at(90))
    assert choice == resumeplan.Choice(target=LATEST)


def test_an_edit_after_commits_applies_to_the_next_attempt() -> None:
    # The case: the job committed up to 35, the user asks for step 10.
    status = {"attempt": 2, "resumeApplied": applied("latest", 1), "checkpoints": committed(35)}
    job = make({"step": 10}, status=status, generation=5)
    choice = resumeplan.choose(job, attempt=3, now=jobs.at(100))
    assert choice.target == STEP10 and choice.explicit
    assert choice.record is not None
    assert (choice.record.target, choice.record.attempt, choice.record.generation) == (
        "step:10",
        3,
        5,
    )


def test_after_the_target_was_loaded_later_attempts_resume_from_latest() -> None:
    ckpts = {**committed(35), "resumedFrom": {"step": 10, "attempt": 3}}
    status = {"attempt": 3, "resumeApplied": applied("step:10", 3), "checkpoints": ckpts}
    choice = resumeplan.choose(make({"step": 10}, status=status), attempt=4, now=jobs.at(200))
    assert choice == resumeplan.Choice(target=LATEST)


def test_a_commit_since_the_applied_attempt_started_counts_as_taken() -> None:
    ckpts = committed(12, "2026-11-22T12:00:30Z")
    status = {"attempt": 3, "resumeApplied": applied("step:10", 3), "checkpoints": ckpts}
    choice = resumeplan.choose(make({"step": 10}, status=status), attempt=4, now=jobs.at(200))
    assert choice.target == LATEST


def test_a_crash_before_the_load_retries_the_target() -> None:
    # resumedFrom is the previous lineage's; the newest commit predates the request.
    ckpts = {**committed(35), "resumedFrom": {"step": 20, "attempt": 1}}
    status = {"attempt": 3, "resumeApplied": applied("step:10", 3), "checkpoints": ckpts}
    choice = resumeplan.choose(make({"step": 10}, status=status), attempt=4, now=jobs.at(200))
    assert choice.target == STEP10 and choice.explicit and choice.record is None


def test_a_lost_pod_of_the_applying_attempt_gets_the_same_target() -> None:
    ckpts = {**committed(35), "resumedFrom": {"step": 10, "attempt": 3}}
    status = {"attempt": 3, "resumeApplied": applied("step:10", 3), "checkpoints": ckpts}
    choice = resumeplan.choose(make({"step": 10}, status=status), attempt=3, now=jobs.at(200))
    assert choice.target == STEP10


def test_the_same_target_again_needs_a_new_request() -> None:
    ckpts = {**committed(35), "resumedFrom": {"step": 10, "attempt": 3}}
    status = {
        "attempt": 5,
        "resumeApplied": applied("step:10", 3, request="r1"),
        "checkpoints": ckpts,
    }
    same = make({"step": 10}, status=status, request="r1", generation=9)
    assert resumeplan.choose(same, attempt=6, now=jobs.at(300)).target == LATEST
    again = make({"step": 10}, status=status, request="r2", generation=9)
    choice = resumeplan.choose(again, attempt=6, now=jobs.at(300))
    assert choice.target == STEP10
    assert choice.record is not None and choice.record.request == "r2"


def test_an_unrelated_edit_never_reapplies_the_target() -> None:
    # suspend/unsuspend or an image bump: a new generation, the same request.
    ckpts = {**committed(35), "resumedFrom": {"step": 10, "attempt": 3}}
    status = {"attempt": 3, "resumeApplied": applied("step:10", 3), "checkpoints": ckpts}
    job = make({"step": 10}, status=status, generation=12)
    assert resumeplan.choose(job, attempt=4, now=jobs.at(400)).target == LATEST


def test_a_job_that_committed_before_any_record_keeps_latest() -> None:
    status = {"attempt": 4, "checkpoints": committed(35)}
    choice = resumeplan.choose(make({"uri": URI}, status=status), attempt=5, now=jobs.at(10))
    assert choice.target == LATEST
    assert choice.record is not None and choice.record.attempt is None
    recorded = make(
        {"uri": URI},
        status={**status, "resumeApplied": applied(URI, None)},
    )
    assert resumeplan.choose(recorded, attempt=6, now=jobs.at(20)).target == LATEST


def test_a_long_request_annotation_is_compared_by_its_prefix() -> None:
    long = "x" * 300
    choice = resumeplan.choose(make({"step": 10}, request=long), attempt=1, now=jobs.T0)
    assert choice.record is not None and choice.record.request == long[:128]


def test_the_resumed_attempt_records_the_request_and_says_so() -> None:
    status = {
        "phase": "Suspended",
        "attempt": 2,
        "restarts": 0,
        "resumeApplied": applied("latest", 1),
        "checkpoints": committed(35),
    }
    job = make({"step": 10}, status=status, request="r1", generation=7)
    result = jobplan.plan(job=job, observed=jobobserve.Observed(pods=()), now=jobs.at(500))
    assert result.status is not None
    assert result.status["resumeApplied"] == {
        "target": "step:10",
        "request": "r1",
        "generation": 7,
        "attempt": 3,
        "time": "2026-11-22T12:08:20Z",
    }
    env = [
        {e["name"]: e.get("value") for e in c["spec"]["containers"][0]["env"]}
        for c in result.creates
        if c["kind"] == "Pod"
    ]
    assert [e[podenv.RESUME_FROM] for e in env] == ["step:10", "step:10"]
    messages = [e.message for e in result.events]
    assert any("resuming from step:10" in m and "generation 7, applied once" in m for m in messages)
    # The status patch applied and attempt 3 loaded step 10: attempt 4 resumes from latest.
    raw = jobs.patched(job, result).model_dump(mode="json", by_alias=True, exclude_none=True)
    raw["status"]["checkpoints"]["resumedFrom"] = {"step": 10, "attempt": 3}
    loaded = trainingjob.TrainingJob.model_validate(raw)
    assert resumeplan.choose(loaded, attempt=4, now=jobs.at(600)).target == LATEST


def test_the_lifecycle_helper_gives_the_next_attempts_target() -> None:
    job = make({"step": 10}, status={"attempt": 2, "resumeApplied": applied("latest", 1)})
    assert decisions.resume_target(job, now=datetime.datetime.now(datetime.UTC)) == STEP10
