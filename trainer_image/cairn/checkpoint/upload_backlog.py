"""The upload phase with a backlog: committed steps that are not in S3 yet.

A step is committed locally first; uploads run apart from saves, in rounds
of the upload worker (`cairn.checkpoint.uploader`), so a slow or hung store
never holds a save. An upload can fail (S3 down, credentials expired, no
progress for `stall_seconds`). With `upload_on_failure="Continue"` (the
default) training goes on: the step stays committed on the volume without
its `.uploaded` marker, and is retried in later rounds, oldest first, with
exponential backoff between rounds. Rank 0 decides what a round tries (pure
`plan_round` over its volume's not-uploaded committed steps) and broadcasts
it, so every rank uploads its own files of the same steps in the same order;
rank 0 puts each manifest last (`pipeline`'s upload of one step) and
broadcasts the result of each step.

What the user sees: an `upload_failed` event per failed round (the status
tracker turns it into `status.checkpoints.uploadError` = {message, time, step,
backlog}, and the operator into the `UploadFailing` condition), an `uploaded`
event per step that made it (which clears the error once nothing is left).
Local retention never deletes a step that is not uploaded
(`cairn.api.retention`), and says so when that exceeds keepLast/maxBytes.

With `upload_on_failure="Fail"` a failed upload raises (the manager re-raises
it on the next call, and the trainer stops).
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import threading
import time
import typing

from cairn.api import manifest as manifest_mod
from cairn.checkpoint import coordinator as coordinator_mod
from cairn.checkpoint import errors, events, layout, options

log = logging.getLogger(__name__)

MAX_BACKOFF_FACTOR = 60
"""The wait between rounds grows to at most this many `upload_retry_seconds`."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Backoff:
    """Rank 0's memory of failed rounds (one per manager)."""

    failures: int = 0
    next_try: float = 0.0
    """time.monotonic() before which no new round is tried."""
    last_error: str | None = None


def due(state: Backoff, *, now: float) -> bool:
    """Whether a round may be tried now. Pure."""
    return state.failures == 0 or now >= state.next_try


def after_failure(state: Backoff, *, now: float, error: str, initial: float) -> Backoff:
    """The state after a failed round: the wait doubles, bounded. Pure."""
    wait = initial * min(MAX_BACKOFF_FACTOR, 2**state.failures)
    return Backoff(failures=state.failures + 1, next_try=now + wait, last_error=error)


def plan_round(*, pending: list[int], due_now: bool) -> list[int]:
    """Steps a round uploads, oldest first: every committed step not uploaded
    yet; none while backing off (new steps wait in the backlog). Pure."""
    if not due_now:
        return []
    return sorted(set(pending))


def pending_steps(
    root: pathlib.Path, *, job_uid: str | None, keyring: manifest_mod.Keyring | None = None
) -> list[int]:
    """This job's committed steps on this volume without the uploaded marker,
    and not local-only (`cairn.checkpoint.tiers`: never owed an upload).

    The marker is looked at before the manifest: rotation (the writer thread)
    deletes only uploaded steps, manifest first and then the marker with the
    rest, so a step that had no marker when looked at is never being deleted,
    while "committed, then no marker" could be an uploaded step caught half
    deleted, planned again and failed as "no valid manifest"."""
    return sorted(
        step
        for step, folder in layout.step_dirs(root).items()
        if not layout.is_uploaded(folder)
        and not layout.is_local_only(folder)
        and layout.classify(folder, job_uid=job_uid, keyring=keyring) == "committed"
    )


def promote_newest(
    root: pathlib.Path, *, job_uid: str | None, keyring: manifest_mod.Keyring | None = None
) -> int | None:
    """Make this volume's newest committed step owed an upload when it is
    local-only (`cairn.checkpoint.tiers`: a clean end uploads the last step);
    the step promoted, else None."""
    committed = layout.committed_steps(root, job_uid=job_uid, keyring=keyring)
    if committed and layout.clear_local_only(layout.step_dir(root, committed[-1])):
        return committed[-1]
    return None


def mark_copy_uploaded(folder: pathlib.Path, *, rank: int, step: int) -> bool:
    """Mark this rank's copy of an uploaded step; False (logged) when the folder
    is gone: deleted from outside the writer, it has nothing left to rotate,
    and the upload worker goes on with the next step instead of failing."""
    try:
        layout.mark_uploaded(folder)
    except FileNotFoundError:
        log.warning(
            "rank %d: step %d was uploaded but its folder %s is gone (deleted outside the "
            "writer); nothing to mark",
            rank,
            step,
            folder,
        )
        return False
    return True


class UploadOne(typing.Protocol):
    """Upload this rank's files of one committed step; rank 0 also puts the
    manifest and marks the step uploaded. Raises on failure; returns bytes
    (rank 0: the whole step's)."""

    def __call__(
        self, *, folder: pathlib.Path, manifest: manifest_mod.Manifest, key: str
    ) -> int: ...


