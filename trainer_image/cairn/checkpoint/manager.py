"""`CheckpointManager`: the surface a training loop uses (Orbax-shaped).

    with CheckpointManager(opts) as ckpt:
        ckpt.restore(state)                      # newest verified committed step
        for step in ...:
            loss.backward()
            ckpt.wait_until_staged()             # before optimizer.step()
            optimizer.step()
            if ckpt.should_save(step):
                ckpt.save(step, state)           # returns once staging started
            if ckpt.reached_final(step):         # preemption (SIGTERM)
                break

`save()` snapshots the state dicts into reusable host buffers (DCP's
`DefaultStager`, asynchronously) and hands the step to one writer thread
that runs `cairn.checkpoint.pipeline.run_step` (stage, write, commit,
rotate). Uploads run apart in the upload worker (`cairn.checkpoint.uploader`):
a save never waits for the store. At most one save is in flight; a failure
in the background is re-raised by the next call on the manager, never
swallowed. Every rank must make the same calls with the same
steps (save decisions that depend on time or signals are agreed through the
coordinator, see `should_save`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import functools
import itertools
import logging
import signal
import threading
import time
import types
import typing

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import staging

from cairn.api import checkpointspec
from cairn.checkpoint import (
    agreement,
    errors,
    events,
    faults,
    foreign,
    gpu,
    layout,
    lineage,
    load,
    options,
    pipeline,
    remote,
    rotation,
    startup,
    state,
    upload_backlog,
    uploader,
)
from cairn.checkpoint import coordinator as coordinator_mod
from cairn.checkpoint import fence as fence_mod
from cairn.checkpoint import restore as restore_mod

if typing.TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

log = logging.getLogger(__name__)

_instances = itertools.count()


@dataclasses.dataclass(kw_only=True, slots=True)
class _InFlight:
    step: int
    staged: concurrent.futures.Future[dict[str, typing.Any]]
    done: concurrent.futures.Future[None]
    committed: threading.Event = dataclasses.field(default_factory=threading.Event)
    phase: str = "staging"
    """The last phase this rank finished (for a deadline report)."""


class CheckpointManager:
    """Saves, commits, uploads, rotates and restores checkpoints of one run."""

    def __init__(
        self,
        opts: options.CheckpointOptions,
        *,
        coordinator: coordinator_mod.Coordinator | None = None,
        callbacks: typing.Sequence[events.ProgressCallback] = (),
        s3_client: S3Client | None = None,
    ) -> None:
        """`coordinator` and `s3_client` default to the store of the default
        process group and a client built from `opts.s3`; pass them to use
        another backend (e.g. Ray) or an instrumented client."""
        self._opts = opts
        # The manager listens too: commits release `asyncMode: off` saves and
        # the final checkpoint's deadline wait.
        self._callbacks = (*tuple(callbacks), self._on_event)
        # Every rank constructs managers in the same order, so the counter
        # gives the same namespace everywhere and two managers of one
        # attempt never read each other's keys.
        namespace = f"cairn-ckpt/attempt-{opts.attempt}/manager-{next(_instances)}"
        self._coord = coordinator or coordinator_mod.from_default_group(namespace=namespace)
        if isinstance(self._coord, coordinator_mod.Fencing):
            # The Ray monitor refuses a replaced rank-actor group right before
            # each commit, besides the local file and the API server.
            own = (self._opts.fence,) if self._opts.fence is not None else ()
            self._opts = opts = dataclasses.replace(
                opts, fence=fence_mod.AllOf(fences=(*own, self._coord.commit_fence()))
            )
        self._rank = self._coord.rank
        self._pg: dist.ProcessGroup | None = None
        if dist.is_available() and dist.is_initialized():
            # DCP's collectives get their own gloo group: on the training
            # group they would interleave with FSDP's and deadlock.
            group = dist.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=opts.timeout_seconds)
            )
            if not isinstance(group, dist.ProcessGroup):
                raise errors.CheckpointError("this rank is not a member of the checkpoint group")
            self._pg = group
        if s3_client is None and opts.s3 is not None:
            s3_client = remote.make_client(opts.s3)
        self._s3 = s3_client if opts.s3 is not None else None
        self._inflight: _InFlight | None = None
        self._closed = False
        self._final_flag = False
        self._final_proposed = False
        self._final_saved = False
        self._agreement = agreement.Agreement(
            self._coord, timeout=opts.timeout_seconds, grace=opts.final_grace_seconds
        )
        self._restores = itertools.count()
        self._last_save = time.monotonic()
        # Once per manager: does every rank see one directory (shared volume)
        # or its own (emptyDir per pod)? Commit and rotation follow it.
        self._shared = startup.probe_shared(
            directory=opts.directory,
            coordinator=self._coord,
            namespace="volume-probe",
            timeout=opts.timeout_seconds,
        )
        self._lineage: lineage.Decision | None = None
        self._init_root()
        self._stager = make_stager(opts.async_mode, cuda=torch.cuda.is_available())
        self._backlog = (
            upload_backlog.Backlog(
                opts=opts,
                coordinator=self._coord,
                callbacks=self._callbacks,
                shared=self._is_shared(),
            )
            if self._s3 is not None
            else None
        )
        self._uploader: uploader.Uploader | None = None  # (the context below reads it)
        self._uploader = (
            uploader.Uploader(
                backlog=self._backlog,
                coordinator=self._coord,
                upload_one=functools.partial(
                    pipeline.upload_step, self._context(-1, started=time.monotonic())
                ),
                timeout=opts.timeout_seconds,
            )
            if self._backlog is not None
            else None
        )
        self._abandoned: concurrent.futures.Future[None] | None = None
        self._uploads_abandoned = False
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="cairn-ckpt-writer"
        )

    def _init_root(self) -> None:
        """Each volume once (rank 0's first): fence, pending branch, clean-up, rotation."""
        if self._rank == 0:
            try:
                if self._s3 is not None and self._opts.s3 is not None and self._opts.job_uid:
                    remote.check_prefix_owner(self._s3, self._opts.s3, job_uid=self._opts.job_uid)
                self._prepare_volume()
            except BaseException as exc:
                self._coord.broadcast("init", {"error": repr(exc)})
                raise
            self._coord.broadcast("init", {"ok": True})
        else:
            result = self._coord.wait_for("init", timeout=self._opts.timeout_seconds)
            if result.get("error"):
                raise errors.CheckpointError(f"checkpoint root init failed: {result['error']}")
            if rotation.rotates_here(rank=self._rank, shared=self._is_shared()):
                # Node-local volume: this rank's own volume is its to prepare.
                self._prepare_volume()

    def _volume(self) -> lineage.Volume:
        return lineage.Volume(
            root=self._opts.directory,
            job_uid=self._opts.job_uid,
            keyring=self._opts.manifest_keyring,
            attempt=self._opts.attempt,
            rank=self._rank,
            client=self._s3 if self._rank == 0 else None,
            s3opts=self._opts.s3 if self._rank == 0 else None,
        )

    def _prepare_volume(self) -> None:
        startup.prepare(
            self._opts.directory,
            job_uid=self._opts.job_uid,
            attempt=self._opts.attempt,
            rank=self._rank,
            callbacks=self._callbacks,
            group=self._opts.group,
            keyring=self._opts.manifest_keyring,
        )
        lineage.finish_pending(self._volume(), callbacks=self._callbacks)
        rotation.rotate(
            self._opts, rank=self._rank, in_flight=frozenset(), callbacks=self._callbacks
        )

    def _begin_lineage(self, loaded: int | None, *, imported: bool = False) -> lineage.Decision:
        """Continue the loaded step's lineage or branch (collective; see `lineage`)."""
        if self._lineage is None:
            self._lineage = lineage.begin(
                coordinator=self._coord,
                volume=self._volume(),
                shared=self._is_shared(),
                loaded=loaded,
                key="lineage",
                timeout=self._opts.timeout_seconds,
                callbacks=self._callbacks,
                imported=imported,
            )
        return self._lineage

    # -- the training loop's calls -------------------------------------------------

    def should_save(self, step: int) -> bool:
        """Whether `step` is a save step; every rank gets the same answer.

        Step intervals are decided locally. Time intervals (rank 0's clock)
        and preemption requests (any rank's SIGTERM) become a numbered
        request in the coordinator store; every rank that sees it reports the
        step it just finished, and all save at `max(reported) + 1`
        (`cairn.checkpoint.agreement`). A rank that reaches its own report + 1 before every
        report is in waits there (bounded), so none is past the agreed step
        when it learns it, however far apart the ranks run (NCCL lets the CPU
        run ahead).
        """
        self._raise_pending()
        self._start_backlog_once()
        agreed = self._agreement
        agreed.poll()
        if self._final_flag and not self._final_proposed:
            self._final_proposed = True
            agreed.request(final=True)
        if (
            self._opts.interval_seconds is not None
            and self._rank == 0
            and time.monotonic() - self._last_save >= self._opts.interval_seconds
            and not any(s > step for s in agreed.requested)
            and not agreed.pending()
        ):
            agreed.request(final=False)
        agreed.agree(step)
        if step in agreed.requested:
            return True
        return self._opts.interval_steps is not None and step % self._opts.interval_steps == 0

    def save(
        self, step: int, objects: typing.Mapping[str, state.Stateful], *, force: bool = False
    ) -> bool:
        """Start saving `step`; returns True if a save started.

        Returns as soon as the state dicts are handed to the stager; call
        `wait_until_staged()` before mutating parameters (optimizer.step()).
        Waits for the previous save's commit and rotation first (at most one
        in flight), never for an upload.
        """
        self._raise_pending()
        # The lineage is settled before anything else touches S3 (the backlog).
        current = self._begin_lineage(None)
        self._start_backlog_once()
        if not force and not self.should_save(step):
            return False
        # Orbax semantics: a lineage only moves forward; never a silent skip.
        lineage.check_save(step, latest=current.latest, lineage=current.lineage)
        self._lineage = dataclasses.replace(current, latest=step)
        t0 = time.monotonic()
        self._finish_writer()
        snapshot = {
            load.state_key(name, obj, self._rank): obj.state_dict() for name, obj in objects.items()
        }
        faults.pause_point("staging", rank=self._rank, step=step)
        staged = self._stage(snapshot)
        ctx = self._context(step, started=t0)
        inflight = _InFlight(step=step, staged=staged, done=concurrent.futures.Future())
        self._inflight = inflight  # before the writer starts: its events must find it
        inflight.done = self._executor.submit(pipeline.run_step, ctx, staged)
        self._last_save = time.monotonic()
        if step == self._agreement.final_step:
            self._final_saved = True
        if self._opts.async_mode == "off":
            # Synchronous: return after the local commit, like dcp.save
            # returns after its write (upload and rotation go on behind).
            self._wait_committed(inflight, deadline=None)
        events.emit(
            self._callbacks,
            events.ProgressEvent(
                phase="blocked", step=step, rank=self._rank, seconds=time.monotonic() - t0
            ),
        )
        return True

    def wait_until_staged(self) -> None:
        """Block until the in-flight save's snapshot is copied (call before optimizer.step())."""
        inflight = self._inflight
        if inflight is None:
            return
        try:
            inflight.staged.result()
        except Exception as exc:
            self._inflight = None
            raise errors.CheckpointError(f"staging of step {inflight.step} failed") from exc
        self._raise_pending()

    def wait_until_finished(self) -> None:
        """Block until the in-flight save is committed and rotated, and an upload
        round has tried every committed step (bounded: a hung store fails the
        round within `stall_seconds`; the step then waits in the backlog)."""
        self._finish_writer()
        self._drain_uploads(force=False)

    def _drain_uploads(self, *, force: bool) -> None:
        deadline = time.monotonic() + self._opts.timeout_seconds
        uploads = self._uploader
        if (
            uploads is not None
            and not self._uploads_abandoned
            and not uploads.drain(deadline=deadline, force=force)
        ):
            log.warning("rank %d: the upload worker did not finish a round", self._rank)
        self._raise_upload_error()

    def _raise_upload_error(self) -> None:
        error = None if self._uploader is None else self._uploader.take_error()
        if error is None:
            return
        if isinstance(error, errors.CheckpointError):
            raise error
        raise errors.CheckpointError(f"the upload worker failed: {error!r}") from error

    def _finish_writer(self) -> None:
        """Block until the in-flight save is committed and rotated; re-raise its failure."""
        inflight = self._inflight
        if inflight is None:
            return
        self._inflight = None
        try:
            inflight.done.result()
        except errors.CheckpointError:
            raise
        except Exception as exc:
            raise errors.CheckpointError(f"checkpoint step {inflight.step} failed") from exc

    def request_final_checkpoint(self) -> None:
        """Ask for a final checkpoint at the next agreed step boundary.

        Safe to call from a signal handler: it only sets a flag and notes the
        time (the grace period runs from here); the next `should_save()`
        turns it into a request every rank sees.
        """
        self._agreement.note_signal()
        self._final_flag = True

    def install_sigterm_handler(self) -> None:
        """SIGTERM → `request_final_checkpoint()` (main thread only)."""

        def handler(signum: int, frame: types.FrameType | None) -> None:
            self.request_final_checkpoint()

        signal.signal(signal.SIGTERM, handler)

    def reached_final(self, step: int) -> bool:
        """True once the final (preemption) checkpoint step was saved and committed.

        The commit is awaited until the grace period's deadline
        (`agreement.final_deadline`); a final step this rank did not save, or one that
        does not commit in time, raises with the reason instead of being
        reported as saved. Uploads are waited for until the same deadline;
        steps still not uploaded then are reported (`uploadError`: committed,
        not uploaded) and stay in the upload backlog of the next attempt.
        """
        final_step = self._agreement.final_step
        if final_step is None or step < final_step:
            return False
        if not self._final_saved:
            raise errors.CheckpointError(
                f"rank {self._rank}: the final checkpoint step {final_step} was not "
                f"saved (the training loop did not call save() at that step)"
            )
        deadline = self._agreement.deadline()
        inflight = self._inflight
        if inflight is not None and inflight.step == final_step:
            self._wait_committed(inflight, deadline=deadline)
            try:
                inflight.done.result(timeout=max(0.0, deadline - time.monotonic()))
            except concurrent.futures.TimeoutError:
                log.warning(
                    "final checkpoint step %d is committed; its rotation (%s) did not "
                    "finish within the grace period",
                    inflight.step,
                    inflight.phase,
                )
                self._inflight = None
                self._abandoned = inflight.done
            else:
                self._finish_writer()
        self._drain_final(final_step, deadline=deadline)
        return True

    def _drain_final(self, final_step: int, *, deadline: float) -> None:
        """Wait for uploads only until the final deadline; then say what is left."""
        if self._uploader is None or self._uploads_abandoned:
            return
        drained = self._uploader.drain(deadline=deadline)
        # The grace deadline governs from here: no rank drains again (in
        # close() a rank past its deadline would wait for ranks that are not).
        self._uploads_abandoned = True
        if drained:
            self._raise_upload_error()
            return
        if self._backlog is not None:
            self._backlog.report_left(
                final_step,
                reason=(
                    "final checkpoint: the grace period ended before these committed "
                    "steps were uploaded; they stay on the volume for the next attempt"
                ),
            )

    # -- discovery and resume ---------------------------------------------------------

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        """This job's committed local steps, oldest first."""
        return layout.committed_steps(
            self._opts.directory, job_uid=self._opts.job_uid, keyring=self._opts.manifest_keyring
        )

    def restore(
        self,
        objects: typing.Mapping[str, state.Stateful],
        *,
        step: int | None = None,
        uri: str | None = None,
        key_map: foreign.KeyMap | None = None,
        sha256: str | None = None,
    ) -> restore_mod.RestoreResult | None:
        """Load the newest verified committed step (local, else S3) into `objects`.

        `step` or `uri` (an S3 step folder or plain DCP checkpoint, imported
        with `key_map` or the documented rule) name an explicit target:
        ConfigurationError when it cannot be loaded, never a fresh start.
        `sha256` (`resume.sha256`) pins the target's `.metadata` file.
        """
        self.wait_until_finished()
        result = restore_mod.restore(
            opts=self._opts,
            coordinator=self._coord,
            process_group=self._pg,
            s3_client=self._s3,
            objects=objects,
            step=step,
            callbacks=self._callbacks,
            namespace=f"restore-{next(self._restores)}",
            uri=uri,
            key_map=key_map,
            sha256=sha256,
        )
        if self._lineage is None:
            self._begin_lineage(
                None if result is None else result.step,
                imported=result is not None and result.imported,
            )
        return result

    # -- lifecycle --------------------------------------------------------------------

    def close(self) -> None:
        """Finish the in-flight save (re-raising its failure), then free buffers."""
        if self._closed:
            return
        self._closed = True
        try:
            self._finish_writer()
            # A last round retries the whole backlog, backoff or not.
            self._drain_uploads(force=True)
            self._rotate_after_uploads()
        finally:
            if self._uploader is not None:
                # Uploads abandoned at the final deadline are not waited for.
                self._uploader.stop(wait=0.0 if self._uploads_abandoned else 5.0)
            # A final rotation abandoned at its deadline is not waited for.
            self._executor.shutdown(wait=self._abandoned is None, cancel_futures=True)
            if self._stager is not None:
                self._stager.close()
            if self._pg is not None:
                dist.destroy_process_group(self._pg)

    def _rotate_after_uploads(self) -> None:
        """Rotate once more after the last uploads: the last save's rotation had
        to keep the steps that were not uploaded yet, and no later save's
        rotation will release them. Nothing is in flight any more."""
        if self._uploader is None or self._uploads_abandoned:
            return
        if not rotation.rotates_here(rank=self._rank, shared=self._is_shared()):
            return
        try:
            rotation.rotate(
                self._opts, rank=self._rank, in_flight=frozenset(), callbacks=self._callbacks
            )
        except OSError as exc:
            # The run is done and every step is committed: a volume that cannot
            # be tidied now is tidied by the next start's rotation, not a failure.
            log.warning("rank %d: rotation after the last uploads failed: %s", self._rank, exc)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except Exception:
            # The body's exception is the one to see; ours goes to the log.
            log.exception("checkpoint manager close failed while handling another error")

    # -- internals ----------------------------------------------------------------------

    def _raise_pending(self) -> None:
        if self._closed:
            raise errors.CheckpointError("checkpoint manager is closed")
        inflight = self._inflight
        if inflight is not None and inflight.done.done() and inflight.done.exception():
            self._finish_writer()
        self._raise_upload_error()

    def _on_event(self, event: events.ProgressEvent) -> None:
        """Track this rank's phases of the step in flight (writer thread)."""
        inflight = self._inflight
        if inflight is None or event.rank != self._rank or event.step != inflight.step:
            return
        if event.phase != "blocked":  # the training thread's event, not a phase
            inflight.phase = event.phase
        if event.phase == "committed":
            inflight.committed.set()

    def _wait_committed(self, inflight: _InFlight, *, deadline: float | None) -> None:
        """Block until `inflight` committed on this rank (or failed: re-raised)."""
        while not inflight.committed.wait(0.02):
            if inflight.done.done():
                if inflight.done.exception() is not None:
                    self.wait_until_finished()
                return
            if deadline is not None and time.monotonic() >= deadline:
                grace = self._opts.final_grace_seconds
                raise errors.CheckpointError(
                    f"final checkpoint step {inflight.step} did not commit within the grace "
                    f"period ({grace}s minus a margin): last finished phase on rank "
                    f"{self._rank}: {inflight.phase}"
                )

    def _stage(
        self, snapshot: dict[str, typing.Any]
    ) -> concurrent.futures.Future[dict[str, typing.Any]]:
        """Hand the snapshot to the stager (none with `asyncMode: off`)."""
        staged: dict[str, typing.Any] | concurrent.futures.Future[dict[str, typing.Any]]
        if self._stager is None:
            # Synchronous: DCP reads the live tensors while save() blocks.
            staged = snapshot
        else:
            # GPU: the staging stream waits for the compute queued so far.
            gpu.order_after_compute(stream=gpu.staging_stream(self._stager))
            staged = self._stager.stage(snapshot)
        if isinstance(staged, concurrent.futures.Future):
            return staged
        done_now: concurrent.futures.Future[dict[str, typing.Any]] = concurrent.futures.Future()
        done_now.set_result(staged)
        return done_now

    def _is_shared(self) -> bool:
        return self._shared

    def _context(self, step: int, *, started: float) -> pipeline.StepContext:
        return pipeline.StepContext(
            step=step,
            opts=self._opts,
            coordinator=self._coord,
            process_group=self._pg,
            s3_client=self._s3,
            callbacks=self._callbacks,
            started=started,
            shared=self._is_shared(),
            uploads=self._uploader,
            lineage=None if self._lineage is None else self._lineage.lineage,
            parent=None if self._lineage is None else self._lineage.parent,
        )

    def _start_backlog_once(self) -> None:
        """At the first training-loop call (every rank): start the upload
        worker; its first round uploads what earlier attempts committed but
        did not upload."""
        if self._uploader is not None:
            self._uploader.start()


def make_stager(mode: checkpointspec.AsyncMode, *, cuda: bool) -> staging.DefaultStager | None:
    """The stager of an async mode (None for `off`).

    `pinned`: page-locked host buffers and non-blocking device copies on a
    staging stream (on CPU there is nothing to pin: same as `thread`).
    `thread`: pageable host buffers, copied by the staging thread. Buffers
    are reused across saves; shared memory is only for a process writer.
    """
    if mode == "off":
        return None
    pinned = mode == "pinned" and cuda
    return staging.DefaultStager(
        staging.StagingOptions(
            use_pinned_memory=pinned,
            use_shared_memory=False,
            use_async_staging=True,
            use_non_blocking_copy=pinned,
        )
    )
