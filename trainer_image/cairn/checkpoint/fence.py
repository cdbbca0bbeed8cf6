"""Fencing: a writer of a stale attempt (or of a deleted job) never commits.

Two authorities, both checked right before the local commit (the rename)
and before the remote manifest put:

- the local fence file `<root>/.cairn-fence`, JSON `{"job_uid", "attempt"}`
  (an older Cairn wrote a bare integer: read as "this job, that attempt"),
  raised by every attempt when its manager starts. It works without API
  access (library use, tests) and on every rank's own volume;
- `ApiFence`: rank 0 GETs its TrainingJob and refuses when the job is gone
  (or being deleted), its `metadata.uid` is not ours (deleted and re-created), or
  `status.attempt` is newer than ours. This is what fences a zombie pod on a
  node-local volume, where no local file is shared with the new attempt.

A fence file of ANOTHER job does not block a starting job (a job re-created
on an old volume starts cleanly and takes the file over); a running writer
whose file was taken over by another job is refused, since the newer starter
owns the volume now. When the API server cannot be reached (after bounded
retries) the API fence logs and lets the local fence and the exclusive
rename decide: a commit never replaces a committed step either way.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import time
import typing

from cairn.checkpoint import errors, layout

log = logging.getLogger(__name__)

FENCE_NAME = ".cairn-fence"


class Fence(typing.Protocol):
    """Refuses (FencedError) a commit by `attempt` that is no longer current."""

    def check(self, attempt: int) -> None: ...


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class FenceRecord:
    job_uid: str | None
    attempt: int


def read_record(root: pathlib.Path) -> FenceRecord | None:
    """The fence file's record; None when there is none. Raises CheckpointError if garbled."""
    path = root / FENCE_NAME
    try:
        raw = path.read_text().strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise errors.CheckpointError(f"{path} cannot be read: {exc}") from exc
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise errors.CheckpointError(f"{path} is neither JSON nor an integer") from exc
    if isinstance(doc, int) and not isinstance(doc, bool):
        return FenceRecord(job_uid=None, attempt=doc)  # written by an older Cairn
    if isinstance(doc, dict) and isinstance(doc.get("attempt"), int):
        uid = doc.get("job_uid")
        return FenceRecord(job_uid=uid if isinstance(uid, str) else None, attempt=doc["attempt"])
    raise errors.CheckpointError(f"{path}: unexpected content {raw[:100]!r}")


def stale_reason(record: FenceRecord | None, *, job_uid: str | None, attempt: int) -> str | None:
    """Why `attempt` of `job_uid` may not commit under `record`; None if it may. Pure."""
    if record is None:
        return None
    if record.job_uid is not None and job_uid is not None and record.job_uid != job_uid:
        return f"job {record.job_uid} has taken over this volume (we are job {job_uid})"
    if record.attempt > attempt:
        return f"attempt {record.attempt} has started (we are attempt {attempt})"
    return None


def raise_local(root: pathlib.Path, *, job_uid: str | None, attempt: int) -> None:
    """Record that `attempt` of `job_uid` started; refuses if a newer attempt of ours did.

    A record of another job is replaced: a re-created job starts cleanly.
    """
    current = read_record(root)
    other_job = (
        current is not None
        and current.job_uid is not None
        and job_uid is not None
        and current.job_uid != job_uid
    )
    if current is not None and not other_job:
        if current.attempt > attempt:
            raise errors.FencedError(
                f"attempt {attempt} started after newer attempt {current.attempt} (fenced)"
            )
        if current.attempt == attempt and current.job_uid == job_uid:
            return
    tmp = root / f"{FENCE_NAME}.tmp-{os.getpid()}"
    with tmp.open("w") as stream:
        stream.write(json.dumps({"job_uid": job_uid, "attempt": attempt}) + "\n")
        stream.flush()
        os.fsync(stream.fileno())
    tmp.replace(root / FENCE_NAME)
    layout.fsync_dir(root)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LocalFence:
    """The fence file of one checkpoint root (every rank's own volume)."""

    root: pathlib.Path
    job_uid: str | None

    def check(self, attempt: int) -> None:
        reason = stale_reason(read_record(self.root), job_uid=self.job_uid, attempt=attempt)
        if reason is not None:
            raise errors.FencedError(f"attempt {attempt} may not commit: {reason} (fenced)")


GetJob = typing.Callable[[], dict[str, typing.Any] | None]
"""Returns the TrainingJob object, None when it does not exist (404); raises otherwise."""


def job_stale_reason(
    job: dict[str, typing.Any] | None, *, job_uid: str, attempt: int
) -> str | None:
    """Why the API server's view of the job refuses `attempt`; None if current. Pure."""
    if job is None:
        return "the TrainingJob no longer exists"
    meta = job.get("metadata") or {}
    uid = meta.get("uid")
    if uid != job_uid:
        return f"the TrainingJob was re-created (uid {uid}, we are {job_uid})"
    if meta.get("deletionTimestamp"):
        # Deleted, held only by a finalizer: the job is gone for its writers.
        return "the TrainingJob is being deleted"
    current = (job.get("status") or {}).get("attempt")
    if isinstance(current, int) and current > attempt:
        return f"the TrainingJob is at attempt {current} (we are attempt {attempt})"
    return None


@dataclasses.dataclass(kw_only=True, slots=True)
class ApiFence:
    """The authoritative fence: the job's current UID and attempt from the API server."""

    get_job: GetJob
    job_uid: str
    tries: int = 3
    backoff_seconds: float = 1.0

    def check(self, attempt: int) -> None:
        job = self._read()
        if job is _UNREACHABLE:
            return
        reason = job_stale_reason(
            typing.cast(dict[str, typing.Any] | None, job), job_uid=self.job_uid, attempt=attempt
        )
        if reason is not None:
            raise errors.FencedError(f"attempt {attempt} may not commit: {reason} (fenced)")

    def _read(self) -> object:
        for index in range(self.tries):
            try:
                return self.get_job()
            except Exception as exc:  # any transport/API error: bounded retries
                if index + 1 == self.tries:
                    log.warning(
                        "fence: the API server could not be read (%s); the local fence and "
                        "the exclusive commit decide",
                        exc,
                    )
                    return _UNREACHABLE
                time.sleep(self.backoff_seconds * (index + 1))
        return _UNREACHABLE


_UNREACHABLE = object()


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class AllOf:
    """Every fence must pass."""

    fences: tuple[Fence, ...]

    def check(self, attempt: int) -> None:
        for fence in self.fences:
            fence.check(attempt)
