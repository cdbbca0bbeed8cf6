"""The manager's upload side: the backlog, its worker, and the final deadline.

Built by `CheckpointManager` when the job uploads (`opts.s3`). Saves tell
the worker of each commit (`pipeline.run_step`); the manager drains it at
`wait_until_finished()` and `close()`, and at a preemption only until the
final checkpoint's deadline: after that the uploads are abandoned (the
steps left are reported and stay in the next attempt's backlog) and no
later call waits for them again.
"""

from __future__ import annotations

import functools
import logging
import time
import typing

from cairn.checkpoint import coordinator as coordinator_mod
from cairn.checkpoint import errors, events, options, pipeline, rotation, upload_backlog, uploader

if typing.TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

log = logging.getLogger(__name__)


class Uploads:
    """The upload backlog and worker of one manager (one per rank)."""

    def __init__(
        self,
        *,
        opts: options.CheckpointOptions,
        coordinator: coordinator_mod.Coordinator,
        s3: S3Client,
        callbacks: typing.Sequence[events.ProgressCallback],
        shared: bool,
    ) -> None:
        self._opts = opts
        self._rank = coordinator.rank
        self._shared = shared
        self._callbacks = callbacks
        self._backlog = upload_backlog.Backlog(
            opts=opts, coordinator=coordinator, callbacks=callbacks, shared=shared
        )
        self.worker = uploader.Uploader(
            backlog=self._backlog,
            coordinator=coordinator,
            upload_one=functools.partial(
                pipeline.upload_step, opts=opts, coordinator=coordinator, s3_client=s3
            ),
            timeout=opts.timeout_seconds,
        )
        self.abandoned = False
        """The final deadline passed: nothing waits for uploads any more."""

    def start(self) -> None:
        """Start the worker once; its first round uploads what earlier attempts
        committed but did not upload."""
        self.worker.start()

    def promote_last(self) -> None:
        """At a clean end: the newest committed step, when local-only, becomes
        owed an upload (`tiers`), so the drain that follows uploads the job's
        last checkpoint. Each volume's rotating rank does its own."""
        if not rotation.rotates_here(rank=self._rank, shared=self._shared):
            return
        step = upload_backlog.promote_newest(
            self._opts.directory, job_uid=self._opts.job_uid, keyring=self._opts.manifest_keyring
        )
        if step is not None:
            log.info("rank %d: the last step %d is uploaded at the end", self._rank, step)

    def drain(self, *, force: bool) -> None:
        """One round over every committed step (bounded), then its failure raised."""
        deadline = time.monotonic() + self._opts.timeout_seconds
        if not self.abandoned and not self.worker.drain(deadline=deadline, force=force):
            log.warning("rank %d: the upload worker did not finish a round", self._rank)
        self.raise_error()

    def raise_error(self) -> None:
        """The worker's failure, if any, as a CheckpointError (once)."""
        error = self.worker.take_error()
        if error is None:
            return
        if isinstance(error, errors.CheckpointError):
            raise error
        raise errors.CheckpointError(f"the upload worker failed: {error!r}") from error

    def drain_final(self, final_step: int, *, deadline: float) -> None:
        """Wait for uploads only until the final deadline; then say what is left."""
        if self.abandoned:
            return
        drained = self.worker.drain(deadline=deadline)
        # The grace deadline governs from here: no rank drains again (in
        # close() a rank past its deadline would wait for ranks that are not).
        self.abandoned = True
        if drained:
            self.raise_error()
            return
        self._backlog.report_left(
            final_step,
            reason=(
                "final checkpoint: the grace period ended before these committed "
                "steps were uploaded; they stay on the volume for the next attempt"
            ),
        )

    def rotate_after(self) -> None:
        """Rotate once more after the last uploads: the last save's rotation had
        to keep the steps that were not uploaded yet, and no later save's
        rotation will release them. Nothing is in flight any more."""
        if self.abandoned or not rotation.rotates_here(rank=self._rank, shared=self._shared):
            return
        try:
            rotation.rotate(
                self._opts, rank=self._rank, in_flight=frozenset(), callbacks=self._callbacks
            )
        except OSError as exc:
            # The run is done and every step is committed: a volume that cannot
            # be tidied now is tidied by the next start's rotation, not a failure.
            log.warning("rank %d: rotation after the last uploads failed: %s", self._rank, exc)

    def stop(self) -> None:
        """Stop the worker; uploads abandoned at the final deadline are not waited for."""
        self.worker.stop(wait=0.0 if self.abandoned else 5.0)
