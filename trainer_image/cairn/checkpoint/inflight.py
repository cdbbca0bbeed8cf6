"""The save in flight as one value (like DCP's `AsyncSaveResponse`).

`save()` returns once the state dicts are handed to the stager; what is left
of that save lives in one `InFlightSave`: the staging future (the snapshot
is copied), the writer's future (`pipeline.run_step`: write, commit,
rotate), the commit seen by this rank, the last phase it finished (for a
deadline report) and whether it is the agreed final (preemption) step. The
manager holds at most one and asks it; nothing about a save lives in loose
fields of the manager. The stager that fills `staged` is made here too.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
import typing

from torch.distributed.checkpoint import staging

from cairn.api import checkpointspec
from cairn.checkpoint import errors, events, gpu

StateDict = dict[str, typing.Any]


@dataclasses.dataclass(kw_only=True, slots=True)
class InFlightSave:
    """One save from `save()` until its writer is done (committed and rotated)."""

    step: int
    final: bool
    """The agreed final (preemption) step: `reached_final` waits for it."""
    staged: concurrent.futures.Future[StateDict]
    done: concurrent.futures.Future[None] = dataclasses.field(
        default_factory=concurrent.futures.Future
    )
    """Set by `run` when the writer finished (its exception if it failed)."""
    committed: threading.Event = dataclasses.field(default_factory=threading.Event)
    phase: str = "staging"
    """The last phase this rank finished (for a deadline report)."""

    def run(self, write: typing.Callable[[], None]) -> None:
        """The writer thread's body: `write()`, its outcome into `done`."""
        try:
            write()
        except BaseException as exc:
            self.done.set_exception(exc)
        else:
            self.done.set_result(None)

    def on_event(self, event: events.ProgressEvent) -> None:
        """Track this save's phases on `rank` (a progress callback of its writer)."""
        if event.step != self.step:
            return
        if event.phase != "blocked":  # the training thread's event, not a phase
            self.phase = event.phase
        if event.phase == "committed":
            self.committed.set()

    def failed(self) -> bool:
        return self.done.done() and self.done.exception() is not None

    def join(self, *, timeout: float | None = None) -> None:
        """Wait for the writer; its failure re-raised as a CheckpointError.

        `concurrent.futures.TimeoutError` when `timeout` passes first."""
        try:
            self.done.result(timeout=timeout)
        except (errors.CheckpointError, concurrent.futures.TimeoutError):
            raise
        except Exception as exc:
            raise errors.CheckpointError(f"checkpoint step {self.step} failed") from exc

    def wait_staged(self) -> None:
        try:
            self.staged.result()
        except Exception as exc:
            raise errors.CheckpointError(f"staging of step {self.step} failed") from exc

    def wait_committed(self, *, deadline: float | None, rank: int, grace: float | None) -> None:
        """Block until this rank committed the step (the writer's failure re-raised);
        past `deadline` a CheckpointError names the last phase finished."""
        while not self.committed.wait(0.02):
            if self.done.done():
                self.join()
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise errors.CheckpointError(
                    f"final checkpoint step {self.step} did not commit within the grace "
                    f"period ({grace}s minus a margin): last finished phase on rank "
                    f"{rank}: {self.phase}"
                )


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
    stager = staging.DefaultStager(
        staging.StagingOptions(
            use_pinned_memory=pinned,
            use_shared_memory=False,
            use_async_staging=True,
            use_non_blocking_copy=pinned,
        )
    )
    keep_copiers_between_stages(stager)
    return stager


def keep_copiers_between_stages(stager: staging.DefaultStager) -> None:
    """Close the inner StateDictStager once, with the stager, not after every stage.

    Before torch 2.15, `DefaultStager._stage` closes its StateDictStager after
    every stage, which empties its table of copiers; the next stage of any
    state dict then fails on a class object (`KeyError: <class 'type'>`): every
    second save of a pinned or thread mode failed (seen on an H200, torch
    2.11). torch 2.15 closes it only with the stager, which is what this
    restores; the staging buffers are then reused across saves there too.
    """
    inner = getattr(stager, "_state_dict_stager", None)
    if inner is None or not callable(getattr(inner, "close", None)):
        return
    close_inner = inner.close
    inner.close = lambda: None  # what torch < 2.15's _stage calls per stage
    close_outer = stager.close

    def close() -> None:
        close_outer()
        close_inner()

    stager.close = close  # type: ignore[method-assign]


def stage(
    stager: staging.DefaultStager | None, snapshot: StateDict
) -> concurrent.futures.Future[StateDict]:
    """Hand the snapshot to the stager (none with `asyncMode: off`)."""
    staged: StateDict | concurrent.futures.Future[StateDict]
    if stager is None:
        # Synchronous: DCP reads the live tensors while save() blocks.
        staged = snapshot
    else:
        # GPU: the staging stream waits for the compute queued so far.
        gpu.order_after_compute(stream=gpu.staging_stream(stager))
        staged = stager.stage(snapshot)
    if isinstance(staged, concurrent.futures.Future):
        return staged
    done_now: concurrent.futures.Future[StateDict] = concurrent.futures.Future()
    done_now.set_result(staged)
    return done_now
