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

A facade: it guards the calls and delegates. `save()` snapshots the state
dicts into reusable host buffers (DCP's `DefaultStager`, asynchronously) and
hands the step to one writer thread that runs `cairn.checkpoint.pipeline.run_step`
(stage, write, commit, rotate); what is left of that save is one value,
`inflight.InFlightSave`. Which steps are saves is `schedule.SaveSchedule`'s
answer (agreed across ranks); the volumes are prepared by `volume_init`;
uploads run apart in the upload worker (`cairn.checkpoint.uploader`): a save
never waits for the store. At most one save is in flight; a failure in the
background is re-raised by the next call on the manager, never swallowed.
Every rank must make the same calls with the same steps.

Under the operator (the pod's environment says so) rank 0's manager also
reports the step and the checkpoint facts to the job's status and checks the
API fence before each commit (`status_feed`); elsewhere it stays silent.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import logging
import signal
import time
import types
import typing

import torch
import torch.distributed as dist

from cairn.checkpoint import coordinator as coordinator_mod
from cairn.checkpoint import (
    errors,
    events,
    faults,
    foreign,
    inflight,
    layout,
    lineage,
    load,
    memtier,
    options,
    pipeline,
    s3transport,
    schedule,
    state,
    status_feed,
    uploads,
    volume_init,
    wiring,
)
from cairn.checkpoint import restore as restore_mod

if typing.TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

log = logging.getLogger(__name__)

make_stager = inflight.make_stager


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
        self._coord = wiring.coordinator_for(opts, given=coordinator)
        opts = wiring.with_torchrun_group(opts, coordinator=self._coord)
        # A coordinator the caller passed in is the caller's to run.
        self._heartbeat = coordinator is None and wiring.start_heartbeat(
            self._coord, group=opts.group
        )
        try:
            self._start(opts, callbacks=callbacks, s3_client=s3_client)
        except BaseException:
            if self._heartbeat:
                wiring.stop_heartbeat(self._coord)
            raise

    def _start(
        self,
        opts: options.CheckpointOptions,
        *,
        callbacks: typing.Sequence[events.ProgressCallback],
        s3_client: S3Client | None,
    ) -> None:
        """The rest of construction (the heartbeat is stopped if it raises)."""
        self._rank = self._coord.rank
        self._feed = status_feed.StatusFeed.from_env(opts) if self._rank == 0 else None
        self._opts = opts = wiring.with_fences(opts, coordinator=self._coord, feed=self._feed)
        # The manager listens too: commits release `asyncMode: off` saves and
        # the final checkpoint's deadline wait.
        feed = () if self._feed is None else (self._feed.on_event,)
        self._callbacks = (*tuple(callbacks), *feed, self._on_event)
        self._pg = wiring.checkpoint_group(opts)
        if s3_client is None and opts.s3 is not None:
            s3_client = s3transport.make_client(opts.s3)
        self._s3 = s3_client if opts.s3 is not None else None
        self._inflight: inflight.InFlightSave | None = None
        self._abandoned: inflight.InFlightSave | None = None
        """A final save whose rotation outlived the grace period (not waited for)."""
        self._closed = False
        self._failing = False
        """Closed while the training loop raised: no rank waits for the others."""
        self._schedule = schedule.SaveSchedule(opts=opts, coordinator=self._coord)
        self._restores = itertools.count()
        # Once per manager: does every rank see one directory (shared volume)
        # or its own (emptyDir per pod)? Commit and rotation follow it.
        self._volumes = volume_init.probe(
            opts, coordinator=self._coord, s3=self._s3, callbacks=self._callbacks
        )
        self._lineage: lineage.Decision | None = None
        volume_init.init(self._volumes, coordinator=self._coord)
        self._stager = inflight.make_stager(opts.async_mode, cuda=torch.cuda.is_available())
        self._uploads = (
            None
            if self._s3 is None
            else uploads.Uploads(
                opts=opts,
                coordinator=self._coord,
                s3=self._s3,
                callbacks=self._callbacks,
                shared=self._volumes.shared,
            )
        )
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="cairn-ckpt-writer"
        )
        # Collective when on: every rank's replica server up, addresses gathered.
        self._memory = memtier.start(opts, coordinator=self._coord, callbacks=self._callbacks)

    def _begin_lineage(self, loaded: int | None, *, imported: bool = False) -> lineage.Decision:
        """Continue the loaded step's lineage or branch (collective; see `lineage`)."""
        if self._lineage is None:
            self._lineage = lineage.begin(
                coordinator=self._coord,
                volume=self._volumes.lineage_volume(),
                shared=self._volumes.shared,
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

        Step intervals are decided locally; time intervals (rank 0's clock)
        and preemption requests (any rank's SIGTERM) are agreed through the
        coordinator (`cairn.checkpoint.schedule`, `cairn.checkpoint.agreement`).
        The step also becomes `status.step` under the operator.
        """
        self._raise_pending()
        self._start_uploads_once()
        self.report_step(step)
        return self._schedule.should_save(step)

    def report_step(self, step: int) -> None:
        """Tell the job's status the training step just finished (`status.step`).

        `save()` and `should_save()` do this already; call it in a loop that
        calls neither on every step. Without the operator it does nothing."""
        if self._feed is not None:
            self._feed.on_step(step)

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
        self.report_step(step)
        # The lineage is settled before anything else touches S3 (the backlog).
        current = self._begin_lineage(None)
        self._start_uploads_once()
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
        staged = inflight.stage(self._stager, snapshot)
        save = inflight.InFlightSave(
            step=step, final=step == self._schedule.final_step, staged=staged
        )
        self._inflight = save  # before the writer starts: its events must find it
        ctx = self._context(step, started=t0, final=save.final)
        self._executor.submit(save.run, functools.partial(pipeline.run_step, ctx, staged))
        self._schedule.started(step)
        if self._opts.async_mode == "off":
            # Synchronous: return after the local commit, like dcp.save
            # returns after its write (upload and rotation go on behind).
            self._wait_committed(save, deadline=None)
        seconds = time.monotonic() - t0
        events.emit(
            self._callbacks,
            events.ProgressEvent(phase="blocked", step=step, rank=self._rank, seconds=seconds),
        )
        return True

    def wait_until_staged(self) -> None:
        """Block until the in-flight save's snapshot is copied (call before optimizer.step())."""
        save = self._inflight
        if save is None:
            return
        try:
            save.wait_staged()
        except errors.CheckpointError:
            self._inflight = None
            raise
        self._raise_pending()

    def wait_until_finished(self) -> None:
        """Block until the in-flight save is committed and rotated, and an upload
        round has tried every committed step (bounded: a hung store fails the
        round within `stall_seconds`; the step then waits in the backlog)."""
        self._finish_writer()
        if self._uploads is not None:
            self._uploads.drain(force=False)

    def _finish_writer(self) -> None:
        """Block until the in-flight save is committed and rotated; re-raise its failure."""
        save, self._inflight = self._inflight, None
        if save is not None:
            save.join()

    def request_final_checkpoint(self) -> None:
        """Ask for a final checkpoint at the next agreed step boundary.

        Safe to call from a signal handler: it only notes the request and the
        time (the grace period runs from here); the next `should_save()`
        turns it into a request every rank sees.
        """
        self._schedule.note_signal()

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
        final_step = self._schedule.final_step
        if final_step is None or step < final_step:
            return False
        if self._schedule.final != "saved":
            raise errors.CheckpointError(
                f"rank {self._rank}: the final checkpoint step {final_step} was not "
                f"saved (the training loop did not call save() at that step)"
            )
        deadline = self._schedule.deadline()
        save = self._inflight
        if save is not None and save.final:
            self._finish_final(save, deadline=deadline)
        if self._uploads is not None:
            self._uploads.drain_final(final_step, deadline=deadline)
        return True

    def _finish_final(self, save: inflight.InFlightSave, *, deadline: float) -> None:
        """The final save committed by `deadline`; its rotation waited for until then."""
        self._wait_committed(save, deadline=deadline)
        try:
            save.join(timeout=max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            log.warning(
                "final checkpoint step %d is committed; its rotation (%s) did not "
                "finish within the grace period",
                save.step,
                save.phase,
            )
            self._abandoned = save
        finally:
            self._inflight = None  # joined, failed (raised) or abandoned

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
        Under the operator the result becomes `status.checkpoints.resumedFrom`.
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
            memory=self._memory,
        )
        if self._lineage is None:
            self._begin_lineage(
                None if result is None else result.step,
                imported=result is not None and result.imported,
            )
        if result is not None and self._feed is not None:
            self._feed.on_resume(status_feed.resumed_from(result, attempt=self._opts.attempt))
        return result

    # -- lifecycle --------------------------------------------------------------------

    def close(self) -> None:
        """Finish the in-flight save (re-raising its failure), then free buffers."""
        if self._closed:
            return
        self._closed = True
        finished = False
        try:
            self._finish_writer()
            if self._uploads is not None:
                if self._schedule.final == "none" and not self._failing:
                    self._uploads.promote_last()  # a finished job's last step is in S3
                # A last round retries the whole backlog, backoff or not.
                self._uploads.drain(force=True)
                self._uploads.rotate_after()
            finished = True
        finally:
            if self._uploads is not None:
                self._uploads.stop()
            if self._memory is not None:
                # Only a clean end waits for the peers' last pushes (a rank
                # that died, or SIGTERM, would only delay the restart).
                clean = self._schedule.final == "none" and not self._failing
                self._memory.close(barrier=clean)
            # A final rotation abandoned at its deadline is not waited for.
            self._executor.shutdown(wait=self._abandoned is None, cancel_futures=True)
            if self._stager is not None:
                self._stager.close()
            if self._heartbeat:
                # After this close's last store wait (a dead peer is still told
                # early there), before the last barrier: a rank 0 that hosts the
                # store may leave right after it, and a beat must not follow.
                wiring.stop_heartbeat(self._coord)
            if self._pg is not None:
                # A failed close neither waits for the others nor joins the
                # group's threads: a collective stuck on a dead peer would
                # hold either until the timeout.
                clean_end = finished and not self._failing and self._abandoned is None
                together = clean_end and self._leave_together(self._pg)
                dist.destroy_process_group(self._pg)
                if together:
                    # Our last reference: torch joins the group's gloo threads
                    # here, with the GIL released, so none is left to drop a
                    # tensor during interpreter finalization (a SIGABRT; see
                    # `process_exit`).
                    self._pg = None
            if self._feed is not None:
                self._feed.close()  # the last state, the final commit included

    def _leave_together(self, group: dist.ProcessGroup) -> bool:
        """No rank leaves before every rank has closed: without an agent's store
        (torchrun's), rank 0 hosts the store the others may still be reading
        (the last commit). Bounded by the group's timeout; a peer that failed
        or left ends it early. False when it failed."""
        try:
            dist.barrier(group=group)
        except Exception:
            log.warning(
                "checkpoint close: the last barrier failed; leaving without it", exc_info=True
            )
            return False
        return True

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
        self._failing = True
        try:
            self.close()
        except Exception:
            # The body's exception is the one to see; ours goes to the log.
            log.exception("checkpoint manager close failed while handling another error")

    # -- internals ----------------------------------------------------------------------

    def _raise_pending(self) -> None:
        if self._closed:
            raise errors.CheckpointError("checkpoint manager is closed")
        save = self._inflight
        if save is not None and save.failed():
            self._finish_writer()
        if self._uploads is not None:
            self._uploads.raise_error()

    def _on_event(self, event: events.ProgressEvent) -> None:
        """Track this rank's phases of the step in flight (writer thread)."""
        save = self._inflight
        if save is not None and event.rank == self._rank:
            save.on_event(event)

    def _wait_committed(self, save: inflight.InFlightSave, *, deadline: float | None) -> None:
        """Block until `save` committed on this rank (its failure re-raised)."""
        try:
            save.wait_committed(
                deadline=deadline, rank=self._rank, grace=self._opts.final_grace_seconds
            )
        except errors.CheckpointError:
            if save.failed():
                self._inflight = None  # its failure is raised now, once
            raise

    def _context(self, step: int, *, started: float, final: bool) -> pipeline.StepContext:
        return pipeline.StepContext(
            step=step,
            final=final,
            opts=self._opts,
            coordinator=self._coord,
            process_group=self._pg,
            s3_client=self._s3,
            callbacks=self._callbacks,
            started=started,
            shared=self._volumes.shared,
            uploads=None if self._uploads is None else self._uploads.worker,
            memory=self._memory,
            lineage=None if self._lineage is None else self._lineage.lineage,
            parent=None if self._lineage is None else self._lineage.parent,
        )

    def _start_uploads_once(self) -> None:
        """At the first training-loop call (every rank): start the upload worker."""
        if self._uploads is not None:
            self._uploads.start()