@dataclasses.dataclass(kw_only=True, slots=True)
class Backlog:
    """The backlog's state across the saves of one manager (rank 0 uses it)."""

    opts: options.CheckpointOptions
    coordinator: coordinator_mod.Coordinator
    callbacks: typing.Sequence[events.ProgressCallback]
    shared: bool = True
    """Whether all ranks see one volume (else each marks its own folders)."""
    state: Backoff = dataclasses.field(default_factory=Backoff)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    clock: typing.Callable[[], float] = time.monotonic

    def _emit(self, phase: events.Phase, step: int, **kw: typing.Any) -> None:
        event = events.ProgressEvent(phase=phase, step=step, rank=self.coordinator.rank, **kw)
        events.emit(self.callbacks, event)

    def plan(self, *, force: bool) -> list[int]:
        """Rank 0: the steps of the next round (`force`: ignore the backoff)."""
        pending = pending_steps(
            self.opts.directory, job_uid=self.opts.job_uid, keyring=self.opts.manifest_keyring
        )
        with self.lock:
            due_now = force or due(self.state, now=self.clock())
        if not due_now and pending:
            log.info("upload backlog %s: backing off after %s", pending, self.state.last_error)
        return plan_round(pending=pending, due_now=due_now)

    def pending(self) -> list[int]:
        """Rank 0: committed steps not uploaded yet (what a round would try)."""
        return pending_steps(self.opts.directory, job_uid=self.opts.job_uid)

    def next_try(self) -> float | None:
        """Rank 0: time.monotonic() of the next due round after failures, else None."""
        with self.lock:
            return self.state.next_try if self.state.failures else None

    def run(
        self,
        *,
        tag: str,
        steps: list[int],
        upload_one: UploadOne,
        ready: typing.Callable[[pathlib.Path, str], None] = lambda folder, key: None,
    ) -> list[int]:
        """One round of the agreed `steps` on every rank (collective); returns
        the steps uploaded. `ready(folder, key)` waits until this rank's copy of
        a step is committed (node-local volumes commit after rank 0), or rank 0
        gave its verdict on the step (`<key>/result`) without it."""
        coord = self.coordinator
        done: list[int] = []
        for step in steps:
            t0 = time.monotonic()
            folder = layout.step_dir(self.opts.directory, step)
            key = f"{tag}/{step}"
            error: str | None = None
            fenced: errors.FencedError | None = None
            sent = 0
            try:
                ready(folder, key)
                manifest = layout.read_manifest(folder)
                sent = upload_one(folder=folder, manifest=manifest, key=key)
            except errors.FencedError as exc:
                fenced = exc  # a newer attempt owns the job: not an outage
                error = f"{type(exc).__name__}: {exc}"
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
            error = self._result(key, error)
            if fenced is not None:
                raise fenced
            if error is not None and error.startswith(f"{errors.FencedError.__name__}:"):
                # A fenced writer (a newer attempt or another job owns the
                # step) must stop, whatever upload_on_failure says.
                raise errors.FencedError(f"upload of step {step} refused: {error}")
            if error is not None:
                self._failed(step, error, left=[s for s in steps if s not in done])
                break
            if not self.shared and coord.rank != 0:
                # Node-local: this rank's copy of the step is uploaded too,
                # so its own rotation may delete it later.
                mark_copy_uploaded(folder, rank=coord.rank, step=step)
            done.append(step)
            self._emit("uploaded", step, seconds=time.monotonic() - t0, bytes=sent)
        if done and coord.rank == 0:
            with self.lock:
                if self.state.failures and len(done) == len(steps):
                    log.info("upload backlog cleared: uploaded steps %s", done)
                    self.state = Backoff()
        return done

    def _result(self, key: str, error: str | None) -> str | None:
        """Rank 0's verdict on one step (it saw every rank's report)."""
        coord = self.coordinator
        if coord.rank == 0:
            coord.broadcast(f"{key}/result", {"error": error})
            return error
        got = coord.wait_for(f"{key}/result", timeout=self.opts.timeout_seconds)
        verdict = got.get("error")
        return None if verdict is None else str(verdict)

    def _failed(self, step: int, error: str, *, left: list[int]) -> None:
        if self.coordinator.rank == 0:
            with self.lock:
                self.state = after_failure(
                    self.state,
                    now=self.clock(),
                    error=error,
                    initial=self.opts.upload_retry_seconds,
                )
            log.warning("upload of step %d failed (backlog %s): %s", step, left, error)
            self._emit("upload_failed", step, message=_failure_message(error, left))
        if self.opts.upload_on_failure == "Fail":
            raise errors.RemoteError(f"upload of step {step} failed: {error}")

    def report_left(self, step: int, *, reason: str) -> list[int]:
        """Rank 0: report the steps still not uploaded (status `uploadError`)
        when the worker had to stop waiting (`reason`); returns them."""
        left = self.pending()
        if self.coordinator.rank == 0 and left:
            log.warning("steps %s are committed but not uploaded: %s", left, reason)
            self._emit("upload_failed", step, message=_failure_message(reason, left))
        return left


BACKLOG_PREFIX = "backlog="


def _failure_message(error: str, backlog: list[int]) -> str:
    """`backlog=<steps>; <error>`: what the status tracker parses. Pure."""
    return f"{BACKLOG_PREFIX}{','.join(map(str, backlog))}; {error}"[:1000]


def parse_failure_message(message: str) -> tuple[list[int], str]:
    """Inverse of `_failure_message`: (backlog steps, error). Pure."""
    if not message.startswith(BACKLOG_PREFIX):
        return [], message
    head, _, error = message.partition("; ")
    steps = [int(s) for s in head[len(BACKLOG_PREFIX) :].split(",") if s.isdigit()]
    return steps, error
