"""Which checkpoint an attempt resumes from: the spec's explicit target once, then latest.

Pure. ``spec.checkpoint.resume`` is a request, not a standing order: an
explicit target (``step``, ``uri``, ``none``) applies to the next attempt
started after it was set (by ``kubectl cairn resume``, ``kubectl edit`` or
GitOps) and is recorded in ``status.resumeApplied`` (operator-owned; the
status policy keeps the trainer out of it). The record is written at every
attempt start whose request differs from it, ``latest`` included, so a later
edit is seen as one. A job that committed before any record (an older
operator) gets one that counts as applied. Every later attempt resumes from
``latest``, so a crash after a rollback to step 10 resumes from the newest
step of the new lineage, not from 10 again. A request is the pair (target,
``cairn.dev/resume-request`` annotation): the same target is applied again
only when the annotation changes.

The explicit target is handed out again (not yet taken effect) while:

- the attempt being (re)created is the one it was applied to (a lost pod of
  that attempt is recreated with the same target as its peers);
- the job has committed nothing at all (an import that crashed before its
  first save is retried, as before this record existed);
- the applied attempt has neither loaded it (``checkpoints.resumedFrom``
  of that attempt or later) nor committed a step since it started: a crash
  before the load retries the rollback instead of jumping to the old newest.
"""

import dataclasses
import datetime

from cairn.api import checkpointspec, jobstatus, podenv, trainingjob

LATEST = podenv.ResumeTarget(kind="latest")
REQUEST_CHARS = 128
"""The annotation's characters compared and recorded (``ResumeApplied.request``)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Choice:
    """The target for the attempt, and the record to write (None: keep status as is)."""

    target: podenv.ResumeTarget
    record: jobstatus.ResumeApplied | None = None
    explicit: bool = False
    """True when the target is the spec's explicit one (for the event message)."""


def spec_target(resume: checkpointspec.Resume) -> podenv.ResumeTarget:
    """The spec's form as the pod env carries it."""
    if resume.step is not None:
        return podenv.ResumeTarget(kind="step", step=resume.step, sha256=resume.sha256)
    if resume.uri is not None:
        return podenv.ResumeTarget(kind="uri", uri=resume.uri, sha256=resume.sha256)
    if resume.none:
        return podenv.ResumeTarget(kind="none")
    return LATEST


def request_of(job: trainingjob.TrainingJob) -> str | None:
    """The job's ``cairn.dev/resume-request`` annotation (None: unset)."""
    value = (job.metadata.annotations or {}).get(checkpointspec.RESUME_REQUEST_ANNOTATION)
    return None if value is None else value[:REQUEST_CHARS]


def _committed_anything(ckpts: jobstatus.CheckpointsStatus | None) -> bool:
    return ckpts is not None and bool(ckpts.last_committed or ckpts.last_uploaded)


def _taken_effect(
    record: jobstatus.ResumeApplied, ckpts: jobstatus.CheckpointsStatus | None
) -> bool:
    """The applied attempt loaded the target, or the job committed since it started
    (a record without an attempt was never applied by this operator: taken)."""
    if record.attempt is None:
        return True
    if ckpts is None:
        return False
    loaded = ckpts.resumed_from
    if loaded is not None and loaded.attempt is not None and loaded.attempt >= record.attempt:
        return True
    committed = ckpts.last_committed
    return (
        committed is not None
        and committed.time is not None
        and record.time is not None
        and committed.time >= record.time
    )


def _recorded(
    job: trainingjob.TrainingJob, *, wanted: str, attempt: int | None, now: datetime.datetime
) -> jobstatus.ResumeApplied:
    return jobstatus.ResumeApplied(
        target=wanted,
        request=request_of(job),
        generation=job.metadata.generation,
        attempt=attempt,
        time=now,
    )


def choose(job: trainingjob.TrainingJob, *, attempt: int, now: datetime.datetime) -> Choice:
    """The resume target for ``attempt`` (being started or having pods recreated)."""
    target = spec_target(job.spec.checkpoint.resume)
    wanted = podenv.format_resume(target)
    record = job.status.resume_applied
    ckpts = job.status.checkpoints
    if record is None and _committed_anything(ckpts):
        # Committed before any record (an older operator): the spec's target
        # was applied back then; record it as such, never apply it again.
        return Choice(target=LATEST, record=_recorded(job, wanted=wanted, attempt=None, now=now))
    if record is None or (record.target, record.request) != (wanted, request_of(job)):
        fresh = _recorded(job, wanted=wanted, attempt=attempt, now=now)
        return Choice(target=target, record=fresh, explicit=target.kind != "latest")
    if target.kind == "latest":
        return Choice(target=LATEST)
    if (
        record.attempt == attempt
        or not _committed_anything(ckpts)
        or not _taken_effect(record, ckpts)
    ):
        return Choice(target=target, explicit=True)
    return Choice(target=LATEST)


def recreate_target(
    job: trainingjob.TrainingJob, *, attempt: int, now: datetime.datetime
) -> podenv.ResumeTarget:
    """What a pod recreated in the current attempt resumes from: like its peers
    (a missing pod while Starting, a lost pod ``replaceplan`` replaces in place),
    so it gets the same spec as the one it replaces; a request made during the
    attempt waits for the next attempt's start."""
    choice = choose(job, attempt=max(attempt, 1), now=now)
    return LATEST if choice.record is not None else choice.target
