"""Fencing: a writer of a stale attempt (or of a deleted job) never commits.

Two authorities, both checked right before the local commit (the rename)
and before the remote manifest put:

- the local fence file `<root>/.cairn-fence`, JSON `{"job_uid", "attempt"}`
  plus `"group"` for a Ray rank-actor group after an in-place restart
  (an older Cairn wrote a bare integer: read as "this job, that attempt"),
  raised by every attempt when its manager starts. It works without API
  access (library use, tests) and on every rank's own volume;
- `ApiFence`: rank 0 GETs its TrainingJob and refuses when the job is gone
  (or being deleted), its `metadata.uid` is not ours (deleted and re-created), or
  `status.attempt` is newer than ours, or, at our attempt, `status.ray.group`
  is newer than our group (the Ray driver bumps it before it starts a new
  rank-actor group in place). This is what fences a zombie pod (or a zombie
  rank actor) on a node-local volume, where no local file is shared with the
  new writer.

A writer's identity is (attempt, group), ordered as a pair; torchrun and the
first Ray group are group 0, so their records and checks are unchanged.

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
    group: int = 0


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
        group = doc.get("group", 0)
        return FenceRecord(
            job_uid=uid if isinstance(uid, str) else None,
            attempt=doc["attempt"],
            group=group if isinstance(group, int) and not isinstance(group, bool) else 0,
        )
    raise errors.CheckpointError(f"{path}: unexpected content {raw[:100]!r}")


def stale_reason(
    record: FenceRecord | None, *, job_uid: str | None, attempt: int, group: int = 0
) -> str | None:
    """Why (`attempt`, `group`) of `job_uid` may not commit under `record`; None if it may. Pure."""
    if record is None:
        return None
    if record.job_uid is not None and job_uid is not None and record.job_uid != job_uid:
        return f"job {record.job_uid} has taken over this volume (we are job {job_uid})"
    if record.attempt > attempt:
        return f"attempt {record.attempt} has started (we are attempt {attempt})"
    if record.attempt == attempt and record.group > group:
        return (
            f"rank-actor group {record.group} of attempt {attempt} has started "
            f"(we are group {group})"
        )
    return None


def raise_local(root: pathlib.Path, *, job_uid: str | None, attempt: int, group: int = 0) -> None:
    """Record that (`attempt`, `group`) of `job_uid` started; refuses if a newer one of ours did.

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
        if (current.attempt, current.group) > (attempt, group):
            raise errors.FencedError(
                f"attempt {attempt} group {group} started after newer attempt "
                f"{current.attempt} group {current.group} (fenced)"
            )
        if (current.attempt, current.group) == (attempt, group) and current.job_uid == job_uid:
            return
    tmp = root / f"{FENCE_NAME}.tmp-{os.getpid()}"
    with tmp.open("w") as stream:
        record: dict[str, typing.Any] = {"job_uid": job_uid, "attempt": attempt}
        if group:
            record["group"] = group  # group 0 keeps torchrun's record
        stream.write(json.dumps(record) + "\n")
        stream.flush()
        os.fsync(stream.fileno())
    tmp.replace(root / FENCE_NAME)
    layout.fsync_dir(root)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LocalFence:
    """The fence file of one checkpoint root (every rank's own volume)."""

    root: pathlib.Path
    job_uid: str | None
    group: int = 0
    """The writer's rank-actor group (Ray); 0 under torchrun."""

    def check(self, attempt: int) -> None:
        reason = stale_reason(
            read_record(self.root), job_uid=self.job_uid, attempt=attempt, group=self.group
        )
        if reason is not None:
            raise errors.FencedError(f"attempt {attempt} may not commit: {reason} (fenced)")


GetJob = typing.Callable[[], dict[str, typing.Any] | None]
"""Returns the TrainingJob object, None when it does not exist (404); raises otherwise."""


def job_stale_reason(
    job: dict[str, typing.Any] | None, *, job_uid: str, attempt: int, group: int = 0
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
    status = job.get("status") or {}
    current = status.get("attempt")
    if isinstance(current, int) and current > attempt:
        return f"the TrainingJob is at attempt {current} (we are attempt {attempt})"
    # status.ray.group counts within the current attempt (the operator resets
    # it to 0 with a new attempt), so it only compares at our own attempt.
    if current is None or current == attempt:
        current_group = (status.get("ray") or {}).get("group")
        if isinstance(current_group, int) and current_group > group:
            return (
                f"the TrainingJob's rank-actor group is {current_group} "
                f"(we are group {group} of attempt {attempt})"
            )
    return None


@dataclasses.dataclass(kw_only=True, slots=True)
class ApiFence:
    """The authoritative fence: the job's current UID and attempt from the API server."""

    get_job: GetJob
    job_uid: str
    group: int = 0
    """The writer's rank-actor group (Ray, `status.ray.group`); 0 under torchrun."""
    tries: int = 3
    backoff_seconds: float = 1.0

    def check(self, attempt: int) -> None:
        job = self._read()
        if job is _UNREACHABLE:
            return
        reason = job_stale_reason(
            typing.cast(dict[str, typing.Any] | None, job),
            job_uid=self.job_uid,
            attempt=attempt,
            group=self.group,
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
