"""s3plan.plan_job: the S3 pass's plan step reads the job and its status.

Covers: the step the lineage resumed from (``status.checkpoints.resumedFrom``)
and the step the spec asks to resume from are protected from remote
retention; a manifest-less folder the writer reports in flight is kept, one
below it that nothing reports is deleted as an abandoned partial; without
``retention.remote`` nothing is deleted. Pure: hand-made observations.
"""

from typing import Any

from cairn.api import jobstatus
from cairn.api import manifest as manifest_mod
from cairn.operator.core import jobobserve, s3plan

from . import jobs

OBJ = s3plan.RemoteObject
FILES = {"__0_0.distcp": (100, "0a0b0c0d")}


def _observation(committed: list[int], partial: list[int]) -> s3plan.Observation:
    listing: dict[int, dict[str, s3plan.RemoteObject]] = {}
    manifests: dict[int, manifest_mod.Manifest | s3plan.ManifestError] = {}
    for step in committed:
        listing[step] = {p: OBJ(size=s, crc32c=c) for p, (s, c) in FILES.items()}
        listing[step][manifest_mod.MANIFEST_NAME] = OBJ(size=300)
        manifests[step] = manifest_mod.Manifest(
            step=step,
            world_size=1,
            attempt=1,
            created_at=0.0,
            files=tuple(
                manifest_mod.FileEntry(path=p, size=s, crc32c=c, rank=0)
                for p, (s, c) in FILES.items()
            ),
            job_uid=jobs.JOB_UID,  # the writer records its job (a job with no key Secret)
        )
    for step in partial:
        listing[step] = {"__0_0.distcp": OBJ(size=7)}
    return s3plan.Observation(listing=listing, manifests=manifests)


def _plan(
    *, status: dict[str, Any], resume_step: int | None = None, remote: bool = True
) -> s3plan.RemotePlan:
    checkpoint: dict[str, Any] = {"upload": {"uri": "s3://bucket/run"}}
    if remote:
        checkpoint["retention"] = {"remote": {"keepLast": 1}}
    if resume_step is not None:
        checkpoint["resume"] = {"step": resume_step}
    raw = jobs.body(checkpoint=checkpoint)
    raw["status"] = status
    job = jobs.job(status, checkpoint=checkpoint)
    parsed: jobstatus.TrainingJobStatus = jobobserve.parse_status(raw)
    return s3plan.plan_job(
        job=job,
        status=parsed,
        observation=_observation([10, 20, 30, 40], partial=[5, 35]),
    )


def test_resumed_from_and_spec_resume_step_are_protected() -> None:
    status = {"checkpoints": {"resumedFrom": {"step": 10}}}
    todo = _plan(status=status, resume_step=20)
    assert [d.step for d in todo.deletions if not d.partial] == [30]
    assert todo.kept == (10, 20, 40)


def test_in_flight_folder_is_kept_and_an_unreported_partial_deleted() -> None:
    status = {"checkpoints": {"inFlight": [{"step": 35, "stage": "uploading"}]}}
    todo = _plan(status=status)
    assert [d.step for d in todo.deletions if d.partial] == [5]
    assert 35 not in todo.deleted_steps


def test_without_remote_retention_nothing_is_deleted() -> None:
    todo = _plan(status={}, remote=False)
    assert todo.deletions == ()
    assert todo.kept == (10, 20, 30, 40)
