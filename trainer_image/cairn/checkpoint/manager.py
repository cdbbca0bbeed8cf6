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
that runs `cairn.checkpoint.pipeline.run_step`. At most one save is in
flight; a failure in the background is re-raised by the next call on the
manager, never swallowed. Every rank must make the same calls with the same
steps (save decisions that depend on time or signals are agreed through the
coordinator, see `should_save`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import itertools
import logging
import signal
import time
import types
import typing

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import staging

from cairn.checkpoint import coordinator as coordinator_mod
from cairn.checkpoint import errors, events, faults, layout, options, pipeline, remote, state
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
        self._callbacks = tuple(callbacks)
        # Every rank constructs managers in the same order, so the counter
        # gives the same namespace everywhere and two managers of one
        # attempt never read each other's keys.
        namespace = f"cairn-ckpt/attempt-{opts.attempt}/manager-{next(_instances)}"
        self._coord = coordinator or coordinator_mod.from_default_group(namespace=namespace)
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
        self._final_step: int | None = None
        self._requested: set[int] = set()
        self._request_seq = 0
        self._restores = itertools.count()
        self._last_save = time.monotonic()
        self._init_root()
        cuda = torch.cuda.is_available()
        # Pinned buffers need an accelerator (ignored with a warning on CPU);
        # shared memory is only needed by a process writer.
        self._stager = staging.DefaultStager(
            staging.StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=False,
                use_async_staging=True,
                use_non_blocking_copy=cuda,
            )
        )
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="cairn-ckpt-writer"
        )

    def _init_root(self) -> None:
        """Rank 0 raises the fence and cleans abandoned partials; others wait."""
        if self._rank == 0:
            try:
                self._opts.directory.mkdir(parents=True, exist_ok=True)
                layout.raise_fence(self._opts.directory, self._opts.attempt)
                pipeline.rotate(self._opts, in_flight=frozenset(), callbacks=self._callbacks)
            except BaseException as exc:
                self._coord.broadcast("init", {"error": repr(exc)})
                raise
            self._coord.broadcast("init", {"ok": True})
        else:
            result = self._coord.wait_for("init", timeout=self._opts.timeout_seconds)
            if result.get("error"):
                raise errors.CheckpointError(f"checkpoint root init failed: {result['error']}")

    # -- the training loop's calls -------------------------------------------------

    def should_save(self, step: int) -> bool:
        """Whether `step` is a save step; every rank gets the same answer.

        Step intervals are decided locally. Time intervals (rank 0's clock)
        and preemption requests (any rank's SIGTERM) become a request for a
        step two steps ahead, posted to the coordinator; ranks run at most
        one step apart (FSDP's collectives), so every rank sees it in time.
        """
        self._raise_pending()
        self._poll_requests()
        world = self._coord.world_size
        ahead = 2 if world > 1 else 0
        if self._final_flag and not self._final_proposed:
            self._final_proposed = True
            self._propose(step + ahead, final=True)
        if (
            self._opts.interval_seconds is not None
            and self._rank == 0
            and time.monotonic() - self._last_save >= self._opts.interval_seconds
            and not any(s > step for s in self._requested)
        ):
            self._propose(step + ahead, final=False)
        if step in self._requested:
            return True
        return self._opts.interval_steps is not None and step % self._opts.interval_steps == 0

    def save(
        self, step: int, objects: typing.Mapping[str, state.Stateful], *, force: bool = False
    ) -> bool:
        """Start saving `step`; returns True if a save started.

        Returns as soon as the state dicts are handed to the stager; call
        `wait_until_staged()` before mutating parameters (optimizer.step()).
        Waits for the previous save first (at most one in flight).
        """
        self._raise_pending()
        if not force and not self.should_save(step):
            return False
        folder = layout.step_dir(self._opts.directory, step)
        if layout.is_committed(folder):
            log.warning("checkpoint step %d is already committed; not saving it again", step)
            return False
        t0 = time.monotonic()
        self.wait_until_finished()
        snapshot = {
            restore_mod.state_key(name, obj, self._rank): obj.state_dict()
            for name, obj in objects.items()
        }
        faults.pause_point("staging", rank=self._rank, step=step)
        staged = self._stager.stage(snapshot)
        if not isinstance(staged, concurrent.futures.Future):
            done_now: concurrent.futures.Future[dict[str, typing.Any]] = concurrent.futures.Future()
            done_now.set_result(staged)
            staged = done_now
        ctx = pipeline.StepContext(
            step=step,
            opts=self._opts,
            coordinator=self._coord,
            process_group=self._pg,
            s3_client=self._s3,
            callbacks=self._callbacks,
            started=t0,
        )
        done = self._executor.submit(pipeline.run_step, ctx, staged)
        self._inflight = _InFlight(step=step, staged=staged, done=done)
        self._last_save = time.monotonic()
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
        """Block until the in-flight save is committed, uploaded and rotated (bounded)."""
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

        Safe to call from a signal handler: it only sets a flag; the next
        `should_save()` turns it into a request every rank sees.
        """
        self._final_flag = True

    def install_sigterm_handler(self) -> None:
        """SIGTERM → `request_final_checkpoint()` (main thread only)."""

        def handler(signum: int, frame: types.FrameType | None) -> None:
            self.request_final_checkpoint()

        signal.signal(signal.SIGTERM, handler)

    def reached_final(self, step: int) -> bool:
        """True once the final (preemption) checkpoint step was saved and is committed."""
        if self._final_step is None or step < self._final_step:
            return False
        self.wait_until_finished()
        return True

    # -- discovery and resume ---------------------------------------------------------

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        """Committed local steps, oldest first."""
        return layout.committed_steps(self._opts.directory)

    def restore(
        self, objects: typing.Mapping[str, state.Stateful], *, step: int | None = None
    ) -> restore_mod.RestoreResult | None:
        """Load the newest verified committed step (local, else S3) into `objects`."""
        self.wait_until_finished()
        return restore_mod.restore(
            opts=self._opts,
            coordinator=self._coord,
            process_group=self._pg,
            s3_client=self._s3,
            objects=objects,
            step=step,
            callbacks=self._callbacks,
            namespace=f"restore-{next(self._restores)}",
        )

    # -- lifecycle --------------------------------------------------------------------

    def close(self) -> None:
        """Finish the in-flight save (re-raising its failure), then free buffers."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait_until_finished()
        finally:
            self._executor.shutdown(wait=True)
            self._stager.close()
            if self._pg is not None:
                dist.destroy_process_group(self._pg)

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
            self.wait_until_finished()

    def _poll_requests(self) -> None:
        while (request := self._coord.poll(f"request/{self._request_seq}")) is not None:
            self._request_seq += 1
            self._requested.add(int(request["step"]))
            if request.get("final"):
                self._final_step = int(request["step"])

    def _propose(self, target: int, *, final: bool) -> None:
        mine = {"step": target, "final": final, "rank": self._rank}
        while True:
            self._poll_requests()
            won = self._coord.propose(f"request/{self._request_seq}", mine)
            self._poll_requests()
            if won == mine or not final or won.get("final"):
                return
