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
  (runtime ray) or `status.torchrun.group` (runtime torchrun) is newer than
  our group (the Ray driver bumps it before it starts a new rank-actor group
  in place; rank 0 of a torchrun worker group restarted in place before its
  first commit, `cairn.checkpoint.torchrun_group`). This is what fences a zombie pod (or a zombie
  rank actor) on a node-local volume, where no local file is shared with the
  new writer.

A writer's identity is (attempt, group), ordered as a pair; torchrun's first
worker group and the first Ray group are group 0, so their records and checks
are unchanged.

A fence file of ANOTHER job does not block a starting job (a job re-created
on an old volume starts cleanly and takes the file over); a running writer
whose file was taken over by another job is refused, since the newer starter
owns the volume now.

The API server can disappear (a brownout) without stalling training: the
local commit asks it with a short wait (`commit_wait_seconds`; the read goes
on in a daemon thread and the next check reuses it) and, unanswered, lets
the local fence and the exclusive rename decide: a commit never replaces a
committed step either way. The remote commit (the manifest put, which other
attempts and jobs see) is stricter: `check_strict` retries (bounded) and,
when the API server still cannot say, raises `FenceUnverifiedError`, so the
upload round fails and the put is retried later with backoff.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import os
import pathlib
import threading
import typing

from cairn.checkpoint import errors, layout

log = logging.getLogger(__name__)

FENCE_NAME = ".cairn-fence"


class Fence(typing.Protocol):
    """Refuses (FencedError) a commit by `attempt` that is no longer current."""

    def check(self, attempt: int) -> None: ...


class FenceUnverifiedError(errors.TransportError):
    """The API server could not be read: a remote commit must wait."""


def check_strict(fence: Fence, attempt: int) -> None:
    """Before a remote commit: a fence that can be unsure (`ApiFence`) must be sure."""
    strict = getattr(fence, "check_strict", None)
    if strict is not None:
        strict(attempt)
    else:
        fence.check(attempt)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class FenceRecord:
    job_uid: str | None
    attempt: int
    group: int = 0
    members: str | None = None
    """Runtime torchrun: who ran `group` (`torchrun_group.members`: each rank's pod
    and restart count), so a later manager can tell the same group from a new one."""


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
        members = doc.get("members")
        return FenceRecord(
            job_uid=uid if isinstance(uid, str) else None,
            attempt=doc["attempt"],
            group=group if isinstance(group, int) and not isinstance(group, bool) else 0,
            members=members if isinstance(members, str) else None,
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


def raise_local(
    root: pathlib.Path,
    *,
    job_uid: str | None,
    attempt: int,
    group: int = 0,
    members: str | None = None,
) -> None:
    """Record that (`attempt`, `group`) of `job_uid` started; refuses if a newer one of ours did.

    A record of another job is replaced: a re-created job starts cleanly.
    `members` (runtime torchrun) is kept with the record.
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
        same = (current.attempt, current.group, current.members) == (attempt, group, members)
        if same and current.job_uid == job_uid:
            return
    tmp = root / f"{FENCE_NAME}.tmp-{os.getpid()}"
    with tmp.open("w") as stream:
        record: dict[str, typing.Any] = {"job_uid": job_uid, "attempt": attempt}
        if group:
            record["group"] = group  # group 0 keeps torchrun's record
        if members is not None:
            record["members"] = members
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
    # status.<runtime>.group counts within the current attempt (the operator
    # resets it to 0 with a new attempt), so it only compares at our own attempt.
    if current is None or current == attempt:
        key = _group_key(job, status)
        current_group = (status.get(key) or {}).get("group")
        if isinstance(current_group, int) and current_group > group:
            unit = "rank-actor group" if key == "ray" else "torchrun worker group"
            return (
                f"the TrainingJob's {unit} is {current_group} "
                f"(we are group {group} of attempt {attempt})"
            )
    return None


def _group_key(job: dict[str, typing.Any], status: dict[str, typing.Any]) -> str:
    """`ray` or `torchrun`: the job's runtime (the API server defaults it);
    without a spec (an older reader's object), whichever status has."""
    runtime = (job.get("spec") or {}).get("runtime")
    if runtime is None:
        return "ray" if "ray" in status else "torchrun"
    return "ray" if runtime == "ray" else "torchrun"


@dataclasses.dataclass(kw_only=True, slots=True)
class ApiFence:
    """The authoritative fence: the job's current UID and attempt from the API server."""

    get_job: GetJob
    job_uid: str
    group: int = 0
    """The writer's group (`status.ray.group` or `status.torchrun.group`)."""
    tries: int = 3
    """Reads before `check_strict` gives up (FenceUnverifiedError)."""
    backoff_seconds: float = 1.0
    commit_wait_seconds: float = 2.0
    """How long a local commit waits for the API server's answer."""
    read_wait_seconds: float = 15.0
    """How long `check_strict` waits for one read (above the reader's own timeout)."""
    _pending: concurrent.futures.Future[object] | None = None
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def check(self, attempt: int) -> None:
        """Local commit: refuses when the API server says so; unanswered, passes."""
        job = self._read(wait=self.commit_wait_seconds)
        if job is _UNREACHABLE:
            log.warning(
                "fence: the API server did not answer within %.0fs; the local fence and the "
                "exclusive commit decide (the remote commit waits for it)",
                self.commit_wait_seconds,
            )
            return
        self._refuse(job, attempt)

    def check_strict(self, attempt: int) -> None:
        """Remote commit: the API server must answer (bounded retries), else
        FenceUnverifiedError: the put waits for a later round."""
        for index in range(self.tries):
            job = self._read(wait=self.read_wait_seconds)
            if job is not _UNREACHABLE:
                self._refuse(job, attempt)
                return
            if index + 1 < self.tries:
                threading.Event().wait(self.backoff_seconds * (index + 1))
        raise FenceUnverifiedError(
            f"attempt {attempt}: the API server could not be read to check the fence; "
            "the remote commit waits for it"
        )

    def _refuse(self, job: object, attempt: int) -> None:
        reason = job_stale_reason(
            typing.cast(dict[str, typing.Any] | None, job),
            job_uid=self.job_uid,
            attempt=attempt,
            group=self.group,
        )
        if reason is not None:
            raise errors.FencedError(f"attempt {attempt} may not commit: {reason} (fenced)")

    def _read(self, *, wait: float) -> object:
        """The job, or _UNREACHABLE after `wait` seconds or on any error. One
        read at a time, in a daemon thread: an unanswered one is reused by
        the next call instead of piling up connections to a hung server."""
        with self._lock:
            if self._pending is None:
                self._pending = _start_read(self.get_job)
            pending = self._pending
        try:
            job = pending.result(timeout=wait)
        except concurrent.futures.TimeoutError:
            return _UNREACHABLE
        except Exception as exc:  # any transport/API error: unreachable for now
            log.info("fence: reading the TrainingJob failed: %s", exc)
            job = _UNREACHABLE
        with self._lock:
            if self._pending is pending:
                self._pending = None
        return job


_UNREACHABLE = object()


def _start_read(get_job: GetJob) -> concurrent.futures.Future[object]:
    future: concurrent.futures.Future[object] = concurrent.futures.Future()

    def read() -> None:
        try:
            future.set_result(get_job())
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=read, name="cairn-fence-read", daemon=True).start()
    return future


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class AllOf:
    """Every fence must pass."""

    fences: tuple[Fence, ...]

    def check(self, attempt: int) -> None:
        for fence in self.fences:
            fence.check(attempt)

    def check_strict(self, attempt: int) -> None:
        for fence in self.fences:
            check_strict(fence, attempt)
